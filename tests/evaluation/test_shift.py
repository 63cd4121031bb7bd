"""The shift evaluation (``python evaluate.py shift``): replay matrices on synthetic traces (no model), then one
end-to-end run on the tiny pair with live confirmation (greedy and sampled)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "envs"))

from engine.control import StaticController  # noqa: E402
from envs.replay import ReplayTrace  # noqa: E402
from evaluation import shift, shift_config, shift_report  # noqa: E402
from policies.heuristic import ConfidenceController  # noqa: E402
from tests_envs_helpers import LinearProfile, make_synthetic_trace  # noqa: E402
from tests_evaluation_helpers import CACHE, run_cli  # noqa: E402


def _traces(seeds, follow):
    return [ReplayTrace(make_synthetic_trace(s, width=1, follow=follow)) for s in seeds]


def test_task_families_and_slices():
    assert [
        shift_config.task_family({"task": t}) for t in ("code", "math", "qa", "rewrite", "explanation", "x")
    ] == [
        "code",
        "math",
        "prose",
        "prose",
        "prose",
        "other",
    ]
    items = [
        {"language": "zh", "task": "qa"},
        {"language": "it", "task": "code"},
        {"language": "fr", "task": "qa"},
    ]
    assert shift_config.slice_names("language", items, []) == ["it", "zh", "fr"]
    assert shift_config.slice_names("task", items, []) == ["code", "prose"]
    assert shift_config.slice_names("temperature", items, [0.0, 0.7, 1.0]) == ["T0", "T0.7", "T1"]
    assert shift_config.slice_names("length", items, []) == ["short", "long"]


def test_the_long_suite_is_parallel_across_languages_and_long():
    from envs.prompts import LANGUAGES, LONG_SUITE, load_suite

    items = load_suite(LONG_SUITE)
    by_lang = {lang: [i for i in items if i["language"] == lang] for lang in LANGUAGES}
    assert all(len(v) == 7 for v in by_lang.values()) and len(items) == 28
    for rank, first in enumerate(by_lang["en"]):
        # same task, split and context in every language (only the instruction is translated)
        twins = [by_lang[lang][rank] for lang in LANGUAGES]
        assert {t["split"] for t in twins} == {first["split"]} and {t["task"] for t in twins} == {
            first["task"]
        }
        assert {t["prompt"].split("\n\n", 1)[1] for t in twins} == {first["prompt"].split("\n\n", 1)[1]}
        assert len(first["prompt"]) > 5000  # ~1.3k tokens and up, with the Qwen2.5 tokenizer
    assert [len(load_suite(LONG_SUITE, split=s)) for s in ("train", "tune", "test")] == [8, 8, 12]


def test_live_prompts_spread_over_languages_and_items():
    items = [
        {"id": f"{lang}-{task}-{n:02d}", "language": lang, "task": task}
        for lang in ("it", "en", "zh")
        for n, task in enumerate(("code", "math"))
    ]
    picked = [p["id"] for p in shift.pick_live_prompts(items, 4)]
    # languages round robin; an item taken in one language is skipped in the next while another is left
    assert picked == ["it-code-00", "en-math-01", "zh-code-00", "it-math-01"]
    assert [p["id"] for p in shift.pick_live_prompts(items, 1)] == ["it-code-00"]
    assert len(shift.pick_live_prompts(items, 99)) == len(items)


def test_the_static_grid_keeps_no_speculation_where_drafting_never_pays():
    cheap, dear = LinearProfile(a=0.001, b=0.0, d=0.0005), LinearProfile(a=0.5, b=0.0)
    traces = _traces(range(3), follow=0.95)
    (depth, size), _ = shift.best_static(traces, cheap, max_depth=6)
    assert depth >= 2 and size >= 1
    (depth, size), tps = shift.best_static(traces, dear, max_depth=6)
    assert (depth, size) == (0, 0)
    assert tps == pytest.approx(shift.rate(shift.per_trace(traces, None, dear)))  # = autoregressive


def test_axis_matrix_is_consistent_with_its_own_replays():
    profile = LinearProfile(a=0.004, b=0.0, d=0.002)
    tune = {"easy": _traces(range(0, 3), 0.95), "hard": _traces(range(3, 6), 0.3)}
    test = {"easy": _traces(range(6, 10), 0.95), "hard": _traces(range(10, 14), 0.3)}
    controllers = {
        "learned": lambda: ConfidenceController(0.3, max_depth=6, tree_width=1),
        "analytic": lambda: StaticController(2, 2, tree_width=1),
        "confidence": lambda: ConfidenceController(0.4, max_depth=6, tree_width=1),
    }
    res = shift.evaluate_axis("language", tune, test, controllers, profile, 6, 1, 200, 0)
    assert res["slices"] == ["easy", "hard"]
    assert res["tuned"]["easy"]["depth"] > res["tuned"]["hard"]["depth"]  # the slices really differ
    for b in res["slices"]:
        tps = res["test"][b]["tokens_per_s"]
        statics = [tps[f"static@{a}"] for a in res["slices"]]
        assert tps["static_hindsight"] >= max(statics) - 1e-9  # the best static on B's own prompts
        assert (
            tps["oracle"] >= max(v for k, v in tps.items() if k != "oracle") - 1e-9
        )  # bounds every controller
        for a in res["slices"]:
            cell = res["cells"][a][b]
            assert cell["learned_over_static"]["ratio"] == pytest.approx(tps["learned"] / tps[f"static@{a}"])
            assert cell["learned_over_static"]["low"] <= cell["learned_over_static"]["ratio"]
            assert cell["learned_over_static"]["ratio"] <= cell["learned_over_static"]["high"]
        assert res["cells"][b][b]["static_over_in_slice"] == pytest.approx(1.0)
    # transplanting the shallow setting onto the easy slice loses against the one tuned there
    assert res["cells"]["hard"]["easy"]["static_over_in_slice"] < 1.0
    summary = shift_report.summarize({"axes": {"language": res}})
    assert summary["off_diagonal_cells"] == 2
    off = [res["cells"]["easy"]["hard"], res["cells"]["hard"]["easy"]]
    assert summary["off_diagonal_mean"] == pytest.approx(
        np.mean([c["learned_over_static"]["ratio"] for c in off])
    )
    assert set(summary["diagonal"]) == {"language:easy", "language:hard"}
    assert summary["learned_over_oracle_min"] <= 1.0 + 1e-9
    cells = shift.live_cells("temperature", res)
    assert cells[:2] == [("easy", "easy"), ("hard", "hard")] and ("easy", "hard") in cells


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--axes", "language,colour"], "--axes"),
        (["--temperatures", "0,warm"], "--temperatures"),
        (["--temperatures", "0,0"], "--temperatures"),
        (["--live-prompts-per-slice", "0"], "--live-prompts-per-slice"),
        (["--test-prompts-per-language", "0"], "--test-prompts-per-language"),
        (["--long-max-new-tokens", "0"], "--long-max-new-tokens"),
        (["--long-test-prompts-per-language", "0"], "--long-test-prompts-per-language"),
        (["--lookup", "3-"], "lookup setting"),
    ],
)
def test_bad_flags_are_one_error_line_and_nothing_written(flags, needle, tmp_path):
    out = tmp_path / "shift"
    rc, stdout, stderr = run_cli(["shift", "--pair", "tiny", "--out", str(out), *flags])
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], stderr
    assert not out.exists()


def test_end_to_end_on_the_tiny_pair_with_live_confirmation(workdir, tiny_policy):
    out = workdir / "shift"
    long_suite = workdir / "long.jsonl"
    context = " ".join(f"def f{i}(x): return x + {i}" for i in range(12))
    long_suite.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"{lang}-long-{split}",
                    "language": lang,
                    "task": "code",
                    "split": split,
                    "prompt": f"Write tests ({lang}):\n\n{context}",
                }
            )
            + "\n"
            for lang in ("it", "en")
            for split in ("tune", "test")
        )
    )
    rc, stdout, stderr = run_cli(
        [
            "shift",
            "--pair",
            "tiny",
            "--threads",
            "1",
            "--policy",
            str(tiny_policy),
            "--cache-dir",
            str(workdir / CACHE),
            "--out",
            str(out),
            "--axes",
            "task,temperature,length",
            "--long-suite",
            str(long_suite),
            "--long-max-new-tokens",
            "24",
            "--temperatures",
            "0,0.8",
            "--max-new-tokens",
            "16",
            "--tune-prompts-per-language",
            "3",
            "--test-prompts-per-language",
            "3",
            "--sampled-tune-prompts-per-language",
            "1",
            "--sampled-test-prompts-per-language",
            "1",
            "--live-prompts-per-slice",
            "2",
            "--bootstrap",
            "100",
            "--no-progress",
        ]
    )
    assert rc == 0, stderr
    assert "report:" in stdout
    for name in ("shift.md", "shift.json", "shift.png"):
        assert (out / name).is_file()
    results = json.loads((out / "shift.json").read_text())
    assert set(results["axes"]) == {"task", "temperature", "length"}
    length = results["axes"]["length"]
    assert length["slices"] == ["short", "long"]
    assert length["test"]["long"]["prompts"] == ["it-long-test#seed0", "en-long-test#seed0"]
    assert length["test"]["long"]["mean_prompt_tokens"] > length["test"]["short"]["mean_prompt_tokens"]
    assert length["test"]["long"]["mean_decode_tokens"] > 16  # the long slice ran to its own token budget
    assert results["axes"]["temperature"]["slices"] == ["T0", "T0.8"]
    sampled = results["axes"]["temperature"]["test"]["T0.8"]
    assert sampled["per_trace"]["learned"] and sampled["tokens_per_s"]["oracle"] > 0
    live = results["live"]
    assert set(live) == {"task", "temperature", "length"}
    assert live["length"]["long"]["max_new_tokens"] == 24 and live["length"]["short"]["max_new_tokens"] == 16
    for slices in live.values():
        for entry in slices.values():
            n = len(entry["prompts"])
            # same seed, every controller: the exact sampler gives the autoregressive tokens, greedy or not
            assert entry["identical_to_autoregressive"] == f"{n}/{n}"
    assert "static@T0" in live["temperature"]["T0.8"]["tokens_per_s"]  # the (T0 -> T0.8) cell ran live
    assert "live T0.8: learned / static tuned at T0" in results["summary"]["live_temperature"]
    report = (out / "shift.md").read_text()
    assert "## Axis: temperature" in report and "## Live confirmation" in report


def test_with_context_lookup_every_row_replays_and_runs_with_it(workdir, tiny_policy):
    """--lookup: replay matrices and live runs on the lookup engine (autoregressive = lookup alone: other
    cycles than plain autoregressive decoding), still token-identical live."""
    out = workdir / "shift-lookup"
    common = ["shift", "--pair", "tiny", "--threads", "1", "--policy", str(tiny_policy)]
    common += ["--cache-dir", str(workdir / CACHE), "--axes", "task", "--max-new-tokens", "16"]
    common += ["--tune-prompts-per-language", "2", "--test-prompts-per-language", "2"]
    common += ["--live-prompts-per-slice", "1", "--bootstrap", "50", "--no-progress"]
    rc, _, stderr = run_cli([*common, "--out", str(out), "--lookup", "1-2:2"])
    assert rc == 0, stderr
    looked = json.loads((out / "shift.json").read_text())
    rc, _, stderr = run_cli([*common, "--out", str(workdir / "shift-plain"), "--no-live"])
    assert rc == 0, stderr
    plain = json.loads((workdir / "shift-plain" / "shift.json").read_text())
    assert looked["conditions"]["lookup"] == "1-2:2" and plain["conditions"]["lookup"] == "off"
    rows = [
        (run["axes"]["task"]["test"][b]["tokens_per_s"]["autoregressive"] for run in (looked, plain))
        for b in looked["axes"]["task"]["slices"]
    ]
    assert all(a != pytest.approx(b) for a, b in rows)  # lookup cycles replayed: other cycles, other times
    for entry in looked["live"]["task"].values():
        n = len(entry["prompts"])
        assert entry["identical_to_autoregressive"] == f"{n}/{n}"
    assert "Context lookup on every controller's engine: 1-2:2" in (out / "shift.md").read_text()
