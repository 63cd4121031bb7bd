"""Replay baselines and speed on recorded traces: exact static grid, analytic, confidence, autoregressive,
the hindsight oracle, and environment steps per second.

    python benchmarks/replay_baselines.py --traces traces/cpu-w4 --profile runs/profile_cpu.json
    python benchmarks/replay_baselines.py --traces DIR --profile P --heuristics --policy runs/x/policy.pt

``--heuristics`` sweeps causal rules a practitioner would write (how much of the oracle's gain a
controller without hindsight can reach): the confidence threshold (llama.cpp's p-min), and a gated
version that also switches speculation off (depth 0) after a cycle that accepted fewer than A tokens and
probes again after P autoregressive steps. ``--policy`` adds a learned policy to the table.
"""

from __future__ import annotations

import argparse
import sys
import time

import gymnasium as gym
import numpy as np

import envs  # noqa: E402,F401 - registers the environment ids
from engine.control import Controller, StaticController
from engine.costs.cost_profile import CostProfile
from envs.backends import ReplayBackend
from envs.oracle import oracle_throughput, static_grid
from envs.recording import load_traces
from envs.replay import ReplayTrace, replay_generate, throughput
from policies.analytic import AnalyticController
from policies.heuristic import ConfidenceController
from policies.learned import load_policy


class GatedConfidence(Controller):
    """Draft while the draft's confidence in its latest token is >= ``threshold``; before a cycle, draft
    only if the last speculative cycle accepted >= ``accept_min`` tokens or ``probe_every`` autoregressive
    steps have passed since it (depth 0 otherwise). Chains only; verifies everything drafted."""

    decides_depth_zero = True
    tree_width = 1

    def __init__(self, threshold: float, accept_min: int, probe_every: int, max_depth: int):
        self.threshold, self.accept_min, self.probe_every, self.max_depth = (
            threshold,
            accept_min,
            probe_every,
            max_depth,
        )
        self.reset()

    def reset(self) -> None:
        self.since, self.last = 0, None

    def should_continue(self, state) -> bool:
        if state.depth == 0:
            return (self.last is not None and self.last >= self.accept_min) or self.since >= self.probe_every
        return state.depth < self.max_depth and float(state.step_probs.max()) >= self.threshold

    def num_to_verify(self, state) -> int:
        return len(state.node_scores)

    def observe(self, record) -> None:
        if record.num_drafted > 0:
            self.last, self.since = record.accepted, 0
        else:
            self.since += 1


def heuristic_sweep(traces, profile, depth: int, ar: float) -> list[tuple[float, str]]:
    """(throughput / autoregressive, name) of every rule of the sweep, best first."""
    out = []
    for th in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95):
        tps = throughput([replay_generate(rt, ConfidenceController(th, depth, 1), profile) for rt in traces])
        out.append((tps / ar, f"confidence({th})"))
        for a in (1, 2, 3, 4):
            for probe in (1, 2, 4, 8, 16, 32):
                ctrl = GatedConfidence(th, a, probe, depth)
                tps = throughput([replay_generate(rt, ctrl, profile) for rt in traces])
                out.append((tps / ar, f"gated(p>={th}, accepted>={a}, probe after {probe})"))
    return sorted(out, reverse=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--steps", type=int, default=20000, help="environment steps for the speed measurement")
    ap.add_argument(
        "--heuristics", action="store_true", help="sweep causal rules (chains) against the oracle"
    )
    ap.add_argument("--policy", help="a policy.pt to add to the table")
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
    if args.policy:
        learned = load_policy(args.policy)
        rows["learned"] = throughput([replay_generate(rt, learned, profile) for rt in traces])
    for name, tps in rows.items():
        print(f"  {name:28s} {tps:9.3f} tokens/s  ({tps / rows['autoregressive']:.2f}x AR)")
    print(f"static grid: {len(grid)} configurations in {grid_s:.2f} s; oracle DP in {oracle_s:.2f} s")
    if args.heuristics:
        if width != 1:
            print("--heuristics: chain traces only (width 1); skipped", file=sys.stderr)
        else:
            ranked = heuristic_sweep(traces, profile, depth, rows["autoregressive"])
            print(
                f"causal rules, best 8 of {len(ranked)} (x AR; the oracle is {oracle / rows['autoregressive']:.3f}x):"
            )
            for ratio, name in ranked[:8]:
                print(f"  {name:48s} {ratio:.4f}x AR")

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
