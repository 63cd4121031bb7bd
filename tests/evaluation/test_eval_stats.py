"""Bootstrap intervals, the homogeneity test, Fisher's combination and the run reduction (no models)."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.exactness import fisher_combined, homogeneity_test
from evaluation.measurements import aggregate, itl_samples, per_prompt
from evaluation.plots import verified_size_rows
from evaluation.stats import paired_bootstrap_ratio, ratio_of_aggregates
from evaluation.summary import replay_vs_live, summarize, targets


def synthetic_prompts(n: int, seed: int, speedup: float = 1.3):
    """Per-prompt tokens and seconds of two controllers; A is ``speedup`` times faster with prompt noise."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(60, 129, n).astype(float)
    base_rate = rng.uniform(3.0, 5.0, n)  # prompts differ (language, content)
    seconds_b = tokens / base_rate
    seconds_a = seconds_b / speedup * rng.lognormal(0.0, 0.15, n)
    return tokens, seconds_a, tokens, seconds_b


def test_bootstrap_interval_contains_the_point_estimate_and_is_seeded():
    data = synthetic_prompts(12, seed=1)
    ci = paired_bootstrap_ratio(*data, resamples=2000, rng=7)
    assert ci["ratio"] == pytest.approx(ratio_of_aggregates(*data))
    assert ci["low"] < ci["ratio"] < ci["high"] and ci["prompts"] == 12
    assert paired_bootstrap_ratio(*data, resamples=2000, rng=7) == ci  # same seed: same interval
    other = paired_bootstrap_ratio(*data, resamples=2000, rng=np.random.default_rng(8))
    assert other["ratio"] == ci["ratio"] and (other["low"], other["high"]) != (ci["low"], ci["high"])


def test_bootstrap_interval_narrows_with_more_prompts():
    widths = []
    for n in (6, 24, 96):
        ci = paired_bootstrap_ratio(*synthetic_prompts(n, seed=3), resamples=2000, rng=0)
        assert ci["low"] <= ci["ratio"] <= ci["high"]
        widths.append(ci["high"] - ci["low"])
    assert widths[0] > widths[1] > widths[2]
    assert widths[2] < 0.5 * widths[0]


def test_bootstrap_edge_cases():
    one = paired_bootstrap_ratio([10.0], [2.0], [10.0], [4.0], resamples=100, rng=0)
    assert one["ratio"] == one["low"] == one["high"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="same non-zero number of prompts"):
        paired_bootstrap_ratio([1.0, 2.0], [1.0], [1.0], [1.0])
    with pytest.raises(ValueError):
        paired_bootstrap_ratio([], [], [], [])


def test_homogeneity_test_pools_small_categories():
    rng = np.random.default_rng(0)
    outcomes = [(0,), (1,), (2,)] + [(k,) for k in range(3, 40)]
    probs = np.asarray([0.4, 0.3, 0.2] + [0.1 / 37] * 37)
    draw = lambda n: [outcomes[i] for i in rng.choice(len(outcomes), n, p=probs)]  # noqa: E731
    same = homogeneity_test(draw(300), draw(300))
    assert same["test"].startswith("chi-square test of homogeneity")
    assert same["cells"] <= 4 and same["pooled_categories"] > 0 and same["dof"] == same["cells"] - 1
    assert same["pvalue"] > 1e-3
    shifted = homogeneity_test(draw(300), [(0,)] * 200 + draw(100))
    assert shifted["pvalue"] < 1e-6
    single = homogeneity_test([(1,)] * 50, [(1,)] * 40)
    assert single["pvalue"] == 1.0 and single["dof"] == 0


def test_fisher_combination():
    assert fisher_combined([0.3]) == 0.3
    assert fisher_combined([0.5, 0.5, 0.5]) > 0.3
    assert fisher_combined([1e-4, 1e-4]) < 1e-6


def _run(controller, pid, lang, total, tokens=10, rep=0):
    return {
        "controller": controller,
        "prompt_id": pid,
        "language": lang,
        "rep": rep,
        "num_tokens": tokens,
        "first_chunk": 1,
        "total_s": total,
        "ttft_s": 0.1,
        "decode_s": total - 0.1,
        "peak_memory_mb": 1.0,
        "cycles": [[3, 0.3, 2, 2, 2], [1, 0.1, -1, -1, 0]],
    }


def test_reduction_takes_the_median_over_repetitions():
    runs = [_run("x", "p1", "it", t, rep=i) for i, t in enumerate((1.0, 5.0, 2.0))] + [
        _run("x", "p2", "en", 4.0)
    ]
    rows = per_prompt(runs)["x"]
    assert rows["p1"]["total_s"] == 2.0 and rows["p1"]["reps"] == 3
    agg = aggregate(list(rows.values()))
    assert agg["tokens_per_s"] == pytest.approx(20 / 6.0)
    assert agg["mean_accepted"] == pytest.approx(2.0)  # autoregressive steps are not speculative cycles
    np.testing.assert_allclose(itl_samples([[3, 0.3, 2, 2, 2], [1, 0.1, -1, -1, 0]]), [0.1] * 4)


