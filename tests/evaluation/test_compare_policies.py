"""benchmarks/compare_policies.py on the tiny pair: every controller runs every prompt, greedy output is
the autoregressive output, ratios are reported for each policy, bad arguments are refused."""

from __future__ import annotations

import json

import pytest

from tests_evaluation_helpers import CACHE, load_benchmark


def load_script():
    return load_benchmark("compare_policies")


def run_tiny(workdir, policy, out, *extra: str) -> int:
    """The script on the tiny pair, one prompt a language x 12 tokens, JSON written to ``out``."""
    common = ["--pair", "tiny", "--threads", "1", "--prompts-per-language", "1", "--max-new-tokens", "12"]
    return load_script().main(
        ["--policy", str(policy), *extra, *common, "--bootstrap", "50", "--cache-dir", str(workdir / CACHE)]
        + ["--out", str(out)]
    )


def test_compare_policies_runs_every_controller(workdir, tiny_policy, capsys):
    out = workdir / "compare.json"
    rc = run_tiny(workdir, tiny_policy, out, "--static", "2,2,1", "1,2,2")
    assert rc == 0
    data = json.loads(out.read_text())
    names = list(data["tokens_per_s"])
    assert names[:3] == ["autoregressive", "static chain (2,2,W1)", "static tree (1,2,W2)"]
    # the analytic controller (on by default, --no-analytic drops it), then the policy
    assert len(names) == 5 and names[3] == "analytic (W1)" and names[4].startswith("learned ")
    prompts = len(data["runs"]["autoregressive"])
    assert prompts >= 2
    for name in names:
        assert set(data["runs"][name]) == set(data["runs"]["autoregressive"])
        assert data["identical_to_ar"][name] == prompts  # greedy speculative decoding == autoregressive
        assert data["tokens_per_s"][name] > 0
    assert set(data["ratios"]) == {f"{names[4]} / {names[k]}" for k in (1, 2, 3)}
    assert set(data["decode_ratios"]) == set(data["ratios"])
    for r in [*data["ratios"].values(), *data["decode_ratios"].values()]:
        assert r["low"] <= r["ratio"] <= r["high"] and r["prompts"] == prompts
    for name in names:  # decode only excludes the prefill: faster than end to end
        assert data["decode_tokens_per_s"][name] > data["tokens_per_s"][name]
    assert "paired ratios" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--static", "2,2"], ["--static", "0,2,1"]])
def test_compare_policies_refuses_bad_static(tiny_policy, extra, capsys):
    with pytest.raises(SystemExit) as err:
        load_script().main(["--policy", str(tiny_policy), *extra])
    assert err.value.code == 2 and "D,V,W" in capsys.readouterr().err


def test_compare_policies_refuses_a_policy_twice(tiny_policy, capsys):
    with pytest.raises(SystemExit):
        load_script().main(["--policy", str(tiny_policy), str(tiny_policy)])
    assert "twice" in capsys.readouterr().err


def test_compare_policies_refuses_a_missing_policy(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_script().main(["--policy", str(tmp_path / "nope.pt")])
    assert "no policy file" in capsys.readouterr().err


def test_compare_policies_refuses_an_unknown_weight_format(tiny_policy, capsys):
    with pytest.raises(SystemExit) as err:
        load_script().main(["--policy", str(tiny_policy), "--pair", "tiny", "--weights", "int3"])
    assert err.value.code == 2 and "int3" in capsys.readouterr().err


def test_compare_policies_refuses_a_bad_profile_before_loading(tiny_policy, tmp_path, capsys):
    bad = tmp_path / "profile.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as err:
        load_script().main(["--policy", str(tiny_policy), "--pair", "tiny", "--profile", str(bad)])
    assert err.value.code == 2 and "--profile" in capsys.readouterr().err


def test_compare_policies_with_context_lookup(workdir, tiny_policy):
    out = workdir / "compare_lookup.json"
    rc = run_tiny(workdir, tiny_policy, out, "--static", "2,2,1", "--lookup", "1-2:3")
    assert rc == 0
    data = json.loads(out.read_text())
    names = list(data["tokens_per_s"])
    # the plain autoregressive row stays the reference; every other row runs with lookup
    assert names[0] == "autoregressive" and names[1] == "autoregressive + lookup 1-2:3"
    assert names[2] == "static chain (2,2,W1) + lookup 1-2:3" and names[3].endswith("+ lookup 1-2:3")
    prompts = len(data["runs"]["autoregressive"])
    assert all(data["identical_to_ar"][n] == prompts for n in names)
    lookup_cycles = sum(c[5] for run in data["runs"][names[1]].values() for c in run["cycles"])
    assert lookup_cycles > 0  # lookup proposed on these prompts (the count is the rows' sixth field)


def test_compare_policies_refuses_a_bad_lookup(tiny_policy, capsys):
    with pytest.raises(SystemExit) as err:
        load_script().main(["--policy", str(tiny_policy), "--pair", "tiny", "--lookup", "sometimes"])
    assert err.value.code == 2 and "sometimes" in capsys.readouterr().err
