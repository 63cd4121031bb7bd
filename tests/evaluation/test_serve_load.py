"""benchmarks/serve_load.py's Poisson run whose rate changes during the run (``--rate-schedule``): the schedule
is parsed and refused in one line, its arrivals are seeded and drawn at each piece's rate (one rate: the
arrivals of ``--rates``), and a run on the tiny pair reports it as one level with every figure of the others,
greedy identity included, on a row of the per-load static table served live."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from policies.static import write_batch_size_table
from serving.load_client import Outcome, arrival_times
from tests_evaluation_helpers import load_benchmark


@pytest.fixture(scope="module")
def serve_load():
    return load_benchmark("serve_load")


def test_a_schedule_is_rates_and_request_counts_in_order(serve_load):
    schedule = serve_load.parse_schedule("0.1:6, 0.6:12,0.1:6")
    assert schedule == [(0.1, 6), (0.6, 12), (0.1, 6)]
    assert serve_load.schedule_label(schedule) == "0.1:6,0.6:12,0.1:6"
    for bad in ("0.1", "0:3", "-1:3", "nan:3", "inf:3", "0.5:0", "0.5:1.5", "x:2", "0.5:2,", ":"):
        with pytest.raises(ValueError, match="--rate-schedule"):
            serve_load.parse_schedule(bad)


def test_arrivals_are_seeded_and_drawn_at_each_pieces_rate(serve_load):
    schedule = [(0.5, 3), (50.0, 4), (0.5, 2)]
    times = arrival_times(schedule, seed=3)
    assert len(times) == 9 and times[0] == 0.0 and times == sorted(times)
    assert times == arrival_times(schedule, seed=3)  # seeded
    assert times != arrival_times(schedule, seed=4)
    rng = random.Random(3)  # the gap before each request: one draw of one generator at that request's rate
    rates = [0.5] * 3 + [50.0] * 4 + [0.5] * 2
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps == pytest.approx([rng.expovariate(rate) for rate in rates[1:]])
    # one rate: the arrivals of the plain Poisson levels (--rates), request i after i gaps at that rate
    rng = random.Random(0)
    plain, now = [], 0.0
    for _ in range(5):
        plain.append(now)
        now += rng.expovariate(2.0)
    assert arrival_times([(2.0, 5)], seed=0) == pytest.approx(plain)


def test_a_bad_schedule_is_one_error_line_before_anything_loads(serve_load, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        pytest.fail("the prompts were loaded before the arguments were checked")

    monkeypatch.setattr(serve_load, "load_suite", refuse)
    with pytest.raises(SystemExit) as exit_:
        serve_load.main(["--pair", "tiny", "--no-llama", "--rate-schedule", "0.2:3,0.5"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --rate-schedule") and "'0.5'" in lines[0]


def test_a_scheduled_poisson_run_is_one_level_with_every_figure(serve_load, tmp_path):
    table = write_batch_size_table({(1, 1): 2, (2, 256): 0}, tmp_path / "table.json")
    out = tmp_path / "load.json"
    argv = ["--pair", "tiny", "--no-llama", "--threads", "1", "--concurrency", "1", "--max-tokens", "6"]
    argv += ["--prompts-per-language", "1", "--rate-schedule", "5:2,50:3", "--json", str(out)]
    argv += [
        "--ours",
        f"test-schedule=--policy table:{table}",
        "--long-mix",
        "150",
        "--long-mix-clients",
        "2",
    ]
    assert serve_load.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    closed, mix, entry = results
    # the long-prompt mix: short streams around one 150-token prompt, its first token and their largest gap
    assert mix["mode"] == "long-mix" and mix["level"] == 150 and mix["errors"] == 0 and mix["long_ok"]
    assert mix["long_ttft_s"] > 0 and mix["gap_max_s"] > 0 and mix["identical"] == 1.0
    assert (closed["mode"], entry["mode"]) == ("closed", "poisson-schedule")
    assert entry["row"] == "ours test-schedule" and entry["level"] == "5:2,50:3"
    assert set(entry) == set(closed)  # the figures of every level (the ITL percentiles among them)
    assert entry["requests"] == 5 and entry["errors"] == 0 and entry["tokens"] == 5 * 6
    assert entry["identical"] == 1.0  # each text is the same prompt's alone (the closed level at 1 client)
    for key in ("tok_s", "ttft_p50", "ttft_p99", "latency_p50", "latency_p99"):
        assert entry[key] > 0, key
    # the tiny pair's steps are shorter than a burst (BURST_S): its tokens arrive as one, no gap to report
    assert all(math.isnan(entry[k]) or entry[k] > 0 for k in ("itl_p50", "itl_p99"))


def test_the_long_mix_gap_is_the_largest_wait_overlapping_the_long_prefill(serve_load):
    """A short stream's waits between chunks count when they overlap the long prompt's wait for its first token
    (sent at 10 s, first token at 12 s); the largest is set against the streams' median inter-token latency; a
    short request that waited for its first token then counts apart."""
    long = Outcome(-1, True, ttft=2.0, start=10.0)
    before = Outcome(
        0, True, ttft=0.5, start=8.0, times=[8.5, 8.6, 9.9, 10.2], itl=[0.1] * 3
    )  # 0.3 s overlaps
    across = Outcome(1, True, ttft=0.5, start=9.0, times=[9.5, 11.8, 11.9, 13.5], itl=[0.1] * 3)  # 2.3 s
    waited = Outcome(2, True, ttft=2.5, start=10.5, times=[13.0, 13.1], itl=[0.1])  # its first token: 2.5 s
    figures = serve_load.long_mix_figures([before, across, waited], long)
    assert figures["gap_max_s"] == pytest.approx(2.3) and figures["long_ttft_s"] == 2.0
    assert figures["gap_over_itl_p50"] == pytest.approx(23.0) and figures["short_ttft_max_s"] == 2.5
    alone = serve_load.long_mix_figures([before], long)
    assert alone["gap_max_s"] == pytest.approx(0.3)  # 9.9 -> 10.2 overlaps, 8.6 -> 9.9 does not
    assert math.isnan(alone["short_ttft_max_s"])  # its first token came before the long prompt was sent


def test_a_multi_turn_run_reports_turns_hits_and_identity_against_the_cold_row(serve_load, tmp_path):
    """``--workload multi-turn`` on the tiny pair: conversations turn after turn on a server with its prefix
    cache and one without; the cached row reports hits (the cold one none) and every turn's text equals the
    cold row's; a level listed twice runs twice on one server."""
    out = tmp_path / "chat.json"
    argv = [
        "--pair",
        "tiny",
        "--no-llama",
        "--threads",
        "1",
        "--workload",
        "multi-turn",
        "--concurrency",
        "1,2,2",
    ]
    argv += ["--turns", "3", "--max-tokens", "6", "--system-tokens", "200", "--document-tokens", "60"]
    argv += ["--ours", "hot=--autoregressive", "--ours", "cold=--autoregressive --no-prefix-cache"]
    argv += ["--json", str(out)]
    assert serve_load.main(argv) == 0
    data = json.loads(out.read_text())
    results = data["results"]
    assert [(e["row"], e["level"], e["run"]) for e in results] == [
        ("ours cold", 1, 0), ("ours cold", 2, 1), ("ours cold", 2, 2),
        ("ours hot", 1, 0), ("ours hot", 2, 1), ("ours hot", 2, 2),
    ]  # fmt: skip
    for e in results:
        assert e["errors"] == 0 and e["requests"] == 3 * e["level"] and e["identical"] == 1.0
        assert e["tokens"] == 6 * e["requests"] and e["turn3_ttft_p50"] > 0 and e["rss_mb"] > 0
        assert (e["hit_rate"] > 0.3) if e["row"] == "ours hot" else (e["hit_rate"] == 0)
    assert data["conditions"]["workload"]["turns"] == 3
    with pytest.raises(SystemExit):
        serve_load.main(["--pair", "tiny", "--no-llama", "--workload", "multi-turn", "--turns", "0"])


