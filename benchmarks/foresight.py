"""How much of the hindsight oracle's margin is foresight: replay controllers that are handed part of the
future, next to the learned policy and the oracle, on held-out traces (default: the test split).

    python benchmarks/foresight.py --policy runs/main-f5-more/policy.pt --prompts-per-language 12
    python benchmarks/foresight.py --policy runs/temps-f5/policy.pt --temperature 0.7 --prompts-per-language 4

The oracle (``envs.oracle``) plans every cycle knowing how many drafted tokens the target will accept. A
controller only sees the draft's probabilities and the history. Rows between the two:

* ``calibrated analytic``: the analytic cost-model controller whose acceptance estimate is replaced by a
  calibration fitted *on the measured traces themselves* (P(the k-th drafted token is accepted | the ones
  before it were) per depth and draft-confidence bin): how far a better reading of the draft's confidence
  and depth takes the cost model, measured optimistically (in sample). Its draft-at-all decision keeps the
  analytic controller's estimate from the request's recent cycles (nothing is drafted yet to calibrate).
* ``learned + first-token foresight``: the learned policy, except that before drafting it is told whether
  the draft's first token will be accepted (one bit of the future a cycle): it drafts exactly when that
  token is accepted, and the policy chooses the depth and size as it would.
* ``length foresight``: a controller told how many drafted tokens will be accepted (L): it drafts exactly
  L levels and verifies them, an autoregressive step when L = 0 (what the oracle knows, without its
  planning of the draft's pending inputs; no policy is consulted).

Every row runs with the context lookup the policy was trained with (``--lookup``), as the engine would.
The foresight rows are measurements of what information is worth, not controllers anyone could deploy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from engine.control import Controller, DraftState, StaticController
from engine.costs.cost_profile import load_profile_arg
from engine.errors import InputError
from engine.lookup import describe_lookup, resolve_lookup
from envs.oracle import oracle_throughput, static_grid
from envs.replay import ReplayTrace, replay_generate, throughput
from envs.workspace import replay_inputs, trace_summary
from policies.analytic import AnalyticController
from policies.learned import load_policy


# --------------------------------------------------------------------------------- in-sample calibration
def acceptance_samples(traces: list[ReplayTrace]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(depth k, the draft's conditional probability of its k-th token, was it accepted) for every drafted
    chain token whose predecessors were all accepted, over every position of every trace."""
    depths, probs, accepted = [], [], []
    for rt in traces:
        trace = rt.trace
        future = trace.tokens
        for t in range(len(future) - 1):
            tokens, _, node_depths, scores = trace.nodes(t)
            order = np.argsort(node_depths, kind="stable")
            previous = 0.0
            for k, i in enumerate(order, start=1):
                ok = t + k < len(future) and int(tokens[i]) == int(future[t + k])
                depths.append(k)
                probs.append(float(np.exp(scores[i] - previous)))
                accepted.append(ok)
                previous = float(scores[i])
                if not ok:
                    break
    return np.asarray(depths), np.asarray(probs), np.asarray(accepted, dtype=float)


class Calibration:
    """P(accept the k-th token | its predecessors accepted), from (depth group, confidence bin) cell means;
    cells with fewer than ``min_count`` samples fall back to the confidence bin over all depths."""

    def __init__(self, depths, probs, accepted, bins: int = 20, depth_groups: int = 6, min_count: int = 20):
        self.edges = np.unique(np.quantile(probs, np.linspace(0, 1, bins + 1)[1:-1]))
        self.depth_groups = depth_groups
        b = np.searchsorted(self.edges, probs, side="right")
        g = np.minimum(depths, depth_groups) - 1
        n_bins = len(self.edges) + 1
        pooled = np.bincount(b, weights=accepted, minlength=n_bins) / np.maximum(
            np.bincount(b, minlength=n_bins), 1
        )
        self.table = np.tile(pooled, (depth_groups, 1))
        for group in range(depth_groups):
            sel = g == group
            count = np.bincount(b[sel], minlength=n_bins)
            mean = np.bincount(b[sel], weights=accepted[sel], minlength=n_bins) / np.maximum(count, 1)
            self.table[group] = np.where(count >= min_count, mean, pooled)

    def __call__(self, depths: np.ndarray, probs: np.ndarray) -> np.ndarray:
        b = np.searchsorted(self.edges, probs, side="right")
        return self.table[np.minimum(depths, self.depth_groups) - 1, b]


