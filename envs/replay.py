"""Exact trace replay of the engine's cycle loop (the hindsight oracle and the static grid built on it
live in ``envs.oracle``).

``ReplayTrace`` turns a recorded ``Trace`` into what the live engine would see and do at each position:
the ``DraftState`` a controller is shown after each draft step, and the number of tokens accepted for
any (depth, size). ``replay_generate`` runs a controller through the same loop as
``SpeculativeEngine.generate`` (same depth cap, same EOS/budget rules: each cycle is decided by the engine's
own ``engine.cycle.cycle_rules``, the controller asked through ``engine.cycle.answer``) and returns the same
``CycleRecord``s, with times taken from a cost profile instead of a clock. Under load (the server replay,
``envs.server``) it makes the engine's catch-up cycles (``EngineConfig.draft_catch_up_tokens``) where the live
engine makes them: it tracks what the draft is behind by (the prompt it has not run, its pending tokens).

Accepted length, exactly: the trajectory z walks down the *full* recorded tree along a unique path
n_1, n_2, ... (sibling tokens are distinct). A controller's sub-tree S (top-V by score among depth <= D)
is ancestor-closed, so the accepted length is the number of leading path nodes inside S: n_i is in S iff
i <= D and its rank among depth-<=D nodes is < V.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from engine.backends.attention import MAX_VERIFY_NODES
from engine.control import Controller, DraftState
from engine.costs.cost_profile import CostProfile
from engine.cycle import (
    DRAFT_CATCH_UP_TOKENS,
    DraftLag,
    answer,
    cycle_cap,
    cycle_rules,
    draft_budget,
    lookup_cap,
    tree_cap,
)
from engine.errors import InputError
from engine.load import LoadState
from engine.lookup import LookupConfig, NgramIndex
from engine.results import CycleRecord
from engine.tree import MAX_TREE_NODES, clamp_verify
from envs.trace import Trace, TraceError

Message = tuple[Literal["depth", "size", "use_lookup"], DraftState] | tuple[Literal["cycle"], CycleRecord]
"""What an episode yields: ``("use_lookup", state)`` where context lookup proposes ``state.lookup_proposed``
tokens and the controller decides lookup, ``("depth", state)`` after each draft step (and at depth 0 when
asked), ``("size", state)`` once drafting stops, ``("cycle", record)`` after every cycle."""
Reply = bool | int | None
"""What the driver sends back: to ``"use_lookup"`` a bool (verify the proposal?), to ``"depth"`` a bool (draft
one more level?), to ``"size"`` an int (nodes to verify), to ``"cycle"`` None (and None to start an
episode)."""


@dataclass
class Position:
    """Precomputed replay facts of one position's tree."""

    scores: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    frontiers: list[np.ndarray]
    """frontiers[d-1]: node indices of the frontier after draft step d (what step d+1 would expand)."""
    order_by_depth: list[np.ndarray]
    """order_by_depth[d-1]: nodes of depth <= d, best first (score desc, then creation order)."""
    zpath: np.ndarray
    """n_1, n_2, ...: the tree path the trajectory walks down (node indices)."""
    zpath_rank: np.ndarray
    """[max_depth, len(zpath)]: rank of n_i among depth-<=d nodes (row d-1)."""
    views: dict = field(default_factory=dict)
    """depth -> (frontier scores, step probs, node scores): the DraftState arrays, built once."""


