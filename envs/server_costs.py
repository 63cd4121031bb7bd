"""The time of a server replay's step (``envs.server``) and each request's charge of it: a batched draft
forward per draft level (level 1: each request's pending tokens, or a catch-up cycle's chunk), one batched
target forward, the draft prefills of first drafting cycles (``draft_prefill_s``), each request's per-cycle
overhead and the step's own; the forwards split among the requests by ``engine.costs.load_model.
split_forward`` (marginal rows plus an equal share), corrected from the batch table's context to each
request's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.costs.cost_profile import CostProfile
from engine.costs.load_model import split_forward


def charge_step(sim: Any, running: Sequence[Any], shared: float) -> float:
    """Time the step of ``sim`` (an ``envs.server.ServerReplay``, which imports this module, or anything with
    its ``profile``, ``table``, ``context``, ``width`` and ``step_overhead_s``) whose requests ``running`` ran
    their cycles (``ReplayRequest``s, or anything with their ``record``, ``lag`` and ``prompt_len``: the steps of
    a live server's step log, ``envs.step_costs``): its forwards and overheads; write each request's charge
    into its record. Returns the step's time without the prefills (``shared``, split equally here)."""
    profile, table, ctx_b, width = sim.profile, sim.table, sim.context, sim.width
    recs = [r.record for r in running]
    total = 0.0
    for rec in recs:
        rec.draft_s = rec.verify_s = rec.overhead_s = 0.0
    # draft prefills (a request's first drafting cycle runs the draft over its prompt, or over what
    # catch-up cycles left of it)
    for req, rec in zip(running, recs):
        if rec.depth > 0 and req.lag.prompt_left > 0:
            extra = draft_prefill_s(profile, req.prompt_len, req.lag.prompt_left)
            rec.draft_s += extra
            total += extra
    depth = max((1 if rec.catch_up else rec.depth for rec in recs), default=0)
    for level in range(1, depth + 1):
        # level 1: each drafting request's pending tokens, and each catch-up cycle's chunk
        members = [i for i, rec in enumerate(recs) if rec.depth >= level or (level == 1 and rec.catch_up)]
        rows = [(recs[i].catch_up or running[i].lag.pending) if level == 1 else width for i in members]
        t, shares = split_forward(table, "draft", rows)
        total += t
        for i, r, c in zip(members, rows, shares):
            ctx = recs[i].context_len
            if recs[i].catch_up:  # the chunk sees the draft's cache so far and itself
                ctx = ctx - running[i].lag.behind + r
            if level == 1:
                fix = profile.draft_chunk_s(r, ctx) - profile.draft_chunk_s(r, ctx_b)
            else:
                fix = profile.draft_step_s(r, ctx) - profile.draft_step_s(r, ctx_b)
            recs[i].draft_s += c + fix
            total += fix
    rows = [1 + rec.num_verified for rec in recs]
    t, shares = split_forward(table, "target", rows, [1] * len(rows))
    total += t
    for i, (rec, c) in enumerate(zip(recs, shares)):
        chain = rec.lookup or width == 1
        fix = profile.verify_s(rec.num_verified, rec.context_len, chain) - profile.verify_s(
            rec.num_verified, ctx_b, chain
        )
        over = profile.overhead_s(rec.num_verified, depth=0 if rec.depth == 0 and not rec.lookup else max(rec.depth, 1), tree_width=width)  # fmt: skip
        rec.verify_s = c + fix + shared / len(running)
        rec.overhead_s = over
        total += fix + over
        running[i].target_rows = rows[i]
        running[i].drafted = rec.depth > 0 or rec.catch_up > 0  # as the engine counts draft forwards
    for rec in recs:
        rec.forward_s = rec.draft_s + rec.verify_s
        rec.overhead_s += sim.step_overhead_s / len(recs)
    return total + sim.step_overhead_s


def draft_prefill_s(profile: CostProfile, prompt_len: int, left: int) -> float:
    """The draft's prefill of the last ``left`` tokens of a ``prompt_len``-token prompt: the profile's prefill
    with the draft minus without, at the prompt's end less at the start of those tokens (the whole prompt:
    the difference at ``prompt_len``, as before chunks); never below 0 (a noisy profile's curve can dip)."""

    def draft_part(n: int) -> float:
        return profile.prefill_s(n, with_draft=True) - profile.prefill_s(n, with_draft=False)

    if left >= prompt_len:
        return draft_part(prompt_len)
    return max(draft_part(prompt_len) - draft_part(prompt_len - left), 0.0)


def chunk_prefill_s(profile: Any, start: int, take: int) -> float:
    """A prefill chunk of ``take`` prompt tokens from position ``start``: the profile's target prefill to its
    end less to its start (the chunks of a prompt add up to its whole prefill); never below 0 (a noisy
    profile's curve can dip)."""
    before = profile.prefill_s(start, with_draft=False) if start else 0.0
    return max(profile.prefill_s(start + take, with_draft=False) - before, 0.0)
