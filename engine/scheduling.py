"""The batched engine's scheduling rules of a step, shared with its replay (``envs.server``): which prompt
tokens are prefilled (``prefill_budget``, ``plan_prefills``), the load each request's cycle is shown
(``step_load``), and how many drafted nodes each request verifies under the row cap (``row_budget``,
``grant_rows``); the rules in words are in ``engine.batch``'s docstring (step 1, "Row cap"). ``StepPlan``: what
a step ran, as both record it (``BatchedEngine.last_step``, ``envs.server_runs.ServerRun.plans``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.backends.attention import MAX_ROWWISE_ROWS
from engine.load import LoadState
from engine.results import CycleRecord

CYCLE_FIELDS = (
    "context",
    "depth",
    "drafted",
    "verified",
    "accepted",
    "emitted",
    "lookup",
    "catch_up",
    "forward_s",
)
"""A step log's cycle entry (``serve.py --step-log``, ``serving.step_log``): these fields of a ``StepPlan``'s cycle
record after the request number, in order (``envs.step_costs`` reads them back)."""


@dataclass
class StepPlan:
    """What one step of the batched engine (or of its replay) ran: ``prefill``: (request, prompt tokens, the
    position the chunk starts at: the prompt tokens already in the request's cache, prefix-cache hits
    included) of each prefill chunk, in admission order; ``cycles``: (request, its cycle's record) of each request that ran
    a cycle, in admission order. Requests are numbered in admission order from 0 (the engine's ids)."""

    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    cycles: list[tuple[int, CycleRecord]] = field(default_factory=list)


def step_load(
    requests: int, waiting: int, last_rows: int, own_rows: int, last_drafting: int, drafted: bool, rate: float
) -> LoadState:
    """The load a request's cycle is shown in a step (``engine.load``): ``requests`` decoding in it,
    ``waiting`` for their prefill (inside or outside the batch), the rows and drafting requests of the last
    step (``last_rows``, ``last_drafting``) less this request's own (``own_rows``, ``drafted``), and the arrival
    ``rate``."""
    return LoadState(
        requests=requests,
        waiting=waiting,
        other_rows=max(last_rows - own_rows, 0),
        other_drafting=max(last_drafting - drafted, 0),
        arrival_rate=rate,
    )


def row_budget(max_rows: int, fixed: int, asking: int) -> int:
    """Drafted nodes the requests ``asking`` for verification rows share (``grant_rows``'s budget): the rows of
    a target forward (``BatchConfig.max_rows``) less the rows already in it (``fixed``: the other requests'
    roots and nodes) and one root row each of the ``asking`` ones."""
    return max_rows - fixed - asking


def prefill_budget(decoding: int, max_prefill_tokens: int, idle_prefill_tokens: int) -> tuple[int, int]:
    """(prompt tokens a step, at most of one prompt) while ``decoding`` requests decode: the budget follows the
    load (``BatchConfig.idle_prefill_tokens``): ``idle_prefill_tokens`` when none decodes (one prompt may take
    all of it: several ``MAX_ROWWISE_ROWS``-row chunks in the step), else max(``max_prefill_tokens``,
    min(``idle_prefill_tokens``, ``MAX_ROWWISE_ROWS`` // decoding)), at most ``MAX_ROWWISE_ROWS`` of one
    prompt: a stream's step carries at most about one chunk of others' prompts."""
    idle_prefill_tokens = max(idle_prefill_tokens, max_prefill_tokens)
    if decoding <= 0:
        return idle_prefill_tokens, idle_prefill_tokens
    budget = max(max_prefill_tokens, min(idle_prefill_tokens, MAX_ROWWISE_ROWS // decoding))
    return budget, MAX_ROWWISE_ROWS


def plan_prefills(
    left: list[int], budget: int, chunked: bool, per_prompt: int = MAX_ROWWISE_ROWS
) -> list[int]:
    """Prompt tokens each waiting request (in admission order, ``left`` of its prompt still to prefill) gets this
    step, under ``budget`` tokens (module docstring, step 1): chunked, at most ``per_prompt`` of one prompt (a
    take above ``MAX_ROWWISE_ROWS`` runs as several chunks in the step) and nothing for a prompt until the one
    ahead of it is in; else whole prompts while they fit, at least one. Only the requests that get tokens are
    listed (a prefix of ``left``)."""
    takes: list[int] = []
    for n in left:
        if chunked:
            take = min(n, budget, per_prompt)
        else:
            take = n if not takes or n <= budget else 0
        if take <= 0:
            break
        takes.append(take)
        budget -= take
        if take < n:
            break
    return takes


def grant_rows(wants: list[int], budget: int) -> list[int]:
    """Nodes granted to requests asking ``wants`` when ``budget`` nodes fit (the row cap, module docstring):
    all they ask if it fits, else min(asked, L) for the largest fitting L, and what remains one node each to
    those asking more than L, in order."""
    budget = max(budget, 0)
    if sum(wants) <= budget:
        return list(wants)
    low, high = 0, max(wants)
    while low < high:  # the largest level L with sum(min(w, L)) <= budget
        mid = (low + high + 1) // 2
        if sum(min(w, mid) for w in wants) <= budget:
            low = mid
        else:
            high = mid - 1
    granted = [min(w, low) for w in wants]
    left = budget - sum(granted)
    for i, w in enumerate(wants):
        if left and w > low:
            granted[i] += 1
            left -= 1
    return granted