class ReplayTrace:
    """A trace plus lazily built per-position replay facts.

    ``engine_max_depth``, ``engine_max_verify`` and ``engine_max_tree_nodes`` are the ``EngineConfig`` caps of
    the engine being replayed (defaults: the engine's defaults); replay applies them exactly as the engine
    does (``depth_cap``, ``engine.tree.clamp_verify``)."""

    def __init__(
        self,
        trace: Trace,
        max_new_tokens: int | None = None,
        engine_max_depth: int = 32,
        engine_max_verify: int = MAX_VERIFY_NODES,
        engine_max_tree_nodes: int = MAX_TREE_NODES,
    ):
        self.trace = trace
        meta = trace.meta
        self.width = int(meta.get("tree_width", 1))
        self.max_depth = int(meta.get("max_depth", 0)) or int(trace.node_depths.max(initial=0))
        self.max_new_tokens = int(max_new_tokens or meta.get("max_new_tokens") or len(trace.tokens))
        if self.max_new_tokens < len(trace.tokens):
            raise TraceError(f"{trace.prompt_id}: max_new_tokens {self.max_new_tokens} < trajectory length")
        self.max_context = int(meta.get("max_context", 2**31 - 1))
        self.temperature = float((meta.get("sampling") or {}).get("temperature", 0.0))
        self.engine_max_depth = engine_max_depth
        self.engine_max_verify = engine_max_verify
        self.engine_max_tree_nodes = engine_max_tree_nodes
        if self.width > engine_max_tree_nodes:  # the engine refuses such a controller
            raise InputError(
                f"{trace.prompt_id}: tree_width {self.width} exceeds max_tree_nodes {engine_max_tree_nodes}"
            )
        self._positions: dict[int, Position] = {}
        self._lookup: dict[LookupConfig, list[list[int]]] = {}

    def position(self, t: int) -> Position:
        pos = self._positions.get(t)
        if pos is None:
            pos = self._positions[t] = self._build(t)
        return pos

    def _build(self, t: int) -> Position:
        tokens, parents, depths, scores = self.trace.nodes(t)
        depths = depths.astype(np.int64)
        n = len(tokens)
        order = np.lexsort((np.arange(n), -scores.astype(np.float64)))  # best first, ties: earlier node
        frontiers, order_by_depth = [], []
        for d in range(1, self.max_depth + 1):
            level = order[depths[order] == d]
            frontiers.append(level[: self.width])
            order_by_depth.append(order[depths[order] <= d])
        # the trajectory's walk down the full tree
        children: dict[tuple[int, int], int] = {
            (int(p), int(tok)): i for i, (p, tok) in enumerate(zip(parents, tokens))
        }
        zpath, node = [], -1
        for tok in self.trace.tokens[t + 1 :]:
            child = children.get((node, int(tok)))
            if child is None:
                break
            zpath.append(child)
            node = child
        zpath = np.asarray(zpath, dtype=np.int64)
        rank = np.full((self.max_depth, len(zpath)), n, dtype=np.int64)
        for d in range(1, self.max_depth + 1):
            inv = np.full(n, n, dtype=np.int64)
            inv[order_by_depth[d - 1]] = np.arange(len(order_by_depth[d - 1]))
            rank[d - 1] = inv[zpath]
        return Position(scores.astype(np.float32), parents, depths, frontiers, order_by_depth, zpath, rank)

    # -------------------------------------------------------------------------------- engine semantics
    def context_len(self, t: int) -> int:
        return self.trace.prompt_len + t + 1

    def budget_cap(self, t: int) -> int:
        """Drafted tokens a cycle at position t may add, by the engine's own rule (``engine.cycle.
        draft_budget``): min(engine max depth, remaining budget - 1, context room - 1)."""
        remaining = self.max_new_tokens - (t + 1)
        return draft_budget(self.engine_max_depth, remaining, self.max_context - self.context_len(t))

    def depth_cap(self, t: int) -> int:
        """The engine's cap (``engine.cycle.cycle_cap`` of ``budget_cap`` and the tree-node cap's depth,
        ``engine.cycle.tree_cap``), at most the recorded depth."""
        return min(
            cycle_cap(self.budget_cap(t), tree_cap(self.width, self.engine_max_tree_nodes)), self.max_depth
        )

    def verified(self, num_verify: int, num_drafted: int) -> int:
        """Nodes the engine verifies when asked for ``num_verify`` (``engine.tree.clamp_verify``)."""
        return clamp_verify(num_verify, num_drafted, self.engine_max_verify)

    def done(self, t: int) -> bool:
        return t + 1 >= len(self.trace.tokens)

    def state(
        self, t: int, depth: int, history: Sequence[CycleRecord], load: LoadState | None = None
    ) -> DraftState:
        """The DraftState the live engine shows a controller after draft step ``depth`` at position t
        (depth 0: before the first step, empty arrays); ``load``: the step's load (``engine.load``)."""
        if depth == 0:
            return DraftState.before_drafting(
                self.context_len(t), self.depth_cap(t), history, self.temperature, load=load
            )
        pos = self.position(t)
        view = pos.views.get(depth)
        if view is None:
            frontier = pos.frontiers[depth - 1]
            parents = pos.parents[frontier]
            parent_scores = np.where(parents >= 0, pos.scores[np.maximum(parents, 0)], 0.0)
            view = pos.views[depth] = (
                np.sort(pos.scores[frontier])[::-1],
                np.exp(pos.scores[frontier] - parent_scores).astype(np.float32),
                pos.scores[pos.order_by_depth[depth - 1]],
            )
        return DraftState(
            depth=depth,
            frontier_scores=view[0],
            step_probs=view[1],
            node_scores=view[2],
            context_len=self.context_len(t),
            max_depth=self.depth_cap(t),
            history=history,
            temperature=self.temperature,
            load=load,
        )

    def num_drafted(self, t: int, depth: int) -> int:
        return len(self.position(t).order_by_depth[depth - 1])

    def accepted(self, t: int, depth: int, num_verify: int) -> int:
        """Drafted tokens accepted at position t when drafting ``depth`` levels and verifying the top
        ``num_verify`` nodes."""
        pos = self.position(t)
        k = min(depth, len(pos.zpath))
        inside = pos.zpath_rank[depth - 1, :k] < num_verify
        return int(k if inside.all() else np.argmin(inside))

    def emitted(self, t: int, accepted: int) -> int:
        """Tokens committed: accepted + recovered/bonus, except when the accepted path ends the trajectory
        (EOS accepted inside the block)."""
        return min(accepted + 1, len(self.trace.tokens) - 1 - t)

    def lookup_cap(self, t: int, config: LookupConfig) -> int:
        """The most tokens the engine lets a context lookup propose at position t (``EngineConfig.lookup``):
        ``engine.cycle.lookup_cap`` (min(``budget_cap``, engine max verify, the config's longest proposal))."""
        return lookup_cap(self.budget_cap(t), self.engine_max_verify, config)

    def lookup(self, t: int, config: LookupConfig) -> tuple[int, int]:
        """(proposed, accepted) of a context lookup at position t: the engine's ``NgramIndex`` proposal on
        ``prompt + tokens[:t+1]`` (cut to ``lookup_cap``) and how many of its leading tokens the trajectory
        repeats. (0, 0): no match, the cycle is the controller's."""
        proposals = self._lookup.get(config)
        if proposals is None:
            proposals = self._lookup[config] = self._lookup_proposals(config)
        proposal = proposals[t][: max(self.lookup_cap(t, config), 0)]
        future = self.trace.tokens[t + 1 : t + 1 + len(proposal)]
        accepted = 0
        for want, got in zip(proposal, future):
            if int(want) != int(got):
                break
            accepted += 1
        return len(proposal), accepted

    def _lookup_proposals(self, config: LookupConfig) -> list[list[int]]:
        prompt = self.trace.meta.get("prompt_ids")
        if prompt is None or len(prompt) != self.trace.prompt_len:
            raise TraceError(
                f"{self.trace.prompt_id}: the trace has no prompt ids (meta 'prompt_ids'), which context lookup "
                "replay needs; record it again"
            )
        index = NgramIndex(config, prompt)
        out = []
        for tok in self.trace.tokens:
            index.extend([int(tok)])
            out.append(index.propose(config.most_tokens))
        return out

    def pending_after(self, t: int, depth: int, accepted: int) -> int:
        """Draft pending inputs of the next cycle: the accepted nodes the draft never ran (only frontier
        nodes of steps < depth are run) plus the recovered/bonus token."""
        pos = self.position(t)
        ran = 0
        for i in range(accepted):
            if i + 1 >= depth or pos.zpath[i] not in pos.frontiers[i]:
                break
            ran += 1
        return accepted - ran + 1