def test_replay_vs_live_separates_machine_drift_from_prediction_error():
    replay = {
        "predicted": {"autoregressive": {"tokens_per_s": 4.4}, "learned": {"tokens_per_s": 5.5}},
        "oracle_tokens_per_s": 6.0,
    }
    table = {
        "autoregressive": {"all": {"decode_tokens_per_s": 4.4 / 1.08}},
        "learned": {"all": {"decode_tokens_per_s": 5.5 / 1.08}},
    }
    fid = replay_vs_live(replay, table)
    # the machine ran 8% slower than when profiled: both are 1.08, and relative to autoregressive 1.0
    assert fid["learned"]["replay_over_live"] == pytest.approx(1.08)
    assert fid["learned"]["relative_to_autoregressive"] == pytest.approx(1.0)
    assert fid["autoregressive"]["relative_to_autoregressive"] == pytest.approx(1.0)
    assert "relative_to_autoregressive" not in fid["oracle"]
    target = targets({}, fid, "learned")[-1]
    assert target["pass"] is True and "off by +0.0%" in target["detail"]
    # a prediction error of the learned policy's own: 20% off while autoregressive is exact
    table["autoregressive"]["all"]["decode_tokens_per_s"] = 4.4
    table["learned"]["all"]["decode_tokens_per_s"] = 5.5 / 1.2
    fid = replay_vs_live(replay, table)
    assert fid["learned"]["relative_to_autoregressive"] == pytest.approx(1.2)
    target = targets({}, fid, "learned")[-1]
    assert target["pass"] is False and "off by +20.0%" in target["detail"]
    # without autoregressive in the run: no relative figure, the target line stays plain
    fid = replay_vs_live({"predicted": {"learned": {"tokens_per_s": 5.5}}}, {"learned": table["learned"]})
    assert "relative_to_autoregressive" not in fid["learned"]
    assert "off by" not in targets({}, fid, "learned")[-1]["detail"]


def test_action_map_plots_the_nodes_verified_not_the_ladder_value_asked_for():
    # (ctx, depth, nodes drafted, top p, size asked): a depth-2 chain asked for 32 verifies 2
    rows = [(80, 2, 2, 0.9, 32), (81, 1, 1, 0.4, 1), (82, 4, 16, 0.7, 6)]
    got = verified_size_rows(rows)
    assert got[:, 4].tolist() == [2.0, 1.0, 6.0]
    assert got[:, :4].tolist() == [list(map(float, r[:4])) for r in rows]


def test_targets_read_the_headline_row_against_the_fastest_of_each_kind():
    """A policy trained with context lookup is judged on learned+lookup: best static is the faster of the lookup
    engine's static chain and no drafting, llama.cpp's speculative the faster of its draft model and its
    n-gram lookup; without a headline the plain learned row is judged as before."""
    seconds = {
        "autoregressive": 2.0,
        "learned": 1.9,
        "learned+lookup": 1.5,
        "autoregressive+lookup": 1.6,
        "static_chain+lookup": 1.8,
        "static_chain": 1.95,
        "llama_cpp": 1.4,
        "llama_cpp_spec": 2.5,
        "llama_cpp_lookup": 1.45,
    }
    runs = [
        _run(name, f"p{i}", lang, total * (1 + 0.01 * i))
        for name, total in seconds.items()
        for i, lang in enumerate(("it", "en", "zh", "es"))
    ]
    results = {"runs": runs, "best_static": "static_chain", "headline": "learned+lookup"}
    summary = summarize(results, resamples=200)
    assert summary["headline"] == "learned+lookup"
    by_target = {t["target"].split(" >= ")[-1]: t for t in summary["targets"]}
    static = by_target["1.05x best grid-searched static"]
    assert static["target"].startswith("learned+lookup >=")
    assert "/ autoregressive+lookup" in static["detail"] and static["value"] == pytest.approx(1.6 / 1.5)
    spec = next(t for k, t in by_target.items() if k.startswith("1.5x llama.cpp"))
    assert "/ llama_cpp_lookup" in spec["detail"] and spec["value"] == pytest.approx(1.45 / 1.5)
    assert spec["pass"] is False
    plain = summarize({**results, "headline": None}, resamples=200)
    assert plain["headline"] == "learned"
    static = next(t for t in plain["targets"] if "grid-searched static" in t["target"])
    assert "learned / static_chain" in static["detail"] and static["value"] == pytest.approx(1.95 / 1.9)
