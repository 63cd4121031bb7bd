"""Hindsight oracle and exact static grid search in replay.

The oracle knows every cycle's outcome in advance (it reads the trace) and picks, at every position, the
(depth, size) that minimises the total remaining time (depth 0, no draft, included); dynamic programming over (position, number of
draft pending inputs) makes that exact for the recorded trajectory under the cost profile's expected
times. No real controller can beat it on that trajectory: it is the upper bound learned policies are
measured against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from engine.control import Controller, DraftState, StaticController
from engine.cost_profile import CostProfile
from engine.lookup import LookupConfig
from engine.results import CycleRecord
from envs.replay import SIZE_LADDER, ReplayTrace, replay_generate, throughput


@dataclass
class OraclePlan:
    total_s: float
    """Least total decode time for the trajectory."""
    tokens: int
    """Decode tokens (the trajectory minus the prefill token)."""
    actions: dict[tuple[int, int], tuple[int, int]]
    """(position, pending) -> (depth, size) along the optimal plan."""


def oracle_plan(rt: ReplayTrace, profile: CostProfile, sizes: Sequence[int] = SIZE_LADDER) -> OraclePlan:
    """Backward DP: best[t][p] = least time to finish from position t with p draft pending inputs."""
    n = len(rt.trace.tokens)
    max_pending = rt.max_depth + 2
    best = np.zeros((n + 1, max_pending + 2))
    choice: dict[tuple[int, int], tuple[int, int]] = {}
    for t in range(n - 2, -1, -1):
        ctx, cap = rt.context_len(t), rt.depth_cap(t)
        for p in range(1, max_pending + 1):
            # depth 0 (no draft: an autoregressive step; the draft falls one more token behind) is always an
            # option, and the only one where the engine caps the depth at 0. Pending counts beyond
            # max_pending are charged as max_pending: optimistic, so the oracle stays an upper bound.
            value = (
                profile.verify_s(0, ctx)
                + profile.overhead_s(0, depth=0)
                + best[t + 1, min(p + 1, max_pending)]
            )
            act = (0, 0)
            for depth in range(1, cap + 1):
                draft = profile.draft_chunk_s(p, ctx) + (depth - 1) * profile.draft_step_s(rt.width, ctx)
                drafted = rt.num_drafted(t, depth)
                for size in sorted({rt.verified(s, drafted) for s in sizes}):
                    acc = rt.accepted(t, depth, size)
                    nxt = t + rt.emitted(t, acc)
                    cost = (
                        draft
                        + profile.verify_s(size, ctx, chain=rt.width == 1)
                        + profile.overhead_s(size, depth=depth, tree_width=rt.width)
                    )
                    total = cost + best[nxt, min(rt.pending_after(t, depth, acc), max_pending)]
                    if total < value:
                        value, act = total, (depth, size)
            best[t, p] = value
            choice[(t, p)] = act
    return OraclePlan(float(best[0, 1]), n - 1, choice)


class OracleController(Controller):
    """Plays an ``OraclePlan`` in replay (it needs the future: replay only)."""

    decides_depth_zero = True

    def __init__(self, rt: ReplayTrace, plan: OraclePlan):
        self.tree_width = rt.width
        self.rt, self.plan = rt, plan
        self.t, self.pending = 0, 1

    def reset(self) -> None:
        self.t, self.pending = 0, 1

    def _action(self) -> tuple[int, int]:
        return self.plan.actions[(self.t, min(self.pending, self.rt.max_depth + 2))]

    def should_continue(self, state: DraftState) -> bool:
        return state.depth < self._action()[0]

    def num_to_verify(self, state: DraftState) -> int:
        return self._action()[1]

    def observe(self, record: CycleRecord) -> None:
        depth, _ = self._action()
        self.pending = (
            self.pending + 1 if depth == 0 else self.rt.pending_after(self.t, depth, record.accepted)
        )
        self.t += record.emitted


def oracle_throughput(
    traces: Iterable[ReplayTrace], profile: CostProfile, sizes: Sequence[int] = SIZE_LADDER
) -> float:
    plans = [oracle_plan(rt, profile, sizes) for rt in traces]
    return sum(p.tokens for p in plans) / sum(p.total_s for p in plans)


def static_grid(
    traces: Sequence[ReplayTrace],
    profile: CostProfile,
    depths: Iterable[int] | None = None,
    sizes: Sequence[int] = SIZE_LADDER,
    progress: bool = False,
    lookup: LookupConfig | None = None,
) -> dict[tuple[int, int], float]:
    """Replay throughput (sum tokens / sum time) of every static (depth, size) on the traces (``lookup``: with
    the engine's context lookup on)."""
    width = traces[0].width
    depths = list(depths or range(1, traces[0].max_depth + 1))
    grid = [(d, s) for d in depths for s in sizes]
    out = {}
    for depth, size in tqdm(grid, desc="static grid", disable=not progress):
        ctrl = StaticController(depth=depth, verify=size, tree_width=width)
        out[(depth, size)] = throughput([replay_generate(rt, ctrl, profile, lookup=lookup) for rt in traces])
    return out
