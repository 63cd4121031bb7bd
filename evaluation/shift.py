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
from dataclasses import asdict

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.control import StaticController
from engine.costs.cost_profile import CostProfile
from engine.costs.measure_costs import device_name
from engine.costs.speedup_model import SIZE_LADDER
from engine.engine import SpeculativeEngine
from engine.errors import InputError
from engine.inputs import EngineConfig
from engine.lookup import LookupConfig, describe_lookup, parse_lookup, resolve_lookup
from engine.sampling import SamplingConfig
from envs import workspace
from envs.oracle import oracle_plan, static_grid
from envs.prompts import LONG_SUITE, interleave_languages, suite_split
from envs.replay import ReplayTrace, replay_generate
from evaluation.config import find_policy
from evaluation.measurements import run_engine
from evaluation.shift_config import ShiftConfig, in_slice, slice_names, temperature_name
from evaluation.shift_report import summarize, summarize_live
from evaluation.stats import paired_bootstrap_ratio
from policies.analytic import AnalyticController
from policies.heuristic import ConfidenceController
from policies.learned import load_policy


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
