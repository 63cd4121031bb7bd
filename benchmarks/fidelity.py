"""Replay fidelity: the same controllers run live (real engine, real models, wall clock) and in replay
(recorded traces, cost profile) on the same prompts. Greedy: the accepted lengths must agree exactly;
tokens/s within 10% is the target.

    python benchmarks/fidelity.py --profile runs/profile_cpu.json                 # default pair
    python benchmarks/fidelity.py --pair tiny --quick --profile runs/profile_tiny.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine.backends.models import load_pair
from engine.control import StaticController
from engine.costs.cost_profile import CostProfile
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig
from engine.sampling import SamplingConfig
from envs.record_traces import record_trace
from envs.replay import ReplayTrace, replay_generate
from policies.analytic import AnalyticController
from policies.heuristic import ConfidenceController, HeuristicController

PROMPTS = {
    "en": "Write a Python function that merges two sorted lists into one sorted list.",
    "it": "Spiega in poche frasi che cos'è la ricorsione, con un esempio in Python.",
    "zh": "用 Python 写一个函数，判断一个字符串是否是回文。",
    "es": "Explica qué es una lista enlazada y escribe una clase mínima en Python.",
}


def controllers(profile, width: int, max_depth: int) -> dict:
    out = {
        f"static(4,{4 if width == 1 else 8})": StaticController(4, 4 if width == 1 else 8, tree_width=width),
        "confidence(0.4)": ConfidenceController(0.4, max_depth=max_depth, tree_width=width),
        "analytic": AnalyticController(profile, tree_width=width, max_depth=max_depth),
    }
    if width == 1:
        out["heuristic(+2/-1)"] = HeuristicController(5, max_depth=max_depth)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument(
        "--profile", required=True, help="cost profile JSON (python -m engine.costs.measure_costs)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--tree-width", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2, help="live repetitions per controller and prompt")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 24 tokens, 1 rep")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); use the "
        "profile's thread count, or live and replay time different machines",
    )
    ap.add_argument("--out", default="runs/fidelity.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = dict(list(PROMPTS.items())[:2]) if args.quick else PROMPTS
    if args.quick:
        args.max_new_tokens, args.reps = 24, 1

    pair = load_pair(args.pair)
    profile = CostProfile.load(args.profile)
    sampling = SamplingConfig(temperature=0.0)
    engine = SpeculativeEngine(pair, sampling, EngineConfig(max_depth=args.max_depth))
    ids = {lang: pair.encode(p) for lang, p in prompts.items()}

    t0 = time.perf_counter()
    traces = {
        lang: ReplayTrace(
            record_trace(
                pair, ids[lang], lang, sampling, args.max_depth, args.tree_width, args.max_new_tokens, seed=0
            ),
            engine_max_depth=args.max_depth,
        )
        for lang in tqdm(prompts, desc="record")
    }
    record_s = time.perf_counter() - t0
    engine.generate(
        ids[next(iter(ids))], 8, controller=StaticController(2, 2, tree_width=args.tree_width)
    )  # warm-up

    rows = {}
    for name, ctrl in tqdm(controllers(profile, args.tree_width, args.max_depth).items(), desc="controllers"):
        live_acc, replay_acc, live_tps, replay_tps, exact, cycles = [], [], [], [], 0, 0
        for lang in prompts:
            rt = traces[lang]
            replay = replay_generate(rt, ctrl, profile, measure_controller=True)
            for _ in range(args.reps):
                live = engine.generate(ids[lang], args.max_new_tokens, controller=ctrl)
                if live.tokens != rt.trace.tokens.tolist():
                    raise AssertionError(f"{lang}: live greedy output differs from the recorded trajectory")
                live_cycles = [(c.depth, c.num_verified, c.accepted, c.emitted) for c in live.cycles]
                replay_cycles = [(c.depth, c.num_verified, c.accepted, c.emitted) for c in replay]
                exact += live_cycles == replay_cycles
                cycles += 1
                live_acc.append(live.stats["mean_accepted"])
                live_tps.append(sum(c.emitted for c in live.cycles) / sum(c.total_s for c in live.cycles))
            spec = [c for c in replay if c.depth > 0]
            replay_acc.append(sum(c.accepted for c in spec) / max(len(spec), 1))
            replay_tps.append(sum(c.emitted for c in replay) / sum(c.total_s for c in replay))
        rows[name] = {
            "live_mean_accepted": statistics.mean(live_acc),
            "replay_mean_accepted": statistics.mean(replay_acc),
            "cycle_sequences_identical": f"{exact}/{cycles}",
            "live_tokens_per_s": statistics.median(live_tps),
            "replay_tokens_per_s": statistics.median(replay_tps),
        }
        rows[name]["replay_over_live"] = rows[name]["replay_tokens_per_s"] / rows[name]["live_tokens_per_s"]

    print(
        f"\npair={pair.name} dtype={str(pair.dtype).removeprefix('torch.')} device={pair.device} greedy "
        f"max_new_tokens={args.max_new_tokens} max_depth={args.max_depth} tree_width={args.tree_width} "
        f"prompts={list(prompts)} reps={args.reps} threads={torch.get_num_threads()} profile={args.profile}"
    )
    positions = sum(rt.trace.num_positions for rt in traces.values())
    print(
        f"recorded {positions} positions in {record_s:.1f} s ({positions / record_s * 60:.0f} positions/min)"
    )
    print(
        f"{'controller':18s}{'acc live':>10s}{'acc replay':>11s}{'identical':>11s}{'tok/s live':>12s}"
        f"{'tok/s replay':>13s}{'ratio':>7s}"
    )
    for name, r in rows.items():
        print(
            f"{name:18s}{r['live_mean_accepted']:10.3f}{r['replay_mean_accepted']:11.3f}"
            f"{r['cycle_sequences_identical']:>11s}{r['live_tokens_per_s']:12.2f}{r['replay_tokens_per_s']:13.2f}"
            f"{r['replay_over_live']:7.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "record_s": record_s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