def test_a_prompt_set_is_named_and_a_bad_one_is_one_error_line(serve_load, capsys, monkeypatch):
    """--prompts names a built-in set (envs.prompts.PROMPT_SETS) or a file, --split its split."""
    seen = {}

    def build_rows(args, *rest):
        seen["args"] = args
        return []  # no server: the prompts were read and tokenised, then nothing runs

    monkeypatch.setattr(serve_load, "build_rows", build_rows)
    argv = ["--pair", "tiny", "--no-llama", "--prompts", "grounded", "--prompts-per-language", "1"]
    assert serve_load.main(argv) == 0
    assert seen["args"].prompts == "grounded" and seen["args"].split == "test"
    for bad in (["--prompts", "no-such-set"], ["--prompts", "grounded", "--split", "dev"]):
        with pytest.raises(SystemExit) as exit_:
            serve_load.main(["--pair", "tiny", "--no-llama", *bad])
        assert exit_.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --prompts"), lines


# ------------------------------------------------------------------------------ paired ratios (--ratio)
def level(row: str, repeat: int, requests: list[tuple[int, int, float]], mode: str = "closed", n: int = 1):
    """A level's result entry of ``row``: per request (prompt, tokens, latency), sent in that order."""
    seen: dict[int, int] = {}
    per = []
    for prompt, tokens, latency in requests:
        seen[prompt] = seen.get(prompt, -1) + 1
        per.append([prompt, seen[prompt], tokens, latency])
    tokens = sum(r[1] for r in requests)
    wall = sum(r[2] for r in requests) / n
    return {"row": row, "repeat": repeat, "mode": mode, "level": n, "tokens": tokens, "wall_s": wall} | {
        "per_request": per
    }


def test_a_ratio_is_two_row_names(serve_load):
    assert serve_load.parse_ratio("goodput/ar") == ("goodput", "ar")
    assert serve_load.resolve_ratio(("goodput", "llama ar"), ["ours goodput", "llama ar"]) == (
        "ours goodput",
        "llama ar",
    )
    for bad in ("goodput", "a/", "/b", "a/b/c", "a/a"):
        with pytest.raises(ValueError, match="--ratio"):
            serve_load.parse_ratio(bad)
    with pytest.raises(ValueError, match="no row 'x'"):
        serve_load.resolve_ratio(("x", "ar"), ["ours ar"])


