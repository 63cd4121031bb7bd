"""Shift evaluation (``python evaluate.py shift``): how the drafting controllers hold when the traffic they
meet differs from the traffic a static setting was tuned on.

Static settings are tuned once, on whatever traffic is at hand, then left alone. For every axis of the
suite (language: it, en, zh, es; task family: code, math, prose = explanation, rewrite and qa; sampling
temperature; length: the suite's short answers vs the long suite's ~2k-token contexts and 512-token answers)
and every pair of slices (A, B), the static (depth, size) grid-searched on A's tune prompts is
measured on B's test prompts, next to the controllers that adapt on their own: the learned policy (one
policy file, trained once on the mixed train split), the analytic and the confidence controllers, the
static setting tuned on B itself (the diagonal), the best static setting on B's test prompts in
hindsight, autoregressive decoding and the hindsight oracle.

The full matrices are exact replay (``envs.replay``: recorded traces, any controller's cycles exactly,
times from the cost profile); the diagonal, the worst off-diagonal cell of every axis and every
(temperature 0 -> T) cell are confirmed live on the engine (``--live``), controllers interleaved prompt by
prompt. Ratios carry paired bootstrap intervals over prompts (``evaluation.stats``).

Writes OUT/shift.md, OUT/shift.json and OUT/shift.png (one heat map per axis: learned over the static
setting tuned on the row's slice, measured on the column's slice).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.backends.files import atomic_path, atomic_write_json
from engine.cli import ModelConfig, check_output_dir
from engine.costs.cost_profile import CostProfile
from engine.costs.measure_costs import device_name
from engine.engine import EngineConfig, SpeculativeEngine
from engine.errors import InputError
from engine.lookup import LookupConfig, describe_lookup, parse_lookup, resolve_lookup
from engine.sampling import SamplingConfig
from envs import workspace
from envs.oracle import oracle_plan, static_grid
from envs.prompts import LANGUAGES, LONG_SUITE, interleave_languages, suite_split
from envs.replay import SIZE_LADDER, ReplayTrace, replay_generate
from evaluation.config import find_policy
from evaluation.measurements import run_engine
from evaluation.stats import paired_bootstrap_ratio
from policies import AnalyticController, ConfidenceController, StaticController, load_policy

TASK_FAMILIES = {"code": ("code",), "math": ("math",), "prose": ("explanation", "rewrite", "qa")}
"""Task family of each suite task (code vs prose, with math apart: formulas are neither)."""
AXES = ("language", "task", "temperature", "length")
LENGTH_SLICES = ("short", "long")
"""Slices of the length axis: the suite (``--max-new-tokens``, short requests) and the long suite
(``prompts/long.jsonl``: ~1.3-2.2k-token contexts, ``--long-max-new-tokens`` answers)."""
LIVE_CONTROLLERS = ("autoregressive", "learned")


@dataclass
class ShiftConfig(ModelConfig):
    """One shift evaluation; the model fields come from ``engine.cli.ModelConfig``."""

    policy: str | None = None
    """Exported learned policy (policy.pt; trained across temperatures for the temperature axis); none: the
    newest runs/*/policy.pt."""
    out: str | None = None
    """Output directory (shift.md, shift.json, shift.png); none: runs/shift-<timestamp>."""
    axes: str = "language,task,temperature,length"
    """Comma list of the axes to evaluate (language, task, temperature, length)."""
    temperatures: str = "0,0.7,1"
    """Slices of the temperature axis (the language and task axes are greedy)."""
    max_new_tokens: int = 128
    """Tokens per trace and live run."""
    tune_prompts_per_language: int | None = None
    """Greedy tune prompts per language (none: the whole tune split, 8 per language in the built-in suite)."""
    test_prompts_per_language: int | None = None
    """Greedy test prompts per language (none: the whole test split, 12 per language)."""
    sampled_tune_prompts_per_language: int = 4
    """Tune prompts per language of every temperature slice (the first of the tune split)."""
    sampled_test_prompts_per_language: int = 6
    """Test prompts per language of every temperature slice."""
    long_suite: str | None = None
    """JSONL suite of the length axis's long slice (none: the built-in prompts/long.jsonl, 2 tune and 3
    test prompts per language with ~1.3-2.2k-token contexts)."""
    long_max_new_tokens: int = 512
    """Tokens per trace and live run of the long slice."""
    long_tune_prompts_per_language: int | None = None
    """Long-suite tune prompts per language (none: all)."""
    long_test_prompts_per_language: int | None = None
    """Long-suite test prompts per language (none: all)."""
    live: bool = True
    """Confirm live: every diagonal cell, the worst off-diagonal cell of each axis, every (0 -> T) cell."""
    live_prompts_per_slice: int = 4
    """Test prompts of a slice run live (spread over its languages)."""
    profile: str | None = None
    """Cost profile JSON; none: the cached one for this pair/device/format (measured on first use)."""
    bootstrap: int = 2000
    """Bootstrap resamples (over prompts) of every interval."""
    seed: int = 0
    """Seed of the sampled traces (sample 0) and of the live runs and the bootstrap."""
    lookup: str = "auto"
    """Context lookup drafting on the engine of every controller, in replay and live ("off", "on", MIN-MAX:K,
    MIN-MAX:K+L:J; engine.lookup; "auto": the setting the policy was trained with, train.py --lookup): "autoregressive" is then
    lookup alone, every static is tuned with it and the oracle plans around its cycles."""
    cache_dir: str = "runs/cache"
    """Where profiles and traces are cached (shared with train.py and evaluate.py)."""
    progress: bool = True
    """Progress bars."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (
            "max_new_tokens",
            "sampled_tune_prompts_per_language",
            "sampled_test_prompts_per_language",
            "long_max_new_tokens",
            "live_prompts_per_slice",
            "bootstrap",
        ):
            if getattr(self, name) < 1:
                raise InputError(
                    f"{name} (--{name.replace('_', '-')}) must be >= 1, got {getattr(self, name)}"
                )
        for name in (
            "tune_prompts_per_language",
            "test_prompts_per_language",
            "long_tune_prompts_per_language",
            "long_test_prompts_per_language",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {value}")
        self.axis_list()
        self.temperature_list()
        resolve_lookup(self.lookup)  # a bad setting fails before any model loads

    def axis_list(self) -> list[str]:
        axes = [a.strip() for a in self.axes.split(",") if a.strip()]
        bad = [a for a in axes if a not in AXES]
        if bad or not axes:
            raise InputError(f"--axes: expected a comma list of {', '.join(AXES)}, got {self.axes!r}")
        return axes

    def temperature_list(self) -> list[float]:
        try:
            temps = [float(t) for t in self.temperatures.split(",") if t.strip()]
        except ValueError:
            temps = []
        if not temps or not all(np.isfinite(t) and t >= 0 for t in temps) or len(set(temps)) != len(temps):
            raise InputError(
                f"--temperatures: expected distinct finite numbers >= 0, comma separated, got {self.temperatures!r}"
            )
        return temps


# ------------------------------------------------------------------------------------------- slices
def task_family(item: dict) -> str:
    task = item.get("task", "")
    for family, tasks in TASK_FAMILIES.items():
        if task in tasks:
            return family
    return "other"


def slice_names(axis: str, prompts: Sequence[dict], temperatures: Sequence[float]) -> list[str]:
    if axis == "language":
        present = {p.get("language") for p in prompts}
        return [lang for lang in LANGUAGES if lang in present] + sorted(
            {lang for lang in present if lang not in LANGUAGES and lang}
        )
    if axis == "task":
        present = {task_family(p) for p in prompts}
        return [f for f in (*TASK_FAMILIES, "other") if f in present]
    if axis == "length":
        return list(LENGTH_SLICES)
    return [temperature_name(t) for t in temperatures]


def temperature_name(t: float) -> str:
    return f"T{t:g}"


def in_slice(axis: str, name: str, item: dict) -> bool:
    if axis == "language":
        return item.get("language") == name
    if axis == "task":
        return task_family(item) == name
    return True


# ------------------------------------------------------------------------------------------- replay
def per_trace(
    traces: Sequence[ReplayTrace], controller, profile: CostProfile, lookup: LookupConfig | None = None
) -> list[tuple[int, float]]:
    """(decode tokens, decode seconds) of every trace under ``controller`` (None: autoregressive), with the
    engine's context ``lookup``."""
    out = []
    for rt in traces:
        recs = replay_generate(rt, controller, profile, lookup=lookup)
        out.append((sum(r.emitted for r in recs), float(sum(r.total_s for r in recs))))
    return out


def rate(rows: Sequence[tuple[int, float]]) -> float:
    seconds = sum(s for _, s in rows)
    return sum(n for n, _ in rows) / seconds if seconds > 0 else float("nan")


def ratio(a: Sequence[tuple[int, float]], b: Sequence[tuple[int, float]], resamples: int, seed: int) -> dict:
    return paired_bootstrap_ratio(
        [n for n, _ in a],
        [s for _, s in a],
        [n for n, _ in b],
        [s for _, s in b],
        resamples=resamples,
        rng=seed,
    )


def best_static(
    traces: Sequence[ReplayTrace], profile: CostProfile, max_depth: int, lookup: LookupConfig | None = None
) -> tuple[tuple[int, int], float]:
    """The static (depth, size) of the best replay throughput on ``traces`` (ties: shallower, smaller). Depth
    0 (no speculation: autoregressive steps) is a candidate: a user tuning a static setting would keep it
    where nothing else pays."""
    sizes = [s for s in SIZE_LADDER if s <= max(1, traces[0].width) * max_depth] or [1]
    grid = static_grid(traces, profile, depths=range(1, max_depth + 1), sizes=sizes, lookup=lookup)
    grid[(0, 0)] = float(static_grid(traces, profile, depths=[0], sizes=[0], lookup=lookup)[(0, 0)])
    best = max(grid, key=lambda k: (grid[k], -k[0], -k[1]))
    return best, float(grid[best])


def evaluate_axis(
    axis: str,
    tune: dict[str, list[ReplayTrace]],
    test: dict[str, list[ReplayTrace]],
    controllers: dict[str, Callable[[], object]],
    profile: CostProfile,
    max_depth: int,
    width: int,
    resamples: int,
    seed: int,
    lookup: LookupConfig | None = None,
) -> dict:
    """The replay matrix of one axis (every controller with the engine's context ``lookup``): per tune slice its best static, per test slice every controller's
    per-trace numbers, per (A, B) cell the learned / static-tuned-on-A ratio with its interval."""
    names = list(tune)
    tuned = {}
    for a in names:
        (depth, size), tps = best_static(tune[a], profile, max_depth, lookup)
        tuned[a] = {
            "depth": depth,
            "verify": size,
            "tune_replay_tokens_per_s": tps,
            "tune_prompts": [rt.trace.prompt_id for rt in tune[a]],
        }
    tests, rows_of = {}, {}
    for b in names:
        traces = test[b]
        rows: dict[str, list[tuple[int, float]]] = {
            "autoregressive": per_trace(traces, None, profile, lookup)
        }
        for cname, make in controllers.items():
            rows[cname] = per_trace(traces, make(), profile, lookup)
        for a in names:
            rows[f"static@{a}"] = per_trace(
                traces,
                StaticController(tuned[a]["depth"], tuned[a]["verify"], tree_width=width),
                profile,
                lookup,
            )
        (hd, hv), _ = best_static(traces, profile, max_depth, lookup)
        rows["static_hindsight"] = per_trace(
            traces, StaticController(hd, hv, tree_width=width), profile, lookup
        )
        plans = [oracle_plan(rt, profile, lookup=lookup) for rt in traces]
        rows["oracle"] = [(p.tokens, p.total_s) for p in plans]
        rows_of[b] = rows
        tests[b] = {
            "prompts": [f"{rt.trace.prompt_id}#seed{rt.trace.meta.get('seed', 0)}" for rt in traces],
            "mean_prompt_tokens": float(np.mean([rt.trace.prompt_len for rt in traces])),
            "mean_decode_tokens": float(np.mean([n for n, _ in rows["autoregressive"]])),
            "hindsight_static": [hd, hv],
            "per_trace": {k: [[int(n), float(s)] for n, s in v] for k, v in rows.items()},
            "tokens_per_s": {k: rate(v) for k, v in rows.items()},
            "learned_over": {
                k: ratio(rows["learned"], rows[k], resamples, seed)
                for k in ("autoregressive", "static_hindsight", "oracle", "analytic", "confidence")
                if k in rows and "learned" in rows
            },
        }
    cells = {
        a: {
            b: {
                "static": [tuned[a]["depth"], tuned[a]["verify"]],
                "static_tokens_per_s": tests[b]["tokens_per_s"][f"static@{a}"],
                "learned_over_static": ratio(
                    rows_of[b]["learned"], rows_of[b][f"static@{a}"], resamples, seed
                ),
                "static_over_in_slice": tests[b]["tokens_per_s"][f"static@{a}"]
                / tests[b]["tokens_per_s"][f"static@{b}"],
            }
            for b in names
        }
        for a in names
    }
    return {"slices": names, "tuned": tuned, "test": tests, "cells": cells}


# ------------------------------------------------------------------------------------------- live
def live_cells(axis: str, result: dict) -> list[tuple[str, str]]:
    """(A, B) cells confirmed live: the diagonal, the off-diagonal cell where the learned policy gains most
    over the transplanted static setting, and on the temperature axis every (first slice -> B) cell."""
    names, cells = result["slices"], result["cells"]
    out = [(b, b) for b in names]
    off = [(a, b) for a in names for b in names if a != b]
    if off:
        worst = max(off, key=lambda ab: cells[ab[0]][ab[1]]["learned_over_static"]["ratio"])
        out.append(worst)
    if axis == "temperature":
        out += [(names[0], b) for b in names[1:]]
    return list(dict.fromkeys(out))


def live_slice(
    engine: SpeculativeEngine,
    items: Sequence[tuple[str, list[int]]],
    controllers: dict[str, Callable[[], object]],
    max_new_tokens: int,
    seed: int,
    bar=None,
) -> dict[str, list[tuple[int, float]]]:
    """Every controller on every prompt, interleaved (controller order rotated prompt by prompt); per
    controller the (decode tokens, decode seconds) of each prompt, in prompt order."""
    names = list(controllers)
    rows: dict[str, list[tuple[int, float]]] = {n: [] for n in names}
    tokens: dict[str, list[list[int]]] = {n: [] for n in names}
    for index, (_, ids) in enumerate(items):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            run = run_engine(engine, ids, controllers[name](), max_new_tokens, seed)
            rows[name].append((len(run["tokens"]) - 1, run["decode_s"]))
            tokens[name].append(run["tokens"])
            if bar is not None:
                bar.update()
    return {"rows": rows, "tokens": tokens}


def pick_live_prompts(prompts: Sequence[dict], count: int) -> list[dict]:
    """``count`` prompts spread over the languages (round robin) and over the items: the suite's languages
    are translations of one another, so an item already taken in one language is skipped in the next
    while another item is left (``it-code-05`` then ``en-code-06`` rather than ``en-code-05``)."""
    pool = interleave_languages(list(prompts))
    chosen: list[dict] = []
    used: set[str] = set()
    languages = list(dict.fromkeys(p.get("language") for p in pool))
    while pool and len(chosen) < count:
        for lang in languages:
            mine = [p for p in pool if p.get("language") == lang]
            if len(chosen) == count or not mine:
                continue
            pick = next((p for p in mine if _item(p) not in used), mine[0])
            chosen.append(pick)
            used.add(_item(pick))
            pool.remove(pick)
    return chosen


def _item(prompt: dict) -> str:
    """The id without its language prefix: the same item in every language."""
    pid, lang = str(prompt.get("id", "")), str(prompt.get("language", ""))
    return pid[len(lang) + 1 :] if lang and pid.startswith(lang + "-") else pid


# ------------------------------------------------------------------------------------------- driver
def conditions(config: ShiftConfig, profile: CostProfile) -> dict:
    cpu = device_name(torch.device("cpu"))
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "profile": {k: profile.meta.get(k) for k in ("device_name", "dtype", "num_threads", "created")},
        "lookup": describe_lookup(parse_lookup(config.lookup)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run_shift(config: ShiftConfig) -> dict:
    axes, temps = config.axis_list(), config.temperature_list()
    policy_path = find_policy(config)  # type: ignore[arg-type]  # reads .policy only
    learned = load_policy(policy_path)
    # resolved here, so the stored config says what ran
    config.lookup = describe_lookup(resolve_lookup(config.lookup, learned.trained_lookup))
    width, max_depth = learned.tree_width, learned.max_depth
    pair = config.load()
    profile = workspace.ensure_profile(pair, config.cache_dir, config.profile, widths=(1, 2, max(width, 1)))

    def traces_of(
        prompts: list[dict], temperature: float, tag: str, max_new_tokens: int | None = None
    ) -> list[ReplayTrace]:
        return workspace.ensure_traces(
            pair,
            prompts,
            config.cache_dir,
            temperature=temperature,
            tree_width=width,
            max_depth=max_depth,
            max_new_tokens=max_new_tokens or config.max_new_tokens,
            seed=config.seed,
            progress=config.progress,
            tag=tag,
        )

    controllers = {
        "learned": lambda: learned,
        "analytic": lambda: AnalyticController(profile, width, max_depth),
        "confidence": lambda: ConfidenceController(0.4, max_depth=max_depth, tree_width=width),
    }
    pools: dict[str, dict[str, tuple[list[dict], int]]] = {}  # axis -> slice -> (test prompts, new tokens)
    greedy: dict[str, list[ReplayTrace]] = {}
    greedy_tune = suite_split("tune", config.tune_prompts_per_language)
    greedy_test = suite_split("test", config.test_prompts_per_language)
    results: dict = {"config": asdict(config), "policy": str(policy_path), "axes": {}}
    for axis in axes:
        tune: dict[str, list[ReplayTrace]] = {}
        test: dict[str, list[ReplayTrace]] = {}
        if axis in ("language", "task", "length") and not greedy:
            # the greedy axes and the length axis's short slice share the same traces: load them once
            greedy["tune"] = traces_of(greedy_tune, 0.0, "tune traces (greedy)")
            greedy["test"] = traces_of(greedy_test, 0.0, "test traces (greedy)")
        if axis == "length":
            long_path = config.long_suite or LONG_SUITE
            long_tune = suite_split("tune", config.long_tune_prompts_per_language, long_path)
            long_test = suite_split("test", config.long_test_prompts_per_language, long_path)
            n_long = config.long_max_new_tokens
            tune["short"], test["short"] = greedy["tune"], greedy["test"]
            tune["long"] = traces_of(long_tune, 0.0, "tune traces (long)", n_long)
            test["long"] = traces_of(long_test, 0.0, "test traces (long)", n_long)
            pools[axis] = {"short": (greedy_test, config.max_new_tokens), "long": (long_test, n_long)}
        elif axis in ("language", "task"):
            tune_all, test_all = greedy["tune"], greedy["test"]
            names = [
                n for n in slice_names(axis, greedy_test, temps) if n in slice_names(axis, greedy_tune, temps)
            ]
            for name in names:
                tune[name] = [rt for rt, p in zip(tune_all, greedy_tune) if in_slice(axis, name, p)]
                test[name] = [rt for rt, p in zip(test_all, greedy_test) if in_slice(axis, name, p)]
            pools[axis] = {
                name: ([p for p in greedy_test if in_slice(axis, name, p)], config.max_new_tokens)
                for name in test
            }
        else:
            tune_prompts = suite_split("tune", config.sampled_tune_prompts_per_language)
            test_prompts = suite_split("test", config.sampled_test_prompts_per_language)
            for t in temps:
                name = temperature_name(t)
                tune[name] = traces_of(tune_prompts, t, f"tune traces ({name})")
                test[name] = traces_of(test_prompts, t, f"test traces ({name})")
            pools[axis] = {temperature_name(t): (test_prompts, config.max_new_tokens) for t in temps}
        if not tune:
            raise InputError(f"axis {axis}: no slice has both tune and test prompts")
        print(f"shift: replay matrix of the {axis} axis ({', '.join(tune)}) ...", flush=True)
        results["axes"][axis] = evaluate_axis(
            axis,
            tune,
            test,
            controllers,
            profile,
            max_depth,
            width,
            config.bootstrap,
            config.seed,
            parse_lookup(config.lookup),
        )
    results["summary"] = summarize(results)
    if config.live:
        results["live"] = run_live(config, pair, results, pools, learned, width, temps)
        results["summary"].update(summarize_live(results["live"]))
    results["conditions"] = conditions(config, profile)
    return results


def run_live(config, pair, results, pools, learned, width, temps) -> dict:
    """Live confirmation of the chosen cells, slice by slice (one engine per temperature)."""
    plan: dict[tuple[str, str], set[str]] = {}
    for axis, res in results["axes"].items():
        for a, b in live_cells(axis, res):
            plan.setdefault((axis, b), set()).add(a)
    engines: dict[float, SpeculativeEngine] = {}
    out: dict = {}
    total = 0
    jobs = []
    for (axis, b), sources in plan.items():
        res = results["axes"][axis]
        prompts, tokens = pools[axis][b]  # the slice's test prompts and its new-token budget
        items = pick_live_prompts(prompts, config.live_prompts_per_slice)
        encoded = [(p["id"], pair.encode(p["prompt"])) for p in items]
        ctrls: dict[str, Callable[[], object]] = {"autoregressive": lambda: None, "learned": lambda: learned}
        for a in sorted(sources, key=res["slices"].index):
            d, v = res["tuned"][a]["depth"], res["tuned"][a]["verify"]
            ctrls[f"static@{a}"] = lambda d=d, v=v: StaticController(d, v, tree_width=width)
        temperature = temps[res["slices"].index(b)] if axis == "temperature" else 0.0
        jobs.append((axis, b, sources, encoded, ctrls, temperature, tokens))
        total += len(encoded) * len(ctrls)
    with tqdm(total=total, desc="shift live", disable=not config.progress) as bar:
        for axis, b, sources, encoded, ctrls, temperature, tokens in jobs:
            engine = engines.get(temperature)
            if engine is None:
                engine = engines[temperature] = SpeculativeEngine(
                    pair,
                    SamplingConfig(temperature=temperature),
                    EngineConfig(lookup=parse_lookup(config.lookup)),
                )
            measured = live_slice(engine, encoded, ctrls, tokens, config.seed, bar)
            rows = measured["rows"]
            identical = sum(
                all(measured["tokens"][n][i] == measured["tokens"]["autoregressive"][i] for n in ctrls)
                for i in range(len(encoded))
            )
            entry = {
                "prompts": [pid for pid, _ in encoded],
                "temperature": temperature,
                "max_new_tokens": tokens,
                "prompt_tokens": [len(ids) for _, ids in encoded],
                "tokens_per_s": {n: rate(r) for n, r in rows.items()},
                "identical_to_autoregressive": f"{identical}/{len(encoded)}",
                "learned_over": {
                    n: ratio(rows["learned"], rows[n], config.bootstrap, config.seed)
                    for n in rows
                    if n != "learned"
                },
                "per_prompt": {n: [[int(k), float(s)] for k, s in r] for n, r in rows.items()},
                "cells": sorted(sources, key=results["axes"][axis]["slices"].index),
            }
            out.setdefault(axis, {})[b] = entry
    return out


def summarize(results: dict) -> dict:
    """The issue's replay targets: learned over the static setting tuned on another slice (mean over the
    off-diagonal cells of every axis), over the in-slice static on every diagonal cell, over the oracle."""
    off, diag, oracle = [], {}, {}
    for axis, res in results["axes"].items():
        for a in res["slices"]:
            for b in res["slices"]:
                r = res["cells"][a][b]["learned_over_static"]["ratio"]
                if a == b:
                    diag[f"{axis}:{b}"] = r
                else:
                    off.append(r)
        for b in res["slices"]:
            lo = res["test"][b]["learned_over"].get("oracle")
            if lo:
                oracle[f"{axis}:{b}"] = lo["ratio"]
    return {
        "off_diagonal_mean": float(np.mean(off)) if off else float("nan"),
        "off_diagonal_cells": len(off),
        "diagonal": diag,
        "diagonal_min": min(diag.values()) if diag else float("nan"),
        "learned_over_oracle": oracle,
        "learned_over_oracle_min": min(oracle.values()) if oracle else float("nan"),
    }


def summarize_live(live: dict) -> dict:
    temp = live.get("temperature", {})
    names = list(temp)
    out = {}
    if names:
        first = names[0]
        for b in names[1:]:
            entry = temp[b]["learned_over"]
            out[f"live {b}: learned / static tuned at {first}"] = entry.get(f"static@{first}", {}).get(
                "ratio"
            )
            out[f"live {b}: learned / static tuned at {b}"] = entry.get(f"static@{b}", {}).get("ratio")
    return {"live_temperature": out}


# ------------------------------------------------------------------------------------------- report
def _fmt(ci: dict | None) -> str:
    if not ci:
        return "n/a"
    return f"{ci['ratio']:.3f} [{ci['low']:.2f}, {ci['high']:.2f}]"


def _mean_int(values) -> str:
    return f"{np.mean(values):.0f}" if values else "?"


def write_shift_report(results: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "shift.json", results, default=str)
    heatmap(results, out / "shift.png")
    s, cond = results["summary"], results.get("conditions", {})
    lines = [
        "# Shift evaluation",
        "",
        f"Policy `{results['policy']}`; {cond.get('cpu')}, {cond.get('threads')} threads, load "
        f"{cond.get('load_avg')}; profile {cond.get('profile')}; {cond.get('date')}.",
        f"Context lookup on every controller's engine: {cond.get('lookup', 'off')} (with lookup, "
        "autoregressive is lookup alone; the oracle plans around the lookup's cycles).",
        "Replay: exact cycles from recorded traces, times from the cost profile. Cells: learned / static "
        "tuned on the row's slice, measured on the column's slice (95% paired bootstrap over prompts).",
        "",
        "## Targets (replay)",
        "",
        f"- learned over the static setting tuned on another slice, mean over {s['off_diagonal_cells']} "
        f"off-diagonal cells: **{s['off_diagonal_mean']:.3f}x** (target >= 1.15x)",
        f"- learned over the in-slice static on the diagonal, lowest cell: **{s['diagonal_min']:.3f}x** "
        f"(target >= 1.0x on every cell): " + ", ".join(f"{k} {v:.3f}" for k, v in s["diagonal"].items()),
        f"- learned over the hindsight oracle, lowest slice: **{s['learned_over_oracle_min']:.3f}x** (target "
        ">= 0.95x): " + ", ".join(f"{k} {v:.3f}" for k, v in s["learned_over_oracle"].items()),
    ]
    for key, value in (s.get("live_temperature") or {}).items():
        lines.append(f"- {key}: {value:.3f}x" if value is not None else f"- {key}: n/a")
    for axis, res in results["axes"].items():
        names = res["slices"]
        lines += [
            "",
            f"## Axis: {axis}",
            "",
            "Static setting tuned on each slice's tune prompts (replay):",
            "",
        ]
        lines += [
            f"- {a}: (depth {res['tuned'][a]['depth']}, verify {res['tuned'][a]['verify']}) on "
            f"{len(res['tuned'][a]['tune_prompts'])} tune traces"
            for a in names
        ]
        lines += ["", "Learned / static tuned on row, measured on column:", ""]
        lines += ["| tuned on \\ measured on | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for a in names:
            lines.append(
                f"| {a} | "
                + " | ".join(_fmt(res["cells"][a][b]["learned_over_static"]) for b in names)
                + " |"
            )
        lines += ["", "Tokens/s (replay) on each measured slice:", ""]
        cols = (
            ["autoregressive", "learned", "analytic", "confidence"]
            + [f"static@{a}" for a in names]
            + [
                "static_hindsight",
                "oracle",
            ]
        )
        lines += [
            "| measured on | traces | prompt / new tokens | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 3) + "|",
        ]
        for b in names:
            t = res["test"][b]
            lines.append(
                f"| {b} | {len(t['prompts'])} | {t.get('mean_prompt_tokens', float('nan')):.0f} / "
                f"{t.get('mean_decode_tokens', float('nan')):.0f} | "
                + " | ".join(f"{t['tokens_per_s'].get(c, float('nan')):.2f}" for c in cols)
                + " |"
            )
        lines += ["", "Learned over, on each measured slice:", ""]
        keys = ["autoregressive", "analytic", "confidence", "static_hindsight", "oracle"]
        lines += ["| measured on | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for b in names:
            lo = res["test"][b]["learned_over"]
            lines.append(f"| {b} | " + " | ".join(_fmt(lo.get(k)) for k in keys) + " |")
    live = results.get("live")
    if live:
        lines += [
            "",
            "## Live confirmation",
            "",
            "Interleaved prompt by prompt, decode tokens/s; learned over "
            "each controller with 95% paired bootstrap intervals.",
            "",
        ]
        for axis, slices in live.items():
            for b, e in slices.items():
                lines.append(
                    f"- {axis} {b} (T {e['temperature']:g}, {len(e['prompts'])} prompts of "
                    f"{_mean_int(e.get('prompt_tokens'))} tokens, {e.get('max_new_tokens')} new, identical to "
                    f"autoregressive {e['identical_to_autoregressive']}): "
                    + ", ".join(f"{n} {v:.2f}" for n, v in e["tokens_per_s"].items())
                    + "; learned over "
                    + ", ".join(f"{n} {_fmt(ci)}" for n, ci in e["learned_over"].items())
                )
    path = out / "shift.md"
    with atomic_path(path) as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n")
    return path


def heatmap(results: dict, path: Path) -> Path:
    from evaluation.plots import _save, plt

    axes = list(results["axes"].items())
    fig, grid = plt.subplots(1, len(axes), figsize=(4.2 * len(axes), 3.8), squeeze=False)
    for ax, (axis, res) in zip(grid[0], axes):
        names = res["slices"]
        m = np.asarray([[res["cells"][a][b]["learned_over_static"]["ratio"] for b in names] for a in names])
        im = ax.imshow(m, cmap="RdYlGn", vmin=0.8, vmax=1.2)
        ax.set_xticks(range(len(names)), names)
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("measured on")
        ax.set_ylabel("static tuned on")
        ax.set_title(f"{axis}: learned / static")
        for i in range(len(names)):
            for j in range(len(names)):
                ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return _save(fig, path)


def check_out(config: ShiftConfig) -> Path:
    out = Path(config.out or f"runs/shift-{time.strftime('%Y%m%d-%H%M%S')}")
    return check_output_dir(out)
