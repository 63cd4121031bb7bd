"""Replay baselines and speed on recorded traces: exact static grid, analytic, confidence, autoregressive,
the hindsight oracle, and environment steps per second.

    python benchmarks/replay_baselines.py --traces traces/cpu-w4 --profile runs/profile_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import envs  # noqa: E402,F401 - registers the environment ids
from engine.cost_profile import CostProfile  # noqa: E402
from envs import ReplayBackend, ReplayTrace, replay_generate, throughput  # noqa: E402
from envs.oracle import oracle_throughput, static_grid  # noqa: E402
from envs.record_traces import load_traces  # noqa: E402
from policies import AnalyticController, ConfidenceController, StaticController  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--steps", type=int, default=20000, help="environment steps for the speed measurement")
    args = ap.parse_args()
    profile = CostProfile.load(args.profile)
    traces = [ReplayTrace(t) for t in load_traces(args.traces)]
    width, depth = traces[0].width, traces[0].max_depth
    print(
        f"{len(traces)} traces, {sum(rt.trace.num_positions for rt in traces)} positions, width {width}, "
        f"max depth {depth}, profile {profile.meta.get('device')} {profile.meta.get('dtype')}"
    )

    t0 = time.perf_counter()
    grid = static_grid(traces, profile)
    grid_s = time.perf_counter() - t0
    best = max(grid, key=grid.get)
    t0 = time.perf_counter()
    oracle = oracle_throughput(traces, profile)
    oracle_s = time.perf_counter() - t0
    rows = {
        "autoregressive": throughput([replay_generate(rt, None, profile) for rt in traces]),
        f"best static {best}": grid[best],
        "analytic": throughput(
            [replay_generate(rt, AnalyticController(profile, width, depth), profile) for rt in traces]
        ),
        "confidence(0.4)": throughput(
            [replay_generate(rt, ConfidenceController(0.4, depth, width), profile) for rt in traces]
        ),
        "oracle": oracle,
    }
    for name, tps in rows.items():
        print(f"  {name:28s} {tps:9.3f} tokens/s  ({tps / rows['autoregressive']:.2f}x AR)")
    print(f"static grid: {len(grid)} configurations in {grid_s:.2f} s; oracle DP in {oracle_s:.2f} s")

    backend = ReplayBackend(traces, profile)
    other = StaticController(best[0], best[1], tree_width=width)
    for env_id, kw, n_actions in (
        ("draftpilot/ReplayDepth-v0", "size_controller", 2),
        ("draftpilot/ReplaySize-v0", "depth_controller", 12),
    ):
        env = gym.make(env_id, backend=backend, **{kw: other}).unwrapped
        env.reset(seed=0)
        rng, t0 = np.random.default_rng(0), time.perf_counter()
        for _ in range(args.steps):
            if env.step(int(rng.integers(n_actions)))[2]:
                env.reset()
        print(f"{env_id}: {args.steps / (time.perf_counter() - t0):,.0f} steps/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