def test_a_known_case_is_the_ratio_of_summed_rates_and_brackets_it(serve_load):
    """A's requests take 0.5 to 0.8 of B's time: the ratio is B's summed latency over A's (equal tokens), and
    its interval lies within the pairs' own ratios."""
    factors = [0.5, 0.6, 0.7, 0.8] * 3
    b = [(i % 4, 64, 2.0 + 0.1 * i) for i in range(12)]
    a = [(p, n, t * f) for (p, n, t), f in zip(b, factors)]
    results = [level("ours a", 0, a), level("ours b", 0, b)]
    (r,) = serve_load.paired_ratios(results, "ours a", "ours b", resamples=4000)
    expected = sum(t for _, _, t in b) / sum(t for _, _, t in a)
    assert r["pairs"] == 12 and r["ratio"] == pytest.approx(expected)
    assert 1 / 0.8 <= r["low"] < r["ratio"] < r["high"] <= 1 / 0.5
    again = serve_load.paired_ratios(results, "ours a", "ours b", resamples=4000)
    assert again == [r]  # seeded


def test_degenerate_cases(serve_load):
    # one pair: nothing to resample, the interval is the point
    results = [level("ours a", 0, [(0, 10, 1.0)]), level("ours b", 0, [(0, 10, 2.0)])]
    (r,) = serve_load.paired_ratios(results, "ours a", "ours b")
    assert r["ratio"] == r["low"] == r["high"] == pytest.approx(2.0) and r["pairs"] == 1
    # identical rows: exactly 1
    same = [(i % 3, 32, 1.0 + i) for i in range(9)]
    results = [level("ours a", 0, same), level("ours b", 0, same)]
    (r,) = serve_load.paired_ratios(results, "ours a", "ours b")
    assert r["ratio"] == r["low"] == r["high"] == pytest.approx(1.0)
    # no shared request (another prompt) or a level only one row ran: no ratio
    results = [level("ours a", 0, [(0, 10, 1.0)]), level("ours b", 0, [(1, 10, 1.0)])]
    assert serve_load.paired_ratios(results, "ours a", "ours b") == []
    results = [level("ours a", 0, same, n=4), level("ours b", 0, same, n=1)]
    assert serve_load.paired_ratios(results, "ours a", "ours b") == []


def test_negative_and_positive_controls(serve_load):
    """Two rows of the same server (latencies drawn alike, prompts that differ a lot): the interval holds 1 in
    about 95% of draws. One row 25% faster: every interval excludes 1."""
    prompts = [i % 8 for i in range(24)]

    def rows(seed: int, scale: float):
        rng = np.random.default_rng(seed)
        base = rng.uniform(1.0, 4.0, 24)
        a, b = (base * s * rng.normal(1.0, 0.05, 24) for s in (scale, 1.0))
        results = [level(name, 0, [(p, 64, t) for p, t in zip(prompts, x)]) for name, x in (("ours a", a), ("ours b", b))]  # fmt: skip
        (r,) = serve_load.paired_ratios(results, "ours a", "ours b", resamples=1000, seed=seed)
        return r

    null = [rows(seed, 1.0) for seed in range(60)]
    covered = sum(r["low"] <= 1.0 <= r["high"] for r in null)
    assert covered >= 50  # 95% nominal: 57 expected; a percentile bootstrap of 24 pairs covers a little less
    faster = [rows(seed, 0.8) for seed in range(20)]
    assert all(r["low"] > 1.0 for r in faster)
    assert np.median([r["ratio"] for r in faster]) == pytest.approx(1.25, rel=0.02)


def test_repeat_pairs_are_a_levels_tokens_and_wall_time(serve_load):
    reqs = [(0, 10, 1.0), (1, 10, 1.0)]
    results = []
    for rep, (ta, tb) in enumerate([(1.0, 2.0), (1.0, 1.5), (1.0, 2.5)]):
        results += [
            level("ours a", rep, [(p, n, t * ta) for p, n, t in reqs]),
            level("ours b", rep, [(p, n, t * tb) for p, n, t in reqs]),
        ]
    (r,) = serve_load.paired_ratios(results, "ours a", "ours b", unit="repeat")
    assert r["unit"] == "repeat" and r["pairs"] == 3 and r["ratio"] == pytest.approx(2.0)
    assert 1.5 <= r["low"] <= r["ratio"] <= r["high"] <= 2.5


def test_per_request_keys_follow_the_sending_order(serve_load):
    outcomes = [
        Outcome(1, True, tokens=5, latency=2.0, start=3.0),
        Outcome(0, True, tokens=5, latency=1.0, start=1.0),
        Outcome(1, True, tokens=5, latency=1.5, start=2.0),
        Outcome(0, False, start=4.0),
    ]
    assert serve_load.per_request(outcomes) == [[0, 0, 5, 1.0], [1, 0, 5, 1.5], [1, 1, 5, 2.0]]