class CalibratedAnalytic(AnalyticController):
    """``AnalyticController`` on chains with ``Calibration`` in place of kappa * path probability."""

    def __init__(self, profile, calibration: Calibration, max_depth: int):
        super().__init__(profile, tree_width=1, max_depth=max_depth)
        self.calibration = calibration

    def _expected(self, path_probs: np.ndarray) -> np.ndarray:
        p = np.maximum(np.asarray(path_probs, dtype=float), 1e-30)  # a chain: best first = depth order
        step = p / np.concatenate([[1.0], p[:-1]])
        cond = self.calibration(np.arange(1, len(p) + 1), np.minimum(step, 1.0))
        cum = np.concatenate([[0.0], np.cumsum(np.cumprod(cond))])
        return cum[np.minimum(self.ladder, len(p))]

    def observe(self, record) -> None:  # the calibration is fixed (fitted in sample)
        return


# --------------------------------------------------------------------------------- foresight wrappers
class Foresight(Controller):
    """A look at the trace it is replayed on: ``mode`` "first" (is the draft's first token accepted? ``base``
    decides the rest) or "length" (how many drafted tokens are accepted? it drafts and verifies exactly
    those, ``base`` only observes). The position is read off the context length (context = prompt + t + 1)."""

    def __init__(self, base: Controller, rt: ReplayTrace, mode: str):
        self.base, self.rt, self.mode = base, rt, mode
        self.tree_width = base.tree_width
        self.decides_depth_zero = True

    def _run(self, state: DraftState) -> int:
        t = state.context_len - self.rt.trace.prompt_len - 1
        return len(self.rt.position(t).zpath)

    def reset(self) -> None:
        self.base.reset()

    def should_continue(self, state: DraftState) -> bool:
        run = self._run(state)
        if state.depth == 0:
            return run > 0
        if self.mode == "length":
            return state.depth < run
        return self.base.should_continue(state)

    def num_to_verify(self, state: DraftState) -> int:
        if self.mode == "length":
            return len(state.node_scores)
        return self.base.num_to_verify(state)

    def observe(self, record) -> None:
        self.base.observe(record)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True, help="policy.pt (a chain policy: tree width 1)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--prompts-per-language", type=int, default=12)
    ap.add_argument("--tune-prompts-per-language", type=int, default=8)
    ap.add_argument("--temperature", type=float, help="sampling temperature (default: the policy's)")
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument("--profile", help="cost profile JSON (default: the policy's training profile)")
    ap.add_argument("--lookup", default="auto", help="context lookup (default: the policy's trained one)")
    ap.add_argument("--out", help="write the numbers as JSON here")
    args = ap.parse_args(argv)

    held_out = load_profile_arg(args.profile) if args.profile else None
    policy = load_policy(args.policy, profile=held_out)
    if policy.tree_width != 1:
        ap.error("foresight rows are defined for chain policies (tree width 1)")
    try:
        lookup = resolve_lookup(args.lookup, policy.trained_lookup)
    except InputError as err:
        ap.error(str(err))
    temperature = policy.meta["train_config"]["temperature"] if args.temperature is None else args.temperature
    profile, measured, tune = replay_inputs(
        policy,
        held_out,
        args.cache_dir,
        args.split,
        args.prompts_per_language,
        "tune",
        args.tune_prompts_per_language,
        temperature=temperature,
    )
    grid = static_grid(tune, profile, lookup=lookup)
    best = max(grid, key=grid.get)
    calibration = Calibration(*acceptance_samples(measured))

    def run(make) -> float:
        return throughput([replay_generate(rt, make(rt), profile, lookup=lookup) for rt in measured])

    rows = {
        "autoregressive": run(lambda rt: None),
        f"static {best} tuned on tune": run(lambda rt: StaticController(best[0], best[1], tree_width=1)),
        "analytic": run(lambda rt: AnalyticController(profile, 1, policy.max_depth)),
        "learned": run(lambda rt: policy),
        "calibrated analytic (in sample)": run(
            lambda rt: CalibratedAnalytic(profile, calibration, policy.max_depth)
        ),
        "learned + first-token foresight": run(lambda rt: Foresight(policy, rt, "first")),
        "length foresight (draft L, verify L)": run(lambda rt: Foresight(policy, rt, "length")),
        "oracle": oracle_throughput(measured, profile, lookup=lookup),
    }
    oracle = rows["oracle"]
    print(
        f"{trace_summary(measured, args.split, profile, lookup)}; T {temperature}, depth {policy.max_depth}"
    )
    for name, tps in rows.items():
        print(
            f"  {name:36s} {tps:8.3f} tok/s  {tps / rows['learned']:.3f}x learned  {tps / oracle:.3f}x oracle"
        )
    if args.out:
        payload = {
            "rows": rows,
            "best_static_tune": best,
            "split": args.split,
            "temperature": temperature,
            "policy": args.policy,
            "lookup": describe_lookup(lookup),
        }
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
