"""Hindsight oracle and exact static grid search in replay.

The oracle knows every cycle's outcome in advance (it reads the trace) and picks, at every position, the
(depth, size) that minimises the total remaining time (depth 0, no draft, included); dynamic programming over
(position, number of draft pending inputs) makes that exact for the recorded trajectory under the cost
profile's expected times. With the engine's context lookup (``lookup``) the positions where the lookup
proposes are lookup cycles for every controller (the engine takes them without asking), so the oracle plans
them as forced moves, and stays the upper bound of controllers replayed with that lookup that do not decide
it themselves. A controller that ``decides_lookup`` (``engine.control``) may decline a proposal, a move this
oracle does not plan: against such a controller it is the oracle under the engine's lookup rule, not a bound.
Otherwise no real controller can beat it on that trajectory: it is the upper bound learned policies are
measured against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from engine.control import Controller, DraftState, StaticController
from engine.costs.cost_profile import CostProfile, chunk_curve
from engine.costs.speedup_model import SIZE_LADDER
from engine.lookup import LookupConfig
from engine.results import CycleRecord
from envs.replay import ReplayTrace, replay_generate, throughput


@dataclass
class OraclePlan:
    total_s: float
    """Least total decode time for the trajectory."""
    tokens: int
    """Decode tokens (the trajectory minus the prefill token)."""
    drafting: dict[int, tuple[np.ndarray, tuple[int, int]]]
    """position -> (for each pending count 1, 2, ...: is drafting chosen; the (depth, size) drafted then).
    Positions absent: lookup cycles."""

    def action(self, t: int, pending: int) -> tuple[int, int]:
        """(depth, size) at position ``t`` with ``pending`` draft pending inputs; (0, 0): an autoregressive
        step."""
        chosen, act = self.drafting[t]
        return act if chosen[pending - 1] else (0, 0)


def oracle_plan(
    rt: ReplayTrace,
    profile: CostProfile,
    sizes: Sequence[int] = SIZE_LADDER,
    lookup: LookupConfig | None = None,
) -> OraclePlan:
    """Backward DP: best[t][p] = least time to finish from position t with p draft pending inputs
    (``lookup``: the engine's context lookup, whose cycles are forced moves).

    Pending inputs (tokens the draft has not run yet) grow by one on every autoregressive step and by the
    emitted tokens of every lookup cycle, so the DP keeps every count up to the trajectory's length (at
    position t at most t + 1): the plan's time is what replay charges for it, exactly. Only the first draft
    step's cost depends on the count, so the best drafting action at t is found once and compared, for
    every count at once, with an autoregressive step."""
    n = len(rt.trace.tokens)
    top = n + 1  # the most pending inputs any position can have
    counts = np.arange(1, top + 1)
    best = np.zeros((n + 1, top + 1))  # column p: p pending inputs (column 0 unused)
    choice: dict[int, tuple[np.ndarray, tuple[int, int]]] = {}
    for t in range(n - 2, -1, -1):
        ctx, cap = rt.context_len(t), rt.depth_cap(t)
        proposed, accepted = rt.lookup(t, lookup) if lookup is not None else (0, 0)
        if proposed:  # a lookup cycle, whatever the controller would say (replay_cycles)
            emitted = rt.emitted(t, accepted)
            cost = profile.verify_s(proposed, ctx, chain=True) + profile.overhead_s(proposed, depth=1)
            best[t, 1:] = cost + best[t + emitted, np.minimum(counts + emitted, top)]
            continue
        # depth 0 (no draft: an autoregressive step; the draft falls one more token behind) is always an
        # option, and the only one where the engine caps the depth at 0
        step = profile.verify_s(0, ctx) + profile.overhead_s(0, depth=0)
        values = step + best[t + 1, np.minimum(counts + 1, top)]
        draft_act, draft_rest, chosen = (0, 0), np.inf, np.zeros(top, dtype=bool)
        for depth in range(1, cap + 1):
            later = (depth - 1) * profile.draft_step_s(rt.width, ctx)
            drafted = rt.num_drafted(t, depth)
            for size in sorted({rt.verified(s, drafted) for s in sizes}):
                acc = rt.accepted(t, depth, size)
                nxt = t + rt.emitted(t, acc)
                rest = (
                    later
                    + profile.verify_s(size, ctx, chain=rt.width == 1)
                    + profile.overhead_s(size, depth=depth, tree_width=rt.width)
                    + best[nxt, min(rt.pending_after(t, depth, acc), top)]
                )
                if rest < draft_rest:
                    draft_act, draft_rest = (depth, size), rest
        if draft_act != (0, 0):
            drafting = chunk_curve(profile, top, ctx) + draft_rest
            chosen = drafting < values
            values = np.where(chosen, drafting, values)
        best[t, 1:] = values
        choice[t] = (chosen, draft_act)
    return OraclePlan(float(best[0, 1]), n - 1, choice)


class OracleController(Controller):
    """Plays an ``OraclePlan`` in replay (it needs the future: replay only). Lookup cycles are not shown to
    ``observe`` (as in the engine); the controller catches up from the context length it is shown next."""

    decides_depth_zero = True

    def __init__(self, rt: ReplayTrace, plan: OraclePlan):
        self.tree_width = rt.width
        self.rt, self.plan = rt, plan
        self.t, self.pending = 0, 1

    def reset(self) -> None:
        self.t, self.pending = 0, 1

    def _action(self, state: DraftState) -> tuple[int, int]:
        t = state.context_len - self.rt.trace.prompt_len - 1
        if t > self.t:  # lookup cycles ran since the last observe: the draft fell that many tokens behind
            self.pending += t - self.t
            self.t = t
        return self.plan.action(self.t, self.pending)

    def should_continue(self, state: DraftState) -> bool:
        return state.depth < self._action(state)[0]

    def num_to_verify(self, state: DraftState) -> int:
        return self._action(state)[1]

    def observe(self, record: CycleRecord) -> None:
        depth, _ = self.plan.action(self.t, self.pending)
        self.pending = (
            self.pending + 1 if depth == 0 else self.rt.pending_after(self.t, depth, record.accepted)
        )
        self.t += record.emitted


def oracle_throughput(
    traces: Iterable[ReplayTrace],
    profile: CostProfile,
    sizes: Sequence[int] = SIZE_LADDER,
    lookup: LookupConfig | None = None,
) -> float:
    """The oracle's replay throughput (sum tokens / sum time) on the traces (``lookup``: with the engine's
    context lookup on, the upper bound of controllers replayed with it)."""
    plans = [oracle_plan(rt, profile, sizes, lookup) for rt in traces]
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
