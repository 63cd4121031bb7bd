"""benchmarks/replay_policies.py on the tiny pair: every row is replayed, the oracle bounds them all, and
--lookup replays every row with the engine's context lookup (lookup alone as the autoregressive row)."""

from __future__ import annotations

import json

import pytest

from tests_evaluation_helpers import CACHE, load_benchmark


def replay(workdir, policy, out, *extra: str) -> dict:
    rc = load_benchmark("replay_policies").main(
        ["--policy", str(policy), "--prompts-per-language", "1", "--tune-prompts-per-language", "1"]
        + ["--cache-dir", str(workdir / CACHE), "--out", str(out), *extra]
    )
    assert rc == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plain(workdir, tiny_policy) -> dict:
    return replay(workdir, tiny_policy, workdir / "replay_plain.json", "--lookup", "off")


def test_every_row_is_replayed_and_the_oracle_bounds_them(plain, tiny_policy):
    rows = plain["rows"]
    names = list(rows)
    assert names[0] == "autoregressive" and names[-1] == "oracle"
    assert any(n.startswith("static ") for n in names) and any(n.startswith("learned ") for n in names)
    assert all(v > 0 for v in rows.values())
    assert all(rows["oracle"] >= v * (1 - 1e-9) for v in rows.values())
    assert plain["lookup"] == "off" and plain["policies"] == [str(tiny_policy)]


def test_lookup_replays_every_row_with_it(workdir, tiny_policy, plain):
    data = replay(workdir, tiny_policy, workdir / "replay_lookup.json", "--lookup", "1-2:3")
    assert data["lookup"] == "1-2:3" and list(data["rows"])[0] == "autoregressive"
    rows = data["rows"]
    assert all(rows["oracle"] >= v * (1 - 1e-9) for v in rows.values())
    # the autoregressive row is lookup alone now: it differs from plain autoregressive decoding
    assert rows["autoregressive"] != pytest.approx(plain["rows"]["autoregressive"], rel=1e-9)


def test_a_bad_lookup_is_refused(tiny_policy, capsys):
    with pytest.raises(SystemExit) as err:
        load_benchmark("replay_policies").main(["--policy", str(tiny_policy), "--lookup", "sometimes"])
    assert err.value.code == 2 and "sometimes" in capsys.readouterr().err


def test_features_profile_conditions_the_policies_not_the_clock(workdir, tiny_policy, monkeypatch):
    """--features-profile: the policies (and the analytic controller) believe another device, every time is
    still charged from --profile, so the rows that read no profile stay as they were."""
    import numpy as np

    from engine.costs.cost_profile import CostProfile

    module = load_benchmark("replay_policies")
    measured = CostProfile.load(next((workdir / CACHE).rglob("profile*.json")))
    # the device the times are charged from: the measured one with its draft step 100x cheaper, so drafting
    # pays there whatever the measurement on a busy machine gave (the analytic row must draft with it)
    real = json.loads(json.dumps(measured.to_dict()))
    real["draft_step_table"] = (np.asarray(real["draft_step_table"]) * 0.01).tolist()
    real_path = workdir / "real_profile.json"
    real_path.write_text(json.dumps(real))
    real = CostProfile.load(real_path)
    believed = json.loads(json.dumps(real.to_dict()))
    believed["draft_step_table"] = (np.asarray(believed["draft_step_table"]) * 1000.0).tolist()
    believed_path = workdir / "believed_profile.json"
    believed_path.write_text(json.dumps(believed))
    seen = []
    original = module.load_policy
    monkeypatch.setattr(
        module, "load_policy", lambda p, profile=None: seen.append(profile) or original(p, profile=profile)
    )
    common = ["--policy", str(tiny_policy), "--prompts-per-language", "1", "--tune-prompts-per-language", "1"]
    common += ["--cache-dir", str(workdir / CACHE), "--lookup", "off", "--profile", str(real_path)]
    runs = {}
    for name, extra in (("real", []), ("believed", ["--features-profile", str(believed_path)])):
        out = workdir / f"replay_{name}.json"
        assert module.main(common + ["--out", str(out), *extra]) == 0
        runs[name] = json.loads(out.read_text())
    assert (
        runs["believed"]["features_profile"] == str(believed_path)
        and runs["real"]["features_profile"] is None
    )
    assert np.allclose(seen[0].draft_step_table, real.draft_step_table)
    assert np.allclose(seen[1].draft_step_table, 1000.0 * np.asarray(real.draft_step_table))
    real_rows, believed_rows = runs["real"]["rows"], runs["believed"]["rows"]
    for name in real_rows:
        if name == "autoregressive" or name == "oracle" or name.startswith("static "):
            assert believed_rows[name] == pytest.approx(real_rows[name], rel=1e-9)  # nothing believed there
    # the analytic controller plans with the believed device (drafting 1000x dearer): it stops drafting
    assert believed_rows["analytic"] != pytest.approx(real_rows["analytic"], rel=1e-9)
