"""Policy-call overhead of a learned controller inside the engine: time per controller call and its share
of cycle time, next to a static controller (the engine's own state building) on the same prompts.

    python benchmarks/policy_overhead.py --policy runs/main/policy.pt                 # default pair
    python benchmarks/policy_overhead.py --policy runs/x/policy.pt --pair tiny --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from engine.control import Controller, StaticController
from engine.costs.observation import DEPTH_OBS_DIM, SIZE_OBS_DIM
from engine.engine import SpeculativeEngine
from engine.sampling import SamplingConfig
from envs.prompts import suite_split
from envs.workspace import load_models
from policies.learned import load_policy


class Counting(Controller):
    """Delegates to ``inner`` and counts the decisions it is asked for."""

    def __init__(self, inner: Controller):
        self.inner, self.tree_width, self.calls = inner, inner.tree_width, 0

    def reset(self) -> None:
        self.inner.reset()

    def should_continue(self, state) -> bool:
        self.calls += 1
        return self.inner.should_continue(state)

    def num_to_verify(self, state) -> int:
        self.calls += 1
        return self.inner.num_to_verify(state)

    def observe(self, record) -> None:
        self.inner.observe(record)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prompts-per-language", type=int, default=1)
    ap.add_argument("--split", default="tune")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    learned = load_policy(args.policy)
    # the bare actors first: one call = features -> normalise -> MLP -> argmax
    rng = np.random.default_rng(0)
    for name, actor, dim in (
        ("depth", learned.depth_actor, DEPTH_OBS_DIM),
        ("size", learned.size_actor, SIZE_OBS_DIM),
    ):
        obs = rng.uniform(0, 1, (2000, dim)).astype(np.float32)
        t0 = time.perf_counter()
        for o in obs:
            actor.act(o)
        print(f"{name} actor alone: {1e6 * (time.perf_counter() - t0) / len(obs):.1f} us/call")

    pair = load_models(args.pair, threads=args.threads)
    engine = SpeculativeEngine(pair, SamplingConfig(temperature=0.0))
    prompts = suite_split(args.split, args.prompts_per_language)
    static = StaticController(4, 8, tree_width=learned.tree_width)
    rows = {"learned": [], "static": []}
    for item in prompts:
        ids = pair.encode(item["prompt"])
        for name, ctrl in (("learned", learned), ("static", static)):
            counting = Counting(ctrl)
            res = engine.generate(ids, max_new_tokens=args.max_new_tokens, controller=counting)
            cycles = [c for c in res.cycles if c.depth > 0]
            calls = counting.calls
            ctrl_s = sum(c.controller_s for c in cycles)
            total_s = sum(c.total_s for c in cycles)
            rows[name].append((ctrl_s / max(calls, 1), ctrl_s / total_s, total_s / max(len(cycles), 1)))
    print(
        f"\npair={pair.name} weights={pair.precision} threads={torch.get_num_threads()} "
        f"prompts={len(prompts)} ({args.split}) max_new_tokens={args.max_new_tokens}"
    )
    for name, values in rows.items():
        per_call = statistics.median(v[0] for v in values)
        share = statistics.median(v[1] for v in values)
        cycle = statistics.median(v[2] for v in values)
        print(
            f"{name:8s} controller time per call {1e6 * per_call:8.1f} us   share of cycle time {share:.4%}   "
            f"median cycle {1e3 * cycle:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
