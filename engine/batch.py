"""Continuous batching: many requests decoded together, each exactly as ``SpeculativeEngine.generate`` would
decode it alone.

``BatchedEngine`` keeps a slot per admitted request: its own KV caches (target and draft, growing buffers:
``engine.backends.kvcache``), its controller, its context-lookup index, its sampler (a ``torch.Generator`` seeded by the
request, its own ``SamplingConfig``) and stop tokens. ``step()`` runs one cycle of every request in flight:

1. requests added since the last step are prefilled in chunks: in admission order, up to
   ``BatchConfig.max_prefill_tokens`` prompt tokens a step (at most ``MAX_ROWWISE_ROWS`` of one prompt), each
   chunk rows of the step's target forward (step 4) next to the running requests' rows; the chunk that ends
   a prompt gives its first token. The native decoder computes every row alone, so a prompt's cache and first
   token are bitwise what ``generate``'s prefill gives, whatever the chunk boundaries and batch mates
   (``engine.forward.chunked_prefill``). Where it does not apply (the torch path) a prompt is prefilled whole,
   in the step's forwards, at least one prompt a step;
2. every request starts its cycle: the very cycle code ``generate`` runs (``SpeculativeEngine.cycle``, a
   generator of the forwards it needs): lookup, depth-0 decision, draft steps, verification size;
3. draft steps: while any request waits on a draft forward, one draft forward carries the rows of every
   request waiting on one (its pending tokens, or its frontier at the next depth, or a catch-up chunk);
   requests stop drafting when their controllers say so. A request whose draft is behind by more than
   ``EngineConfig.draft_catch_up_tokens`` (its prompt, which the draft runs lazily, plus the tokens committed
   while it did not draft) catches up that many tokens a step, next to an autoregressive step, before it
   drafts (a catch-up cycle: ``SpeculativeEngine._catch_up_cycle``), so one request's catch-up never
   stalls the step; its draft cache ends as a whole catch-up would leave it;
4. verification rows: each drafting or lookup request asked for a number of nodes; the rows of the target
   forward are capped (``BatchConfig.max_rows``, below), then ONE target forward carries every request's
   root and granted nodes (an autoregressive step: its one row), each with its own tree mask and positions;
5. exact acceptance and commit per request (``verify_tree`` / ``verify_chain``, cache compaction), then
   finished requests leave (their caches are freed) and their results wait for ``result()``.

Row cap. A request's root row always goes; the nodes share what is left, ``max_rows - requests``, by water
filling: every request gets min(asked, L) for the largest L that fits, and what still remains goes one node
each to the requests asking more than L, in admission order (deterministic: a function of what each asked).
A request granted fewer nodes verifies the top ones by score (a connected sub-tree, as any smaller size):
greedy output does not change, only speed; a sampled request keeps its law, though not the same draws as
alone. Draft forwards are split into forwards of at most ``max_rows`` rows (batch invariance makes the split
invisible in the results).

Batch invariance: every forward through ``engine.batch_forward`` gives each request's rows the logits its
forward alone would give them (bitwise on the integer formats; see there for float32), so a greedy request's
tokens are those of ``generate`` of that request alone, whoever else is in the batch.

Fault isolation. Every piece of one request's work (its prefill, each advance of its cycle: controller calls,
sampling, acceptance and commit; its result) runs inside ``_guard``: any exception there ends that request
alone (finish reason "error"; ``result`` raises a ``DraftpilotError``, a ``RequestFailed`` wrapping anything
else, the original as its ``__cause__``). A shared forward that raises is retried request by request (each
item alone, on its cache as it was before the failed forward): the requests whose forward alone fails end with
that error, the others continue with the logits of their forward alone, which batch invariance makes the
logits the batch would have given them. Only when every request of a shared forward of several also fails
alone does ``step`` raise ``EngineFailed`` (the engine, not a request, is broken: build a new one).

Memory. Each request reserves, at ``add``, the KV memory it can reach: its target cache (and its draft cache,
when it drafts) hold at most ``kv_entries`` positions (prompt + ``max_new_tokens``, capped by the context, plus
the drafted rows a verification may append beyond them), each position ``kv_bytes_per_entry`` bytes (layers x
kv heads x head dim x 2 x element size). The caches are made with exactly that capacity (allocated at their
first append, never doubled past it: ``engine.backends.kvcache.CacheFull``), so the bytes the slots hold never
exceed ``kv_reserved``. With ``BatchConfig.max_kv_bytes`` set, a request whose reservation does not fit next to
the others is refused with ``MemoryFull`` (a ``CapacityError``: retry when one finishes), one that exceeds the
whole budget with ``InputError``.

One thread drives it (a server's loop): ``add``, ``cancel``, ``step`` and ``result`` between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.backends.kvcache import cache_bytes, kv_bytes_per_entry, new_cache
from engine.backends.pair import ModelPair
from engine.batch_api import (
    BatchConfig,
    BatchRequest,
    CapacityError,
    EngineFailed,
    MemoryFull,
    RequestFailed,
    StepEvent,
    format_bytes,
    one_line,
)
from engine.batch_forward import Rows, forward_rows
from engine.control import Controller
from engine.cycle import cycle_cap, tree_cap
from engine.engine import SpeculativeEngine
from engine.errors import DraftpilotError, InputError, is_int, short_repr
from engine.forward import Forward, Steps, VerifyRows, chunked_prefill
from engine.load import LoadState, LoadTracker
from engine.lookup import NgramIndex
from engine.prefill import RequestState
from engine.prefix_cache import Match, PrefixCache, common_prefix
from engine.results import CycleRecord, GenerationResult
from engine.sampling import SamplingConfig
from engine.scheduling import StepPlan, grant_rows, plan_prefills, prefill_budget, row_budget, step_load


@dataclass
class _Slot:
    rid: int
    prompt_ids: list[int]
    max_new_tokens: int
    controller: Controller | None
    seed: int
    sampling: SamplingConfig
    stop_ids: frozenset[int]
    tree_depth: int
    """Its cycles' depth cap by the tree-node cap (``engine.cycle.tree_cap``)."""
    entries: tuple[int, int] = (0, 0)
    """(target, draft) KV positions reserved (draft 0: the request never drafts)."""
    kv_bytes: int = 0
    """Bytes of the reservation (``entries`` at each model's bytes per position)."""
    req: RequestState | None = None
    index: NgramIndex | None = None
    prefill_s: float = 0.0
    """Seconds from its prefill's first chunk to its first token."""
    cache: object = None
    """The target cache while the prompt is prefilled (then ``req.target_cache``)."""
    filled: int = 0
    """Prompt tokens in ``cache`` so far."""
    prefill_t0: float = 0.0
    steps: object = None
    """The cycle in progress (a generator of ``Forward`` / ``VerifyRows``), None between cycles."""
    waiting: Forward | VerifyRows | None = None
    record: CycleRecord | None = None
    target_rows: int = 0
    """Rows this request put in the target forwards of the last step (the others' load next step)."""
    drafted: bool = False
    """Whether it ran the draft in the last step."""
    cached: int = 0
    """Prompt tokens its target cache took from the prefix cache."""
    hold: Match | None = None
    """What it matched in the prefix cache at admission, pinned until its prefill starts."""