def replay_cycles(
    rt: ReplayTrace,
    profile: CostProfile | None = None,
    rng: np.random.Generator | None = None,
    speculative: bool = True,
    depth_zero: bool = False,
    lookup: LookupConfig | None = None,
    load: Callable[[], LoadState | None] | None = None,
    catch_up: int = DRAFT_CATCH_UP_TOKENS,
    lag: DraftLag | None = None,
    gate: bool = False,
) -> Generator[Message, Reply, None]:
    """The engine's cycle loop on a trace, as a coroutine: yields ``("depth", DraftState)`` (send a bool:
    continue?), ``("size", DraftState)`` (send the number of nodes to verify) and ``("cycle",
    CycleRecord)`` (send None) after every cycle. Each cycle is decided by the engine's own rules
    (``engine.cycle.cycle_rules``), its questions answered from the trace. Times come from ``profile``
    (expected values, or with sampled noise when ``rng`` is given). ``speculative=False`` decodes
    autoregressively. ``depth_zero``: also ask ``("depth", state at depth 0)`` before drafting (the engine
    does so for controllers with ``decides_depth_zero``); False makes the cycle an autoregressive step.
    ``lookup``: the engine's context lookup (``EngineConfig.lookup``): where it proposes (and its load limit
    lets it run), the cycle is a lookup cycle and nothing is asked. ``load``: called at each cycle's start,
    the load its states show (the server replay, ``envs.server``); None: alone. ``catch_up``: the engine's
    ``EngineConfig.draft_catch_up_tokens``: under load (``engine.cycle.shares_its_step``: other requests
    decoding or prefilling in the step) a cycle that would draft while the draft is behind by more than that
    (the prompt it has not run plus its pending tokens) is a catch-up cycle, as in the engine: an
    autoregressive step recorded with ``catch_up`` = the chunk's tokens (the prompt's first); alone never.
    ``lag``: what the draft is behind by (``engine.cycle.DraftLag``), updated once each cycle's message has
    been answered (a server replay reads it while it times the step); None: the loop's own. ``gate``: the
    controller decides context lookup (``Controller.decides_lookup``): a proposal yields ``("use_lookup",
    state)`` at every load, and "no" goes on to the controller's cycle."""
    records: list[CycleRecord] = []
    t = 0
    lag = lag if lag is not None else DraftLag(rt.trace.prompt_len)  # its prefill is lazy: the whole prompt
    rules = lookup.rules if lookup is not None else None  # the proposals (the load limit aside)
    while not rt.done(t):
        now = load() if load is not None else None
        decide = cycle_rules(
            rt.depth_cap(t), now, lookup, speculative, depth_zero, lag.behind, catch_up, gate
        )
        reply, accepted = None, 0
        while True:
            try:
                kind, depth = decide.send(reply)
            except StopIteration as stop:
                plan = stop.value
                break
            if kind == "lookup":
                proposed, accepted = rt.lookup(t, rules)
                reply = proposed
            elif kind == "use_lookup":
                state = replace(rt.state(t, 0, records, now), lookup_proposed=depth)
                reply = yield (kind, state)
            else:
                reply = yield (kind, rt.state(t, depth, records, now))
        ctx, pending = rt.context_len(t), lag.pending
        if plan.kind == "lookup":
            rec = CycleRecord(
                ctx, 0, plan.proposed, plan.proposed, accepted, rt.emitted(t, accepted), lookup=True
            )
        elif plan.kind == "speculative":
            num_drafted = rt.num_drafted(t, plan.depth)
            num_verify = rt.verified(plan.size, num_drafted)
            accepted = rt.accepted(t, plan.depth, num_verify)
            emitted = rt.emitted(t, accepted)
            rec = CycleRecord(ctx, plan.depth, num_drafted, num_verify, accepted, emitted)
        else:  # an autoregressive step; a catch-up cycle's draft chunk next to it
            rec, pending = CycleRecord(ctx, 0, 0, 0, 0, 1, catch_up=plan.catch_up), 0
        charge_times(rec, profile, rng, pending=pending if plan.kind == "speculative" else 0, width=rt.width)
        records.append(rec)
        yield ("cycle", rec)
        lag.commit(rec, rt.pending_after(t, rec.depth, rec.accepted) if rec.depth else 0)
        t += rec.emitted


