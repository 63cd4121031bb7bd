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