class BatchedEngine:
    """Continuous batching over a ``ModelPair`` (see the module docstring)."""

    def __init__(self, pair: ModelPair, config: BatchConfig | None = None):
        self.pair = pair
        self.config = config or BatchConfig()
        if not isinstance(self.config, BatchConfig):
            raise InputError(f"config must be a BatchConfig, got {short_repr(config)}")
        self.engine = SpeculativeEngine(pair, config=self.config.engine)
        self.engine.stepwise = True  # draft steps yield their forwards, to be batched
        self.device = pair.device
        self._slots: dict[int, _Slot] = {}  # admission order
        self._done: dict[int, GenerationResult | BaseException] = {}
        self._next_rid = 0
        self.waiting_outside = 0
        """Requests waiting outside the batch (a server's waiting line, set by its owner): counted in every
        request's ``LoadState.waiting``."""
        self._arrivals = LoadTracker()
        self._last_rows = 0  # target rows of the last step, all requests
        self._last_drafting = 0  # requests that ran the draft in the last step
        self._entry_bytes = (kv_bytes_per_entry(pair.target), kv_bytes_per_entry(pair.draft))
        self.kv_reserved = 0
        """Bytes of KV cache the admitted requests have reserved (module docstring, "Memory")."""
        self._chunked = chunked_prefill(pair.target, new_cache(pair.target, 1))
        """Whether prompts are prefilled in chunks (module docstring, step 1; ``chunked``)."""
        self.last_step: StepPlan | None = None
        """What the last ``step`` ran (its prefill chunks and cycles; ``engine.scheduling.StepPlan``), None
        before the first."""
        self.prefix: PrefixCache | None = None
        """The prefix cache (``BatchConfig.prefix_cache_bytes``; module docstring, "Prefix cache"), or None."""
        if self.config.prefix_cache_bytes:
            self.prefix = PrefixCache(self._entry_bytes, self.config.prefix_cache_bytes)

    # ----------------------------------------------------------------------------------------------- API
    def add(self, request: BatchRequest) -> int:
        """Admit ``request``; returns its id. Bad input raises ``InputError`` (``ControllerError``; so does a
        request whose KV reservation exceeds ``max_kv_bytes`` on its own), a full batch ``CapacityError``
        (``MemoryFull``: its reservation does not fit next to the others' now); either way nothing runs and
        no other request is touched. It is prefilled at the next ``step``."""
        if not isinstance(request, BatchRequest):
            raise InputError(f"request must be an engine.batch.BatchRequest, got {short_repr(request)}")
        if not isinstance(request.sampling, SamplingConfig):
            raise InputError(f"sampling must be an engine.SamplingConfig, got {short_repr(request.sampling)}")
        prompt_ids, max_new = self.engine.check_request(
            request.prompt, request.max_new_tokens, request.controller, request.seed, request.sampling
        )
        if not isinstance(request.ignore_eos, bool):
            raise InputError(f"ignore_eos must be True or False, got {short_repr(request.ignore_eos)}")
        stop = request.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
            raise InputError(f"stop_token_ids must be a collection of token ids, got {short_repr(stop)}")
        stop = list(stop)
        if any(not is_int(t) or not 0 <= t < self.pair.vocab_size for t in stop):
            raise InputError(
                f"stop_token_ids must be integers in [0, {self.pair.vocab_size}), got {short_repr(stop)}"
            )
        controller = request.controller
        if controller is not None and any(s.controller is controller for s in self._slots.values()):
            raise InputError(
                "this controller instance already serves a request in the batch: give each its own"
            )
        width = None if controller is None else controller.tree_width
        tree_depth = tree_cap(width, self.config.engine.max_tree_nodes)
        entries = self.kv_entries(len(prompt_ids), max_new, controller, tree_depth)
        need = entries[0] * self._entry_bytes[0] + entries[1] * self._entry_bytes[1]
        budget = self.config.max_kv_bytes
        if budget is not None and need > budget:
            raise InputError(
                f"the request needs {format_bytes(need)} of KV cache ({len(prompt_ids)} prompt tokens + "
                f"{max_new} to generate: {entries[0]} target and {entries[1]} draft positions), more than the "
                f"whole budget of {format_bytes(budget)} (BatchConfig.max_kv_bytes): ask for fewer tokens"
            )
        if len(self._slots) >= self.config.max_requests:
            raise CapacityError(
                f"the batch is full ({self.config.max_requests} requests, BatchConfig.max_requests): retry when "
                "one finishes"
            )
        hold = None
        if self.prefix is not None:  # what it can take from the prefix cache stays there until it does
            hold = self.prefix.target.match(prompt_ids, len(prompt_ids) - 1)
            self.prefix.target.pin(hold)
        if budget is not None and self.kv_reserved + need + self.prefix_bytes > budget:
            if self.prefix is not None:  # the cache gives way to the requests
                self.prefix.evict(self.kv_reserved + need + self.prefix.bytes - budget)
            if self.kv_reserved + need + self.prefix_bytes > budget:
                if hold is not None:
                    self.prefix.target.unpin(hold)
                raise MemoryFull(
                    f"the request needs {format_bytes(need)} of KV cache and "
                    f"{format_bytes(budget - self.kv_reserved - self.prefix_bytes)} of the {format_bytes(budget)} "
                    "budget is free (BatchConfig.max_kv_bytes): retry when one finishes"
                )
        rid = self._next_rid
        self._next_rid += 1
        self._slots[rid] = _Slot(
            rid,
            prompt_ids,
            max_new,
            controller,
            int(request.seed),
            request.sampling,
            (frozenset() if request.ignore_eos else self.pair.eos_token_ids)
            | frozenset(int(t) for t in stop),
            tree_depth,
            entries,
            need,
            hold=hold,
        )
        self.kv_reserved += need
        self._arrivals.arrived(time.monotonic())
        return rid

    def kv_entries(
        self, prompt_len: int, max_new_tokens: int, controller: Controller | None, tree_depth: int
    ) -> tuple[int, int]:
        """(target, draft) cache positions a request can reach: its caches hold at most the committed tokens
        but the last (prompt + ``max_new_tokens``, capped by the context, minus one), plus, in a cycle's
        forwards, the rows beyond the committed ones a cycle may append (its depth cap ``cap``: ``engine.cycle.
        cycle_cap`` of ``max_depth`` and ``tree_depth``, the request's ``engine.cycle.tree_cap``; a tree's
        verified nodes can outnumber its depth by ``max_verify - 1``; a width-W tree's draft steps append W
        rows a level, ``(cap - 1)(W - 1)`` more than a chain). Draft 0: the request never drafts."""
        last = min(prompt_len + max_new_tokens, self.pair.max_context) - 1
        if controller is None:
            return last, 0
        width, cfg = controller.tree_width, self.config.engine
        # the deepest a cycle goes: its draft budget is at most max_depth
        cap = cycle_cap(cfg.max_depth, tree_depth)
        wide = width > 1 and cap >= 1
        target = last + (min(cfg.max_verify, cfg.max_tree_nodes) - 1 if wide else 0)
        draft = last + (max(cap - 1, 0) * (width - 1) if wide else 0)
        return target, draft

    @property
    def prefix_bytes(self) -> int:
        """Bytes the prefix cache holds (0 without one): within ``max_kv_bytes`` next to ``kv_reserved``."""
        return 0 if self.prefix is None else self.prefix.bytes

    def kv_allocated(self) -> int:
        """Bytes the slots' KV buffers hold now (at most ``kv_reserved``: a draft cache is allocated at the
        request's first drafting cycle)."""
        total = 0
        for slot in self._slots.values():
            if slot.req is not None:
                total += cache_bytes(slot.req.target_cache) + cache_bytes(slot.req.draft_cache)
            elif slot.cache is not None:
                total += cache_bytes(slot.cache)
        return total

    def cancel(self, rid: int) -> None:
        """Drop request ``rid`` (running, waiting for its prefill, or finished and not yet collected): its
        slot and caches are freed at once."""
        slot = self._slots.get(rid)
        if slot is not None:
            try:
                self._keep_prefix(slot)
            except Exception:  # noqa: BLE001 - the cache only loses this entry; the cancel goes on
                self.prefix.stats.insert_failures += 1
        if self._release(rid) is None and self._done.pop(rid, None) is None:
            raise InputError(f"no request {short_repr(rid)} in the batch")

    @property
    def chunked(self) -> bool:
        """Whether prompts are prefilled in chunks (module docstring, step 1; else whole)."""
        return self._chunked

    @property
    def requests(self) -> list[int]:
        """Ids of every request in the batch (admitted, not finished, failed or cancelled), in admission
        order: ``pending`` and ``active`` together."""
        return list(self._slots)

    def state_of(self, rid: int) -> RequestState | None:
        """Request ``rid``'s decoding state once prefilled (its tokens and caches: to read, not to change),
        None while it waits for its prefill or when it is not in the batch."""
        slot = self._slots.get(rid)
        return None if slot is None else slot.req

    @property
    def active(self) -> list[int]:
        """Ids of the requests decoding (prefilled, not finished), in admission order."""
        return [rid for rid, s in self._slots.items() if s.req is not None]

    @property
    def pending(self) -> list[int]:
        """Ids of the requests added and not yet prefilled, or prefilled in part (``max_prefill_tokens``)."""
        return [rid for rid, s in self._slots.items() if s.req is None]

    def result(self, rid: int) -> GenerationResult:
        """The result of a finished request (what ``generate`` returns), handed over once; a request that
        failed raises its error here."""
        if rid in self._slots:
            raise InputError(f"request {rid} has not finished")
        if rid not in self._done:
            raise InputError(
                f"no finished request {short_repr(rid)} (unknown, cancelled or already collected)"
            )
        out = self._done.pop(rid)
        if isinstance(out, BaseException):
            raise out
        return out

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """Prefill chunks of the waiting prompts (up to ``max_prefill_tokens`` tokens) and one cycle of every
        request in flight, in shared forwards; one event a request that decoded or got its first token."""
        new_tokens: dict[int, int] = {}  # rid -> committed tokens before this step
        plan = self.last_step = StepPlan()
        prefilling = self._schedule_prefills(plan)
        running = [s for s in self._slots.values() if s.req is not None and self._finish(s) is None]
        waiting = sum(s.req is None for s in self._slots.values()) + max(int(self.waiting_outside), 0)
        rate = self._arrivals.rate(time.monotonic())
        for slot in running:
            new_tokens.setdefault(slot.rid, len(slot.req.tokens))
            slot.record = None
            slot.req.load = step_load(
                len(running),
                waiting,
                self._last_rows,
                slot.target_rows,
                self._last_drafting,
                slot.drafted,
                rate,
            )
            slot.target_rows, slot.drafted = 0, False
            slot.steps = self.engine.cycle(
                slot.req,
                slot.controller,
                slot.index,
                len(slot.prompt_ids),
                slot.max_new_tokens,
                slot.tree_depth,
            )
            self._advance(slot, None)
        self._run_cycles()
        plan.cycles = [(s.rid, s.record) for s in running if s.record is not None]
        self._last_rows = sum(s.target_rows for s in running)
        self._last_drafting = sum(s.drafted for s in running)
        for slot in prefilling:  # a prompt whose last chunk ran: its first token is this step's
            if slot.rid not in self._slots or slot.req is not None:
                new_tokens[slot.rid] = len(slot.prompt_ids)
        return [self._event(rid, start) for rid, start in new_tokens.items()]

    def load_of(self, rid: int) -> LoadState | None:
        """The load request ``rid``'s last cycle ran under (``DraftState.load``; None before its first)."""
        slot = self._slots.get(rid)
        return None if slot is None or slot.req is None else slot.req.load

    # ------------------------------------------------------------------------------------------ internals
    def prefill_budget(self, decoding: int) -> tuple[int, int]:
        """(prompt tokens this step, at most of one prompt) while ``decoding`` requests decode: the budget
        follows the load (``BatchConfig.idle_prefill_tokens``; module docstring, step 1)."""
        return prefill_budget(decoding, self.config.max_prefill_tokens, self.config.idle_prefill_tokens)

    def _schedule_prefills(self, plan: StepPlan) -> list[_Slot]:
        """Start this step's prefill chunks (module docstring, step 1), listed in ``plan``; the slots that got
        one."""
        waiting = [slot for slot in self._slots.values() if slot.req is None]
        hits = [self._hit(slot) for slot in waiting]
        decoding = len(self._slots) - len(waiting)
        budget, per_prompt = self.prefill_budget(decoding)
        takes = plan_prefills(
            [len(slot.prompt_ids) - slot.filled - hit for slot, hit in zip(waiting, hits)],
            budget,
            self._chunked,
            per_prompt,
        )
        if self.prefix is not None:  # a prompt whose prefix an earlier one of this step is computing waits
            for i in range(1, len(takes)):
                if waiting[i].cache is None and any(
                    common_prefix(
                        waiting[i].prompt_ids, waiting[j].prompt_ids, len(waiting[i].prompt_ids) - 1
                    )
                    > hits[i]
                    for j in range(i)
                ):
                    takes = takes[:i]
                    break
        for slot, take in zip(waiting, takes):
            if slot.cache is None and not self._guard(slot, self._start_prefill, slot):
                continue
            plan.prefill.append((slot.rid, take, slot.filled))
            slot.steps = self._prefill_chunk(slot, take)
            self._advance(slot, None)
        return waiting[: len(takes)]

    def _hit(self, slot: _Slot) -> int:
        """Prompt tokens a slot whose prefill has not started would take from the prefix cache now."""
        if self.prefix is None or slot.cache is not None:
            return 0
        return self.prefix.target.match(slot.prompt_ids, len(slot.prompt_ids) - 1).length

    def _start_prefill(self, slot: _Slot) -> None:
        """Make ``slot``'s target cache, with what the prefix cache holds of its prompt (never its last
        token, whose logits give the first token)."""
        engine = self.engine
        slot.prefill_t0 = engine.clock()
        slot.cache = new_cache(self.pair.target, slot.entries[0])
        prefix = self.prefix
        if prefix is None:
            return
        match = prefix.target.match(slot.prompt_ids, len(slot.prompt_ids) - 1)
        prefix.target.load(match, slot.cache)
        slot.filled = slot.cached = match.length
        if slot.hold is not None:
            prefix.target.unpin(slot.hold)
            slot.hold = None
        prefix.stats.queries += 1
        prefix.stats.query_tokens += len(slot.prompt_ids)
        prefix.stats.hit_tokens += match.length

    def _prefill_chunk(self, slot: _Slot, count: int) -> Steps:
        """The next ``count`` prompt tokens of ``slot`` as rows of the step's target forward; after the last
        chunk, its first token (``_prefilled``)."""
        start = slot.filled
        if slot.cache is None:
            self._start_prefill(slot)
        logits = yield Forward(
            self.pair.target, slot.prompt_ids[start : start + count], start, slot.cache, keep=1
        )
        slot.filled += count
        if slot.filled == len(slot.prompt_ids):
            self._prefilled(slot, logits)

    def _prefilled(self, slot: _Slot, logits: torch.Tensor) -> None:
        """``slot``'s prompt is in its cache: its request, first token drawn from ``logits``."""
        engine = self.engine
        generator = torch.Generator(device=self.device).manual_seed(slot.seed)
        slot.req = engine.prefilled_request(
            slot.prompt_ids,
            logits,
            slot.cache,
            generator,
            slot.controller is not None,
            slot.sampling,
            slot.stop_ids,
            slot.entries[1],
        )
        slot.cache = None
        prefix = self.prefix
        if prefix is not None:  # the prompt for later requests; the draft's part of it from earlier ones
            prefix.insert(prefix.target, slot.prompt_ids, slot.req.target_cache, self._prefix_room())
            if slot.req.draft_cache is not None:
                match = prefix.draft.match(slot.prompt_ids, len(slot.prompt_ids) - 1)
                prefix.draft.load(match, slot.req.draft_cache)
                slot.req.draft_len = match.length
                prefix.stats.draft_hit_tokens += match.length
        slot.prefill_s = engine.clock() - slot.prefill_t0
        if slot.controller is not None:
            slot.controller.reset()
        lookup = self.config.engine.lookup
        slot.index = NgramIndex(lookup) if lookup is not None else None

    def _guard(self, slot: _Slot, fn: Callable[..., object], *args: object) -> bool:
        """Run one request's own work; any error there (a controller's bad answer or bug, non-finite logits,
        an allocation failure) ends that request alone. True when it ran through."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - the request's own failure, whatever it is, is its alone
            self._fail(slot, err)
            return False
        return True

    def _fail(self, slot: _Slot, err: Exception) -> None:
        """End ``slot`` on ``err``: its slot, caches and reservation are freed, ``result`` raises the error (a
        ``RequestFailed`` with a one-line reason when it is not a ``DraftpilotError``)."""
        if not isinstance(err, DraftpilotError):
            wrapped = RequestFailed(f"the request failed: {one_line(err)}")
            wrapped.__cause__ = err
            err = wrapped
        self._release(slot.rid)
        slot.steps = slot.waiting = None
        self._done[slot.rid] = err

    def _release(self, rid: int) -> _Slot | None:
        """Remove request ``rid``'s slot (its caches go with it) and its KV reservation; the slot or None."""
        slot = self._slots.pop(rid, None)
        if slot is not None:
            self.kv_reserved -= slot.kv_bytes
            if slot.hold is not None:
                self.prefix.target.unpin(slot.hold)
                slot.hold = None
        return slot

    def _prefix_room(self, leaving: _Slot | None = None) -> int | None:
        """Bytes the prefix cache may hold now (the budget less the reservations, ``leaving``'s not counted);
        None: no budget (the cache's own size only)."""
        budget = self.config.max_kv_bytes
        if budget is None:
            return None
        return budget - self.kv_reserved + (leaving.kv_bytes if leaving is not None else 0)

    def _keep_prefix(self, slot: _Slot) -> None:
        """Put what ``slot`` computed into the prefix cache as it leaves (finished or cancelled): its committed
        tokens but the last (the target's cache; the draft's first ``draft_len``), or the part of its prompt
        prefilled so far. Drafted, rejected positions are not in those caches any more."""
        prefix = self.prefix
        if prefix is None:
            return
        room = self._prefix_room(slot)
        req = slot.req
        if req is None:
            if slot.cache is not None and slot.filled > slot.cached:
                prefix.insert(prefix.target, slot.prompt_ids[: slot.filled], slot.cache, room)
            return
        held = req.target_cache.get_seq_length()
        if held == len(req.tokens) - 1:
            prefix.insert(prefix.target, req.tokens[:held], req.target_cache, room)
        draft = req.draft_cache
        if draft is not None and req.draft_len and draft.get_seq_length() == req.draft_len:
            prefix.insert(prefix.draft, req.tokens[: req.draft_len], draft, room)

    def _advance(self, slot: _Slot, answer: object) -> None:
        def send():
            try:
                slot.waiting = next(slot.steps) if answer is None else slot.steps.send(answer)
            except StopIteration as stop:
                slot.record, slot.steps, slot.waiting = stop.value, None, None

        self._guard(slot, send)

    def _run_cycles(self) -> None:
        """Phases 3-5 of the module docstring, until every cycle has ended."""
        draft, target = self.pair.draft, self.pair.target
        while True:
            waiting = [s for s in self._slots.values() if s.waiting is not None]
            if not waiting:
                return
            drafting = [s for s in waiting if isinstance(s.waiting, Forward) and s.waiting.model is draft]
            if drafting:
                self._forward(draft, drafting)
                continue
            asking = [s for s in waiting if isinstance(s.waiting, VerifyRows)]
            if asking:  # the row cap is the decoding rows' (prefill chunks have their own budget)
                fixed = sum(s.waiting.rows for s in waiting if isinstance(s.waiting, Forward) and s.req)
                budget = row_budget(self.config.max_rows, fixed, len(asking))
                for slot, granted in zip(asking, grant_rows([s.waiting.want for s in asking], budget)):
                    self._advance(slot, granted)
                continue
            self._forward(target, [s for s in waiting if s.waiting.model is target])

    def _forward(self, model: torch.nn.Module, slots: list[_Slot]) -> None:
        """Run the forwards ``slots`` wait on, in forwards of at most ``max_rows`` rows, and hand each its
        logits."""
        chunk: list[_Slot] = []
        rows = 0
        for slot in slots + [None]:
            if slot is not None and slot.req is None:  # a prefill chunk: outside the row cap
                chunk.append(slot)
                continue
            if chunk and (slot is None or rows + slot.waiting.rows > self.config.max_rows):
                for s in chunk:  # the load the others see next step
                    if model is self.pair.target:
                        s.target_rows += s.waiting.rows
                    else:
                        s.drafted = True
                self._shared_forward(model, chunk)
                chunk, rows = [], 0
            if slot is not None:
                chunk.append(slot)
                rows += slot.waiting.rows

    def _shared_forward(self, model: torch.nn.Module, chunk: list[_Slot]) -> None:
        """One forward of every request of ``chunk``; on an error, each request's forward alone (module
        docstring, "Fault isolation")."""
        items = []
        for s in chunk:
            call = s.waiting
            positions = call.positions or range(call.start, call.start + len(call.ids))
            items.append(Rows(call.ids, positions, call.cache, call.mask, call.keep))
        if len(chunk) == 1:  # the request's own forward: its failure is its own
            out: list[torch.Tensor] = []
            if self._guard(chunk[0], self._forward_into, model, items, out):
                self._advance(chunk[0], out[0])
            return
        saved = [_snapshot(it.cache) for it in items]
        try:
            logits = forward_rows(model, items, self.device)
        except Exception as err:  # noqa: BLE001 - attributed below, request by request
            logits = self._retry_alone(model, chunk, items, saved, err)
        for s, row in zip(chunk, logits):
            if row is not None:
                self._advance(s, row)

    def _forward_into(self, model: torch.nn.Module, items: list[Rows], out: list[torch.Tensor]) -> None:
        out.extend(forward_rows(model, items, self.device))

    def _retry_alone(
        self, model: torch.nn.Module, chunk: list[_Slot], items: list[Rows], saved: list, err: Exception
    ) -> list[torch.Tensor | None]:
        """After the shared forward of ``chunk`` raised ``err``: every cache back to its state before it, then
        each request's forward alone; a request whose forward alone fails ends with its error (None in the
        list), the others get the logits of their forward alone. Raises ``EngineFailed`` when all fail."""
        for item, state in zip(items, saved):
            _restore(item.cache, state)
        out: list[torch.Tensor | None] = []
        for slot, item in zip(chunk, items):
            got: list[torch.Tensor] = []
            ok = self._guard(slot, self._forward_into, model, [item], got)
            out.append(got[0] if ok else None)
        if all(row is None for row in out):
            raise EngineFailed(
                f"a forward shared by {len(chunk)} requests failed ({one_line(err)}), and so did each "
                "request's forward alone"
            ) from err
        return out

    def _finish(self, slot: _Slot) -> str | None:
        return self.engine.finish_reason(slot.req, len(slot.prompt_ids), slot.max_new_tokens)

    def _event(self, rid: int, start: int) -> StepEvent:
        slot = self._slots.get(rid)
        if slot is None:  # failed this step
            return StepEvent(rid, (), True, "error", None)
        finish = self._finish(slot)
        if finish is not None and not self._guard(slot, self._finish_slot, slot, finish):
            return StepEvent(rid, (), True, "error", None)
        tokens = tuple(slot.req.tokens[start:])
        return StepEvent(rid, tokens, finish is not None, finish, slot.record, slot.cached)

    def _finish_slot(self, slot: _Slot, finish: str) -> None:
        """Build the result of a finished request, then free its slot (its caches go with it)."""
        result = self.engine.request_result(slot.req, len(slot.prompt_ids), finish, slot.prefill_s)
        result.cached_tokens = slot.cached
        self._keep_prefix(slot)
        self._release(slot.rid)
        self._done[slot.rid] = result


def _snapshot(cache: object) -> list[tuple[object, dict]] | None:
    """The state of each layer of a cache (its attributes: the key/value views, buffers, flags), for
    ``_restore`` after a failed forward; a forward only writes past the views, so the views stay valid."""
    if cache is None:
        return None
    return [(layer, dict(vars(layer))) for layer in cache.layers]


def _restore(cache: object, state: list[tuple[object, dict]] | None) -> None:
    if cache is None or state is None:
        return
    cache.layers = [layer for layer, _ in state]
    for layer, attrs in state:
        vars(layer).clear()
        vars(layer).update(attrs)