def replay_generate(
    rt: ReplayTrace,
    controller: Controller | None,
    profile: CostProfile | None = None,
    rng: np.random.Generator | None = None,
    measure_controller: bool = False,
    lookup: LookupConfig | None = None,
) -> list[CycleRecord]:
    """Run ``controller`` through ``replay_cycles`` (None: autoregressive); returns the cycle records,
    as ``SpeculativeEngine.generate`` would. ``measure_controller`` charges the controller's real call
    time to ``controller_s``. ``lookup``: the engine's context lookup (``EngineConfig.lookup``); the
    controller is asked and shown the cycles as the engine does (``engine.cycle.answer``: lookup cycles are
    not shown to its ``observe``)."""
    if controller is not None:
        if controller.tree_width != rt.width:
            raise ValueError(f"controller tree_width {controller.tree_width} != trace tree_width {rt.width}")
        controller.reset()
    loop = replay_cycles(
        rt,
        profile,
        rng,
        speculative=controller is not None,
        depth_zero=controller is not None and controller.decides_depth_zero,
        lookup=lookup,
        gate=controller is not None and controller.decides_lookup,
    )
    records, ctrl_s, reply = [], 0.0, None
    while True:
        try:
            message = loop.send(reply)
        except StopIteration:
            return records
        if message[0] == "cycle":
            if measure_controller:
                message[1].controller_s, ctrl_s = ctrl_s, 0.0
            records.append(message[1])
            reply = answer(controller, message)
            continue
        t0 = time.perf_counter()
        reply = answer(controller, message)  # answers are checked as the engine checks them
        ctrl_s += time.perf_counter() - t0


