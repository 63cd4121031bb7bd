"""The cost model (docs/design.md section 6.1) made operational with online acceptance estimates and a
measured cost profile: the baseline a learned policy must beat to be worth its complexity.

Expected accepted tokens when verifying the top-V nodes: sum of their calibrated path probabilities
min(1, kappa * exp(score)) (each node is accepted iff its whole path is; the sum over nodes of P(node
accepted) is the expected accepted length). kappa corrects the draft's over/under-confidence online:
an exponential average of accepted / predicted over past cycles.

* Size: V maximising (1 + E(V)) / (t_draft + t_verify(V) + t_overhead(V)), V on the ladder.
* Depth: continue while the best ratio after one more level (its nodes predicted from the frontier and
  the last step's probabilities) beats the best ratio now.
* Depth 0 (draft at all?): from the per-token acceptance of the recent speculative cycles (geometric
  maximum likelihood), the article's expected tokens per cycle E(alpha, d) = (1 - alpha^(d+1)) / (1 - alpha)
  over the cost of drafting d and verifying d, at the best d, against one autoregressive step's 1 / T(0).
  While speculation is off, it drafts again every ``probe_every`` cycles to refresh the estimate.
"""

from __future__ import annotations

import numpy as np

from engine.control import Controller, DraftState
from engine.costs.cost_profile import CostProfile
from engine.costs.load_model import LoadedProfiles
from engine.costs.speedup_model import (
    SIZE_LADDER,
    best_size,
    cycle_cost_s,
    expected_accepted,
    expected_tokens,
    next_level_probs,
    tokens_per_cost,
)
from engine.results import CycleRecord


class AnalyticController(Controller):
    """Cost-model controller; ``profile`` provides draft_step_s(width, ctx), verify_s(nodes, ctx) and
    overhead_s(nodes) (``engine.costs.cost_profile.CostProfile``)."""

    decides_depth_zero = True

    def __init__(
        self,
        profile: CostProfile,
        tree_width: int = 1,
        max_depth: int = 16,
        ladder: tuple[int, ...] = SIZE_LADDER,
        smoothing: float = 0.2,
        probe_every: int = 8,
        load_aware: bool = True,
    ):
        """``load_aware``: in a batch (``DraftState.load``), cost each choice at the load as
        ``engine.costs.load_model`` does (what it adds to the forwards every request waits on), when the
        profile has a batch axis; False, or without one: the request's own forward times, as alone."""
        if profile is None:
            raise ValueError("AnalyticController needs a cost profile (python -m engine.costs.measure_costs)")
        self.profile, self.tree_width, self.max_depth = profile, tree_width, max_depth
        self.loads = LoadedProfiles(profile) if load_aware else None
        self._at = profile
        self.ladder, self.smoothing, self.probe_every = np.asarray(ladder), smoothing, probe_every
        self.reset()

    def reset(self) -> None:
        self.kappa = 1.0
        self._predicted = 0.0

    # ------------------------------------------------------------------------------------- the model
    def _expected(self, path_probs: np.ndarray) -> np.ndarray:
        """[len(ladder)] expected accepted tokens for each ladder size (nodes sorted best first)."""
        return expected_accepted(np.minimum(1.0, self.kappa * path_probs), self.ladder)

    def _best(self, path_probs: np.ndarray, depth: int, ctx: int) -> tuple[float, int]:
        """(the best tokens per second, its size) of verifying after ``depth`` draft steps."""
        sizes = np.minimum(self.ladder, len(path_probs))
        cost = cycle_cost_s(self._at, depth, sizes, ctx, self.tree_width)
        return best_size(tokens_per_cost(self._expected(path_probs), cost), sizes)

    # ------------------------------------------------------------------------------------ decisions
    def speculation_pays(self, state: DraftState) -> bool:
        """Depth 0: is drafting expected to beat an autoregressive step, given recent acceptance?"""
        history = state.history
        off = 0
        while off < len(history) and history[-1 - off].depth == 0:
            off += 1
        recent = [r for r in history[-16:] if r.depth > 0 and r.num_verified > 0]
        if not recent or off >= self.probe_every:
            return True
        accepted = sum(r.accepted for r in recent)
        rejected = sum(r.accepted < r.num_verified for r in recent)
        alpha = min(accepted / max(accepted + rejected, 1e-9), 0.99)
        ctx, width, p = state.context_len, self.tree_width, self._at
        autoregressive = 1.0 / cycle_cost_s(p, 0, [0], ctx, width)[0]
        best = 0.0
        for d in range(1, max(1, min(self.max_depth, state.max_depth)) + 1):
            best = max(best, expected_tokens(alpha, d) / cycle_cost_s(p, d, [d], ctx, width)[0])
        return best > autoregressive

    def _load(self, state: DraftState) -> None:
        """The profile this decision costs its choices with: the load's view of it, or the profile."""
        self._at = self.loads.at(state.load) if self.loads is not None else self.profile

    def should_continue(self, state: DraftState) -> bool:
        self._load(state)
        if state.depth == 0:
            return self.speculation_pays(state)
        if state.depth >= self.max_depth:
            return False
        ctx = state.context_len
        probs = np.exp(state.node_scores)
        now, _ = self._best(probs, state.depth, ctx)
        # next level: every frontier node gets `width` children (``speedup_model.next_level_probs``)
        nxt_probs = next_level_probs(probs, np.exp(state.frontier_scores), state.step_probs, self.tree_width)
        nxt, _ = self._best(nxt_probs, state.depth + 1, ctx)
        return nxt > now

    def num_to_verify(self, state: DraftState) -> int:
        self._load(state)
        ctx = state.context_len
        probs = np.exp(state.node_scores)
        _, size = self._best(probs, state.depth, ctx)
        self._predicted = float(np.minimum(1.0, self.kappa * probs[:size]).sum())
        return size

    def observe(self, record: CycleRecord) -> None:
        if record.num_verified == 0 or self._predicted <= 1e-6:
            return
        ratio = float(np.clip(record.accepted / self._predicted, 0.2, 3.0))
        self.kappa = float(np.clip(self.kappa * ratio**self.smoothing, 0.05, 20.0))

    def __repr__(self) -> str:
        return f"AnalyticController(tree_width={self.tree_width}, max_depth={self.max_depth})"
