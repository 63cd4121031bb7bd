"""The speculative decoding loop: prefill, then cycles of draft -> verify -> commit.

Invariant between cycles (``_Request``): ``tokens`` are the committed ids (prompt + generated); the
target cache holds ``tokens[:-1]`` (the last token is the *pending* input of the next target forward);
the draft cache holds ``tokens[:draft_len]`` and ``tokens[draft_len:]`` are the draft's pending inputs. The
draft's prefill is lazy: it runs at the first drafting cycle, so a request decoded without drafting never
pays for it. Under load (``engine.batch``: a step of several requests) a draft that is behind by more than
``EngineConfig.draft_catch_up_tokens`` catches up in chunks of that many tokens, one a cycle, each next to an
autoregressive step (``SpeculativeEngine._catch_up_cycle``), so that no step carries one request's whole
catch-up; alone it catches up at once, in the drafting cycle.

A cycle is a generator (``_cycle`` and the phases it delegates to): it yields every model forward it needs
(a ``Forward``) and the number of drafted rows it wants verified (a ``VerifyRows``), and receives the logits
and the rows granted. ``generate`` drives one request's cycles at once (``_run``: each forward runs when asked,
every row granted); ``engine.batch.BatchedEngine`` drives many requests' cycles in step and runs their
forwards together. The cycle code is the same for both.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.backends import lean
from engine.backends.attention import MAX_ROWWISE_ROWS, MAX_VERIFY_NODES
from engine.backends.kvcache import GrowingLayer, cache_len, keep_entries, new_cache
from engine.backends.pair import ModelPair
from engine.control import Controller, ControllerError, DraftState, decision, verify_size
from engine.errors import InputError, is_int, short_repr
from engine.load import LoadState
from engine.lookup import LookupConfig, NgramIndex
from engine.results import CycleRecord, GenerationResult
from engine.sampling import (
    SamplingConfig,
    check_finite,
    logits_to_probs,
    make_target_drawer,
    score_logprobs,
    verify_chain,
    verify_tree,
)
from engine.tree import (
    MAX_TREE_NODES,
    DraftTree,
    ancestor_matrix,
    clamp_verify,
    depth_limit,
    expand_topk,
    tree_attention_mask,
)

if TYPE_CHECKING:
    from transformers import DynamicCache

MAX_SEED = 2**64 - 1
DRAFT_CATCH_UP_TOKENS = 16
"""The default of ``EngineConfig.draft_catch_up_tokens`` (``BatchConfig.max_prefill_tokens``'s default too)."""
Steps = Generator["Forward | VerifyRows", Any, Any]
"""A cycle (or one of its phases) as a generator: it yields the forwards and verification rows it needs
and returns its result (``SpeculativeEngine._run`` drives one alone, ``engine.batch`` several at once)."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings (the controller decides depth and size per cycle)."""

    draft_mode: str = "deterministic"
    """"deterministic": drafts are top-k expansions / argmax chains (exactly replayable);
    "sampled": chain drafts sampled from the draft distribution (Leviathan rule; tree_width must be 1)."""
    max_depth: int = 32
    """Hard cap on draft depth per cycle, whatever the controller says."""
    max_verify: int = MAX_VERIFY_NODES
    """Hard cap on drafted nodes verified in one target forward, whatever the controller asks (1 to 64: the
    root plus these nodes stay within row-wise attention, ``engine.backends.attention.MAX_ROWWISE_ROWS``)."""
    max_tree_nodes: int = MAX_TREE_NODES
    """Hard cap on the nodes of one cycle's draft tree. A width-W tree has ``W + (d - 1) W^2`` nodes at depth d
    (``engine.tree.tree_size``), so the cap is a depth cap, ``engine.tree.depth_limit(W, max_tree_nodes)``,
    folded into the cycle's depth cap (controllers see it in ``DraftState.max_depth``; replay applies the
    same one). A ``tree_width`` above it is refused."""
    check_finite: bool = True
    """Stop with an error on NaN/inf logits."""
    validate_caches: bool = False
    """Debug: after every cycle, check both KV caches against a fresh forward of the committed tokens
    (slow; tests use it to prove the cache invariant)."""
    lookup: LookupConfig | None = None
    """Context lookup drafting (``engine.lookup``): a cycle whose context's last n-gram occurred earlier
    verifies the tokens that followed it, without running the draft or asking the controller; None: off."""
    draft_catch_up_tokens: int = DRAFT_CATCH_UP_TOKENS
    """Under load (the request's step holds other requests' work, decoding or prefilling: ``shares_its_step``), the most tokens the
    draft catches up on in one cycle: a cycle whose controller wants to draft while the draft is behind by
    more (the prompt it has not run plus its pending tokens: after depth-0 or lookup cycles, or at its first
    drafting cycle after a long prompt) runs the next this-many of them on the draft next to an
    autoregressive step (a *catch-up cycle*, ``CycleRecord.catch_up``), and drafts once the rest fits, so no
    step carries more than this many draft rows of one request's catch-up. Alone the whole catch-up runs
    in the drafting cycle, as it always did. The draft's cache ends the same either way (bitwise on the
    native decoder, which computes every row alone), so outputs do not change, only when the cost is paid."""

    def __post_init__(self) -> None:
        if self.lookup is not None and not isinstance(self.lookup, LookupConfig):
            raise InputError(f"lookup must be an engine.lookup.LookupConfig or None, got {self.lookup!r}")
        if self.draft_mode not in ("deterministic", "sampled"):
            raise InputError(f"draft_mode must be 'deterministic' or 'sampled', got {self.draft_mode!r}")
        for name, low, high in (
            ("max_depth", 1, None),
            ("max_verify", 1, MAX_VERIFY_NODES),
            ("max_tree_nodes", 1, None),
            ("draft_catch_up_tokens", 1, None),
        ):
            value = getattr(self, name)
            if not is_int(value) or value < low or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise InputError(f"{name} must be an integer {bound}, got {value!r}")


class Clock:
    """Wall clock that waits for the device first, so GPU work is charged to the phase that queued it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@dataclass
class Forward:
    """A model forward a cycle asks for: the arguments of ``SpeculativeEngine._forward``; answered with the
    logits [Q or keep, V]."""

    model: torch.nn.Module
    ids: Sequence[int]
    start: int
    cache: object
    keep: int = 0
    mask: torch.Tensor | None = None
    positions: Sequence[int] | None = None

    @property
    def rows(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class VerifyRows:
    """The drafted rows (beyond the root) a cycle wants to verify in its target forward; answered with the
    rows granted (an integer in [0, want]: ``generate`` grants all, a batch may grant fewer under its row cap)."""

    want: int


@dataclass
class _Request:
    tokens: list[int]
    target_cache: object
    draft_cache: object | None
    draft_len: int
    generator: torch.Generator
    sampling: SamplingConfig
    stop_ids: frozenset[int]
    """Token ids that end the request (the pair's EOS ids and the request's stop tokens), committed included."""
    cycles: list[CycleRecord] = field(default_factory=list)
    draft_prompt: list[int] | None = None
    """The prompt, until the draft has run all of it (its prefill waits for the first drafting cycle; under
    load catch-up cycles may run it in chunks first: ``draft_len`` of it so far)."""
    draft_prefill_s: float = 0.0
    """Time the draft's (lazy) prefill took: reported as prefill, not as the cycle's drafting (the prompt
    chunks of catch-up cycles are those cycles' drafting)."""
    load: LoadState | None = None
    """The load of the step the current cycle runs in (``engine.load``; set by the batched engine, None
    alone): what ``DraftState.load`` shows the controller."""


class SpeculativeEngine:
    """Exact speculative decoding over a ``ModelPair`` with a pluggable per-cycle ``Controller``."""

    stepwise = False
    """Whether the draft phase yields its forwards step by step (``engine.batch``); False: through ``_draft``,
    each forward run at once (one request at a time)."""

    def __init__(
        self, pair: ModelPair, sampling: SamplingConfig | None = None, config: EngineConfig | None = None
    ):
        self.pair = pair
        self.sampling = sampling or SamplingConfig()
        self.config = config or EngineConfig()
        self.device = pair.device
        self.clock = Clock(self.device)

    # ----------------------------------------------------------------------------------------------- API
    @torch.inference_mode()
    def generate(
        self,
        prompt: str | list[int] | torch.Tensor,
        max_new_tokens: int = 128,
        controller: Controller | None = None,
        seed: int = 0,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt`` (text is encoded as is, ids are used as is).

        ``prompt``: a string, a list/tuple of integer token ids, or an integer tensor/array of shape [n] (or
        [1, n], a batch of one). ``controller=None`` decodes autoregressively with the target only, through
        the same loop; otherwise it must be an ``engine.Controller``. ``seed``: an integer in [0, 2**64)
        (there is no random default: a request is reproducible from its arguments). Bad arguments raise
        ``InputError`` (``ControllerError`` for the controller) before any model runs.
        """
        prompt_ids, max_new_tokens = self._check_request(prompt, max_new_tokens, controller, seed)
        tree_cap = 0 if controller is None else depth_limit(controller.tree_width, self.config.max_tree_nodes)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        generator = torch.Generator(device=self.device).manual_seed(int(seed))

        t0 = self.clock()
        req = self._prefill(prompt_ids, generator, with_draft=controller is not None)
        prefill_s = self.clock() - t0
        if controller is not None:
            controller.reset()
        lookup = self.config.lookup
        index = NgramIndex(lookup) if lookup is not None else None
        finish = self._finish_reason(req, len(prompt_ids), max_new_tokens)
        while finish is None:
            self._run(self._cycle(req, controller, index, len(prompt_ids), max_new_tokens, tree_cap))
            finish = self._finish_reason(req, len(prompt_ids), max_new_tokens)

        return self._result(req, len(prompt_ids), finish, prefill_s)

    def _result(self, req: _Request, prompt_len: int, finish: str, prefill_s: float) -> GenerationResult:
        generated = req.tokens[prompt_len:]
        return GenerationResult(
            tokens=generated,
            text=self.pair.tokenizer.decode(generated),
            prompt_len=prompt_len,
            finish_reason=finish,
            prefill_s=prefill_s + req.draft_prefill_s,  # the target's and, if it ran, the draft's
            cycles=req.cycles,
            peak_memory_bytes=_peak_memory(self.device),
        )

    def _check_request(
        self,
        prompt: str | Sequence[int] | torch.Tensor | np.ndarray,
        max_new_tokens: object,
        controller: Controller | None,
        seed: object,
        sampling: SamplingConfig | None = None,
    ) -> tuple[list[int], int]:
        """(prompt ids, max_new_tokens) of a request, or an ``InputError`` (``ControllerError``) naming the bad
        argument; nothing runs."""
        prompt_ids = self._prompt_ids(prompt)
        if not is_int(max_new_tokens) or max_new_tokens <= 0:
            raise InputError(f"max_new_tokens must be a positive integer, got {short_repr(max_new_tokens)}")
        if len(prompt_ids) >= self.pair.max_context:
            raise InputError(
                f"prompt has {len(prompt_ids)} tokens; the context limit is {self.pair.max_context}"
            )
        self._check_controller(controller, sampling)
        if not is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise InputError(f"seed must be an integer in [0, 2**64), got {short_repr(seed)}")
        return prompt_ids, int(max_new_tokens)

    # ------------------------------------------------------------------------------------------ phases
    def _run(self, steps: Steps) -> Any:
        """Drive a cycle generator (or one of its phases) to its end, one request alone: every forward runs at
        once through ``_forward``, every verification row asked for is granted. Returns what it returns."""
        try:
            call = next(steps)
            while True:
                if isinstance(call, VerifyRows):
                    answer = call.want
                else:
                    answer = self._forward(
                        call.model,
                        call.ids,
                        call.start,
                        call.cache,
                        keep=call.keep,
                        mask=call.mask,
                        positions=call.positions,
                    )
                call = steps.send(answer)
        except StopIteration as stop:
            return stop.value

    def _cycle(
        self,
        req: _Request,
        controller: Controller | None,
        index: NgramIndex | None,
        prompt_len: int,
        max_new_tokens: int,
        tree_cap: int,
    ) -> Steps:
        """One cycle of ``req`` (a generator: see the module docstring): lookup, an autoregressive step or a
        speculative cycle, as the caps, the lookup and the controller decide; the record is appended to
        ``req.cycles`` (and shown to the controller) and returned."""
        remaining = max_new_tokens - (len(req.tokens) - prompt_len)
        room = self.pair.max_context - len(req.tokens)
        budget = min(self.config.max_depth, remaining - 1, room - 1)  # drafted tokens this cycle may add
        cap = min(budget, tree_cap)
        proposal = []
        looks = index is not None and index.config.runs_at(req.load)  # the load limit (alone: always)
        if looks:
            t0 = self.clock()
            index.sync(req.tokens)
            proposal = index.propose(min(budget, self.config.max_verify))
            lookup_s = self.clock() - t0
        if proposal:  # a lookup cycle: neither the draft nor the controller runs
            record = yield from self._lookup_cycle(req, proposal)
            record.draft_s += lookup_s
        elif controller is None or cap < 1:
            record = yield from self._autoregressive_step(req)
        else:
            go, ask_s = self._wants_draft(req, controller, cap)
            # depth 0: the controller switched speculation off for this cycle
            if go and self._catches_up(req):
                record = yield from self._catch_up_cycle(req)
            elif go:
                record = yield from self._speculative_cycle(req, controller, cap)
            else:
                record = yield from self._autoregressive_step(req)
            record.controller_s += ask_s
            controller.observe(record)
        if looks and not proposal:
            record.overhead_s += lookup_s  # a lookup that found nothing
        req.cycles.append(record)
        if self.config.validate_caches:
            self._validate_caches(req)
        return record

    def _prefill(self, prompt_ids: list[int], generator: torch.Generator, with_draft: bool) -> _Request:
        return self._prefill_request(
            prompt_ids, generator, with_draft, self.sampling, self.pair.eos_token_ids
        )

    def _prefill_request(
        self,
        prompt_ids: list[int],
        generator: torch.Generator,
        with_draft: bool,
        sampling: SamplingConfig,
        stop_ids: frozenset[int],
        capacity: tuple[int, int] | None = None,
    ) -> _Request:
        """The target's prefill (one forward of the prompt) and the first token, drawn with ``sampling``.
        ``capacity``: the (target, draft) cache entries reserved for the request (``engine.backends.kvcache.
        new_cache``; ``engine.batch``), None: caches that grow as needed."""
        target_cap, draft_cap = capacity if capacity is not None else (None, None)
        target_cache = new_cache(self.pair.target, target_cap)
        logits = self._forward(self.pair.target, prompt_ids, 0, target_cache, keep=1)  # [1, V]
        return self._prefilled_request(
            prompt_ids, logits, target_cache, generator, with_draft, sampling, stop_ids, draft_cap
        )

    def _prefilled_request(
        self,
        prompt_ids: list[int],
        logits: torch.Tensor,
        target_cache: object,
        generator: torch.Generator,
        with_draft: bool,
        sampling: SamplingConfig,
        stop_ids: frozenset[int],
        draft_capacity: int | None = None,
    ) -> _Request:
        """The request once its prompt is in ``target_cache``: the first token drawn from ``logits`` (the
        prompt's last row, [1, V]) with ``sampling``; the draft's cache made, empty."""
        if self.config.check_finite:
            check_finite(logits, "target")
        first = make_target_drawer(logits, sampling, generator)(0)
        # the draft's prefill waits for the first drafting cycle (``_draft``): a request a controller
        # decodes autoregressively never pays for it
        draft_cache = new_cache(self.pair.draft, draft_capacity) if with_draft else None
        return _Request(
            prompt_ids + [first],
            target_cache,
            draft_cache,
            0,
            generator,
            sampling,
            frozenset(stop_ids),
            draft_prompt=list(prompt_ids),
        )

    def _prefill_draft(self, req: _Request) -> Steps:
        """The draft's lazy prefill, at the request's first drafting cycle: one forward of exactly the prompt
        (what an eager prefill would run, so the draft's cache, and every tree it drafts, is the same
        whenever it happens), or of the rest of it after catch-up cycles ran its first chunks; the tokens
        committed since stay pending. Timed as prefill, not as drafting."""
        t0 = self.clock()
        start = req.draft_len
        yield Forward(self.pair.draft, req.draft_prompt[start:], start, req.draft_cache, keep=1)
        req.draft_len, req.draft_prompt = len(req.draft_prompt), None
        req.draft_prefill_s += self.clock() - t0

    def _catches_up(self, req: _Request) -> bool:
        """Whether a cycle that wants to draft must first catch the draft up (``EngineConfig.
        draft_catch_up_tokens``): under load, with the draft behind by more than the bound (the prompt it has
        not run and its pending tokens: ``tokens[draft_len:]``, since ``draft_len`` counts the prompt tokens
        it ran). Alone never: the drafting cycle runs the whole catch-up."""
        if not shares_its_step(req.load):
            return False
        return len(req.tokens) - req.draft_len > self.config.draft_catch_up_tokens

    def _catch_up_cycle(self, req: _Request) -> Steps:
        """A catch-up cycle (``EngineConfig.draft_catch_up_tokens``): one draft forward of the next chunk of
        the tokens the draft has not run (the prompt's first, then the pending ones; never the last committed
        token, which the next drafting cycle runs) and an autoregressive step, recorded as one (depth 0) with
        the chunk's time as its drafting and its size as ``catch_up``. The draft's cache then holds
        ``tokens[:draft_len]`` as a whole catch-up would have left it (each row is computed alone on the
        native decoder, so chunk boundaries change nothing)."""
        start = req.draft_len
        chunk = req.tokens[start : start + self.config.draft_catch_up_tokens]
        t0 = self.clock()
        yield Forward(self.pair.draft, chunk, start, req.draft_cache, keep=1)
        draft_s = self.clock() - t0
        req.draft_len = start + len(chunk)
        if req.draft_prompt is not None and req.draft_len >= len(req.draft_prompt):
            req.draft_prompt = None  # the prompt is in the draft's cache: its prefill is done
        record = yield from self._autoregressive_step(req)
        record.draft_s, record.catch_up = draft_s, len(chunk)
        record.forward_s += draft_s
        return record

    def _autoregressive_step(self, req: _Request) -> Steps:
        t0 = self.clock()
        ctx = len(req.tokens)
        logits = yield Forward(self.pair.target, req.tokens[-1:], ctx - 1, req.target_cache)  # [1, V]
        t_fwd = self.clock() - t0
        if self.config.check_finite:
            check_finite(logits, "target")
        req.tokens.append(make_target_drawer(logits, req.sampling, req.generator)(0))
        return CycleRecord(ctx, 0, 0, 0, 0, 1, verify_s=self.clock() - t0, forward_s=t_fwd)

    def _lookup_cycle(self, req: _Request, proposal: list[int]) -> Steps:
        """Verify a context-lookup proposal as a chain (``engine.lookup``): one target forward over the root
        and the proposal, acceptance by ``verify_tree`` (the proposal is deterministic, in either draft mode).
        Recorded with depth 0 (no draft step ran) and ``lookup=True``; the draft falls behind by the
        committed tokens, as after an autoregressive step."""
        clock, ctx = self.clock, len(req.tokens)
        t_asked = clock()
        proposal = proposal[: (yield VerifyRows(len(proposal)))]
        t_start = clock()  # waiting for the rows granted (in a batch) is overhead
        tree, parent = DraftTree(), -1
        for tok in proposal:
            parent = tree.add(tok, parent, 0.0)
        selected = list(range(len(tree)))
        t_built = clock()
        path, next_token, fwd_s = yield from self._verify(req, tree, selected, [], one_hot=True)
        t_verified = clock()
        new_tokens = [tree.tokens[i] for i in path] + [next_token]
        accepted, emitted = self._commit(req, tree, selected, path, new_tokens, draft_ran=False)
        return CycleRecord(
            context_len=ctx,
            depth=0,
            num_drafted=len(tree),
            num_verified=len(selected),
            accepted=accepted,
            emitted=emitted,
            draft_s=t_built - t_start,
            verify_s=t_verified - t_built,
            overhead_s=clock() - t_verified + (t_start - t_asked),
            forward_s=fwd_s,
            lookup=True,
        )

    def _wants_draft(self, req: _Request, controller: Controller, cap: int) -> tuple[bool, float]:
        """Depth 0: (draft this cycle?, seconds the controller took). Always True, without asking, for a
        controller that does not decide depth 0."""
        if not controller.decides_depth_zero:
            return True, 0.0
        t0 = self.clock()
        state = DraftState.before_drafting(
            len(req.tokens), cap, req.cycles, req.sampling.temperature, load=req.load
        )
        answer = controller.should_continue(state)
        go = decision(answer, controller)
        return go, self.clock() - t0

    def _speculative_cycle(self, req: _Request, controller: Controller, cap: int) -> Steps:
        clock, ctx = self.clock, len(req.tokens)
        if req.draft_prompt is not None:  # the request's first drafting cycle: the draft's prefill first
            yield from self._prefill_draft(req)
        t_start = clock()
        if self.stepwise:
            drafted = yield from self._draft_steps(req, controller, cap)
        else:
            drafted = self._draft(req, controller, cap)
        tree, frontier, draft_probs, fwd_s, ctrl_s = drafted
        t_drafted = clock()

        num_verify = verify_size(
            controller.num_to_verify(self._state(tree, frontier, ctx, cap, req)), controller
        )
        num_verify = clamp_verify(num_verify, len(tree), self.config.max_verify)
        t_asked = clock()
        num_verify = yield VerifyRows(num_verify)
        t_granted = clock()
        selected = tree.select(num_verify)
        t_chosen = clock()

        path, next_token, verify_fwd_s = yield from self._verify(req, tree, selected, draft_probs)
        t_verified = clock()

        new_tokens = [tree.tokens[i] for i in path] + [next_token]
        accepted, emitted = self._commit(req, tree, selected, path, new_tokens)
        t_end = clock()
        return CycleRecord(
            context_len=ctx,
            depth=max(tree.depths),
            num_drafted=len(tree),
            num_verified=len(selected),
            accepted=accepted,
            emitted=emitted,
            draft_s=t_drafted - t_start - ctrl_s,
            verify_s=t_verified - t_chosen,
            controller_s=ctrl_s + (t_asked - t_drafted) + (t_chosen - t_granted),
            overhead_s=t_end - t_verified + (t_granted - t_asked),
            forward_s=fwd_s + verify_fwd_s,
        )

    def _draft(
        self, req: _Request, controller: Controller, cap: int
    ) -> tuple[DraftTree, list[int], list[torch.Tensor], float, float]:
        """Draft level by level until the controller stops or ``cap`` is reached: (tree, frontier, draft
        distributions of a sampled chain, forward seconds, controller seconds)."""
        return self._run(self._draft_steps(req, controller, cap))

    def _draft_steps(self, req: _Request, controller: Controller, cap: int) -> Steps:
        """``_draft`` as a generator of its forwards (one a draft step)."""
        clock, ctx, width = self.clock, len(req.tokens), controller.tree_width
        sampled = self.config.draft_mode == "sampled"
        tree, draft_probs, fwd_s, ctrl_s = DraftTree(), [], 0.0, 0.0

        # step 1: run the draft's pending tokens; the last row predicts the root's children
        t0 = clock()
        pending = req.tokens[req.draft_len :]
        logits = yield Forward(self.pair.draft, pending, req.draft_len, req.draft_cache, keep=1)  # [1, V]
        fwd_s += clock() - t0
        req.draft_len = ctx
        frontier = self._expand(tree, [-1], [0.0], logits, width, sampled, draft_probs, req)

        while max(tree.depths) < cap:
            t0 = clock()
            go = decision(controller.should_continue(self._state(tree, frontier, ctx, cap, req)), controller)
            ctrl_s += clock() - t0
            if not go:
                break
            depth = tree.depths[frontier[0]]
            base = cache_len(req.draft_cache)
            for j, node in enumerate(frontier):
                tree.draft_slot[node] = base - ctx + j
            mask = None
            if width > 1:  # each frontier node sees the committed prefix and its own ancestors only
                allowed = np.zeros((len(frontier), base - ctx + len(frontier)), dtype=bool)  # [W, tail]
                for j, node in enumerate(frontier):
                    for anc in tree.path_to(node):
                        allowed[j, tree.draft_slot[anc]] = True
                mask = tree_attention_mask(ctx, allowed, self.pair.dtype, self.device)
            t0 = clock()
            logits = yield Forward(
                self.pair.draft,
                [tree.tokens[n] for n in frontier],
                ctx - 1 + depth,
                req.draft_cache,
                mask=mask,
                positions=[ctx - 1 + depth] * len(frontier),
            )  # [W, V]
            fwd_s += clock() - t0
            scores = [tree.scores[n] for n in frontier]
            frontier = self._expand(tree, frontier, scores, logits, width, sampled, draft_probs, req)
        return tree, frontier, draft_probs, fwd_s, ctrl_s

    def _expand(
        self,
        tree: DraftTree,
        parents: Sequence[int],
        parent_scores: Sequence[float],
        logits: torch.Tensor,
        width: int,
        sampled: bool,
        draft_probs: list[torch.Tensor],
        req: _Request,
    ) -> list[int]:
        """Add the children of ``parents`` (one row of ``logits`` each); return the new frontier."""
        if self.config.check_finite:
            check_finite(logits, "draft")
        logprobs = score_logprobs(logits, req.sampling)  # [P, V]
        if sampled:  # chain of draws from the processed draft distribution (Leviathan)
            probs = logits_to_probs(logits[-1], req.sampling)  # [V]
            token = int(torch.multinomial(probs, 1, generator=req.generator))
            draft_probs.append(probs)
            return [tree.add(token, parents[-1], parent_scores[-1] + float(logprobs[-1, token]))]
        return expand_topk(tree, parents, parent_scores, logprobs, width)

    def _verify(
        self,
        req: _Request,
        tree: DraftTree,
        selected: list[int],
        draft_probs: list[torch.Tensor],
        one_hot: bool = False,
    ) -> Steps:
        """One target forward over the root and the selected nodes, then exact acceptance (``one_hot``: the
        nodes are deterministic proposals whatever the draft mode, accepted by ``verify_tree``)."""
        ctx = len(req.tokens)
        local = {node: j for j, node in enumerate(selected)}
        parents = [local.get(tree.parents[n], -1) for n in selected]
        positions = [ctx - 1] + [ctx - 1 + tree.depths[n] for n in selected]
        mask = None
        if any(p != j - 1 for j, p in enumerate(parents)):  # not a chain: tree mask
            allowed = ancestor_matrix([-1] + [p + 1 for p in parents])
            mask = tree_attention_mask(ctx - 1, allowed, self.pair.dtype, self.device)
        t0 = self.clock()
        logits = yield Forward(
            self.pair.target,
            [req.tokens[-1]] + [tree.tokens[n] for n in selected],
            ctx - 1,
            req.target_cache,
            mask=mask,
            positions=positions,
        )  # [1 + V, vocab]
        fwd_s = self.clock() - t0
        if self.config.check_finite:
            check_finite(logits, "target")
        if self.config.draft_mode == "sampled" and not one_hot:
            target_probs = logits_to_probs(logits, req.sampling)  # [V + 1, vocab]
            tokens = torch.as_tensor([tree.tokens[n] for n in selected], device=logits.device)
            q = torch.stack(draft_probs[: len(selected)]) if selected else target_probs[:0]
            num_accepted, next_token = verify_chain(target_probs, q, tokens, req.generator)
            return selected[:num_accepted], next_token, fwd_s
        draw = make_target_drawer(logits, req.sampling, req.generator)
        path_local, next_token = verify_tree([tree.tokens[n] for n in selected], parents, draw)
        return [selected[j] for j in path_local], next_token, fwd_s

    def _commit(
        self,
        req: _Request,
        tree: DraftTree,
        selected: list[int],
        path: list[int],
        new_tokens: list[int],
        draft_ran: bool = True,
    ) -> tuple[int, int]:
        """Append the new tokens (cut after EOS; ``cap`` already bounds them by budget and context) and
        compact both caches to the committed tokens (``draft_ran=False``: the draft ran nothing this cycle,
        its cache and length stay; the new tokens join its pending inputs). Returns (accepted drafted tokens
        committed, emitted)."""
        ctx = len(req.tokens)
        eos = req.stop_ids
        for i, tok in enumerate(new_tokens):
            if tok in eos:
                new_tokens = new_tokens[: i + 1]
                break
        accepted = min(len(path), len(new_tokens))
        path = path[: len(new_tokens) - 1]  # the caches hold everything committed but the last token
        req.tokens.extend(new_tokens)
        # target: [tokens[:ctx-1]] [root] [selected...] -> keep root + accepted path
        local = {node: j for j, node in enumerate(selected)}
        keep_entries(req.target_cache, ctx, [ctx + local[n] for n in path])
        if not draft_ran:
            return accepted, len(new_tokens)
        # draft: [tokens[:ctx]] [forwarded tree nodes...] -> keep the forwarded prefix of the path
        forwarded = []  # the draft ran a prefix of the path (a node is run only when it is expanded)
        for n in path:
            if tree.draft_slot[n] < 0:
                break
            forwarded.append(tree.draft_slot[n])
        keep_entries(req.draft_cache, ctx, [ctx + s for s in forwarded])
        req.draft_len = ctx + len(forwarded)
        return accepted, len(new_tokens)

    # ------------------------------------------------------------------------------------------ helpers
    def _validate_caches(self, req: _Request) -> None:
        """Raise AssertionError unless each cache equals a fresh forward over the tokens it should hold."""
        for name, model, cache, length in (
            ("target", self.pair.target, req.target_cache, len(req.tokens) - 1),
            ("draft", self.pair.draft, req.draft_cache, req.draft_len),
        ):
            if cache is None or (name == "draft" and req.draft_len == 0):
                continue  # no draft, or nothing run on it yet (its prefill waits for the first drafting cycle)
            if cache_len(cache) != length:
                raise AssertionError(f"{name} cache holds {cache_len(cache)} entries, expected {length}")
            fresh = new_cache(model)
            self._forward(model, req.tokens[:length], 0, fresh, keep=1)
            for i, (got, want) in enumerate(zip(cache.layers, fresh.layers)):
                for a, b in ((got.keys, want.keys), (got.values, want.values)):
                    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
                        err = (a - b).abs().max().item()
                        raise AssertionError(
                            f"{name} cache layer {i} differs from a fresh forward (max {err:.2e})"
                        )

    def _forward(
        self,
        model: torch.nn.Module,
        ids: Sequence[int],
        start: int,
        cache: DynamicCache | None,
        keep: int = 0,
        mask: torch.Tensor | None = None,
        positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One forward of ``ids`` at positions ``start...`` (or ``positions``); returns logits [Q, V]."""
        if positions is None:
            positions = range(start, start + len(ids))
        return forward_logits(model, ids, positions, cache, self.device, keep=keep, mask=mask)

    def _state(self, tree: DraftTree, frontier: list[int], ctx: int, cap: int, req: _Request) -> DraftState:
        scores = np.asarray(tree.scores, dtype=np.float32)
        frontier_scores = scores[frontier]
        step = frontier_scores - np.asarray(
            [tree.scores[p] if p >= 0 else 0.0 for p in (tree.parents[n] for n in frontier)], dtype=np.float32
        )
        return DraftState(
            depth=tree.depths[frontier[0]] if frontier else 0,
            frontier_scores=-np.sort(-frontier_scores),
            step_probs=np.exp(step),
            node_scores=-np.sort(-scores),
            context_len=ctx,
            max_depth=cap,
            history=req.cycles,
            temperature=req.sampling.temperature,
            load=req.load,
        )

    def _finish_reason(self, req: _Request, prompt_len: int, max_new_tokens: int) -> str | None:
        last = req.tokens[-1]
        if last in req.stop_ids:  # the pair's EOS ids unless the request ignores them, and its stop tokens
            return "eos" if last in self.pair.eos_token_ids else "stop"
        if len(req.tokens) - prompt_len >= max_new_tokens:
            return "length"
        if len(req.tokens) >= self.pair.max_context:
            return "context"
        return None

    def _prompt_ids(self, prompt: str | Sequence[int] | torch.Tensor | np.ndarray) -> list[int]:
        """Token ids of ``prompt``; anything but text or integer ids of one sequence is an ``InputError``
        (floats would be truncated, a batch flattened into one sequence)."""
        if isinstance(prompt, str):
            ids = [int(t) for t in self.pair.tokenizer.encode(prompt)]
        elif isinstance(prompt, (torch.Tensor, np.ndarray)):
            shape = tuple(prompt.shape)
            if len(shape) == 2 and shape[0] == 1:
                prompt = prompt[0]  # a batch of one, as tokenizers return it
            elif len(shape) != 1:
                raise InputError(
                    f"prompt must be one sequence of token ids (shape [n] or [1, n]), got shape {shape}"
                )
            integer = (
                not (prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool)
                if isinstance(prompt, torch.Tensor)
                else np.issubdtype(prompt.dtype, np.integer)
            )
            if not integer:
                raise InputError(f"prompt token ids must be integers, got a tensor of dtype {prompt.dtype}")
            ids = [int(t) for t in prompt.tolist()]
        elif isinstance(prompt, (list, tuple, range)):
            bad = [t for t in prompt if not is_int(t)]
            if bad:
                raise InputError(
                    f"prompt token ids must be integers, got {short_repr(bad[0])} ({type(bad[0]).__name__})"
                )
            ids = [int(t) for t in prompt]
        else:
            raise InputError(
                "prompt must be a string, a list of token ids or an integer tensor, got "
                f"{type(prompt).__name__}"
            )
        if not ids:
            raise InputError("empty prompt: give at least one token")
        vocab = self.pair.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InputError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _check_controller(
        self, controller: Controller | None, sampling: SamplingConfig | None = None
    ) -> None:
        sampling = sampling or self.sampling
        if controller is None:
            return
        if not isinstance(controller, Controller):
            raise ControllerError(
                f"controller must be an engine.Controller (subclass it) or None, got "
                f"{short_repr(controller)} ({type(controller).__name__})"
            )
        width = getattr(controller, "tree_width", None)
        if not is_int(width) or width < 1:
            raise ControllerError(f"controller.tree_width must be an integer >= 1, got {short_repr(width)}")
        vocab = self.pair.vocab_size
        if width > vocab:
            raise ControllerError(
                f"controller.tree_width {width} exceeds the vocabulary ({vocab} tokens): a node "
                f"has at most {vocab} children"
            )
        if width > self.config.max_tree_nodes:
            raise ControllerError(
                f"controller.tree_width {width} drafts more than EngineConfig.max_tree_nodes="
                f"{self.config.max_tree_nodes} nodes in its first step"
            )
        if self.config.draft_mode == "sampled":
            if width != 1:
                raise InputError("draft_mode='sampled' drafts chains only: use tree_width=1")
            if sampling.greedy:
                raise InputError(
                    "draft_mode='sampled' needs temperature > 0 (greedy drafts are deterministic)"
                )


def shares_its_step(load: LoadState | None) -> bool:
    """Whether a cycle under ``load`` shares its step with other requests' work (others decoding, or prompts
    being prefilled or waiting): then the draft's catch-up goes in chunks (``EngineConfig.
    draft_catch_up_tokens``). Alone (None) or the only request with nothing waiting: no."""
    return load is not None and load.requests + load.waiting > 1


def forward_logits(
    model: torch.nn.Module,
    ids: Sequence[int],
    positions: Sequence[int],
    cache: DynamicCache | None,
    device: torch.device,
    keep: int = 0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [Q, V] of one forward of ``ids`` at ``positions`` on top of ``cache`` (``keep``: only the
    last rows, 0 = all; ``mask``: additive 4D tree mask or None for causal). The one place the engine and
    the trace recorder call a model."""
    input_ids = torch.as_tensor([list(ids)], device=device)
    position_ids = torch.as_tensor([list(positions)], device=device)
    if input_ids.shape[1] <= MAX_ROWWISE_ROWS and lean.supports(model):
        return lean.forward(model, input_ids, position_ids, cache, mask, keep)  # bitwise the call below
    if mask is None and chunked_prefill(model, cache):
        return _in_chunks(model, input_ids, position_ids, cache, keep)
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=mask,
        cache=cache,
        use_cache=True,
        logits_to_keep=keep,
    )
    return out.logits[0]


def chunked_prefill(model: torch.nn.Module, cache: object) -> bool:
    """Whether a causal forward of any length on ``cache`` runs in chunks of at most ``MAX_ROWWISE_ROWS``
    rows through the native decoder: its kernels and attention compute every row alone, so the logits and
    the cache are bitwise the same whatever the chunk boundaries (``engine.batch`` prefills a prompt a chunk
    a step, each chunk in the step's shared forward, and gets what ``generate`` alone gets). Elsewhere (the
    torch path: other formats, CUDA) a long forward is transformers' forward of the whole."""
    return (
        cache is not None
        and lean.NATIVE
        and lean.supports(model)
        and lean.native_decoder(model) is not None
        and all(type(layer) is GrowingLayer for layer in cache.layers)
    )


def _in_chunks(
    model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache: object, keep: int
) -> torch.Tensor:
    """``forward_logits`` of a long causal forward, chunk after chunk (``chunked_prefill``): the logits of
    the kept rows (a chunk with none of them keeps one row, dropped: a row of the LM head)."""
    total, out = ids.shape[1], []
    first_kept = total - keep if keep else 0
    for start in range(0, total, MAX_ROWWISE_ROWS):
        end = min(start + MAX_ROWWISE_ROWS, total)
        wanted = end - max(start, first_kept)
        logits = lean.forward(model, ids[:, start:end], positions[:, start:end], cache, None, max(wanted, 1))
        if wanted > 0:
            out.append(logits)
    return torch.cat(out)


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