def charge_times(
    rec: CycleRecord, profile: CostProfile, rng: np.random.Generator | None, pending: int, width: int
) -> None:
    """Fill the record's times from the cost profile (no profile: times stay 0)."""
    if profile is None:
        return
    ctx = rec.context_len
    if rec.lookup:  # a one-node-wide chain verified without drafting
        rec.verify_s = profile.verify_s(rec.num_verified, ctx, chain=True)
        rec.overhead_s = profile.overhead_s(rec.num_verified, depth=1)
    elif rec.depth == 0:
        rec.verify_s = profile.verify_s(0, ctx)
        rec.overhead_s = profile.overhead_s(0, depth=0)
        if rec.catch_up:  # a catch-up cycle's draft chunk
            rec.draft_s = profile.draft_chunk_s(rec.catch_up, ctx)
    else:
        rec.draft_s = profile.draft_chunk_s(pending, ctx) + (rec.depth - 1) * profile.draft_step_s(width, ctx)
        rec.verify_s = profile.verify_s(rec.num_verified, ctx, chain=width == 1)
        rec.overhead_s = profile.overhead_s(rec.num_verified, depth=rec.depth, tree_width=width)
    if rng is not None:
        scale = profile.noise_scale(rng) if hasattr(profile, "noise_scale") else 1.0
        rec.draft_s *= scale
        rec.verify_s *= scale
    rec.forward_s = rec.draft_s + rec.verify_s


def throughput(records_per_trace: Sequence[Sequence[CycleRecord]]) -> float:
    """Total decode tokens over total decode time (sum N / sum T: the quantity to maximise)."""
    tokens = sum(r.emitted for recs in records_per_trace for r in recs)
    seconds = sum(r.total_s for recs in records_per_trace for r in recs)
    return tokens / seconds if seconds > 0 else float("nan")
