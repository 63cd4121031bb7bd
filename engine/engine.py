"""The speculative decoding loop: prefill, then cycles of draft -> verify -> commit.

Invariant between cycles (``RequestState``): ``tokens`` are the committed ids (prompt + generated); the
target cache holds ``tokens[:-1]`` (the last token is the *pending* input of the next target forward);
the draft cache holds ``tokens[:draft_len]`` and ``tokens[draft_len:]`` are the draft's pending inputs. The
draft's prefill is lazy: it runs at the first drafting cycle, so a request decoded without drafting never
pays for it. Under load (``engine.batch``: a step of several requests) a draft that is behind by more than
``EngineConfig.draft_catch_up_tokens`` catches up in chunks of that many tokens, one a cycle, each next to an
autoregressive step (``SpeculativeEngine._catch_up_cycle``), so that no step carries one request's whole
catch-up; alone it catches up at once, in the drafting cycle.

A cycle is a generator (``cycle`` and the phases it delegates to): it yields every model forward it needs
(a ``Forward``) and the number of drafted rows it wants verified (a ``VerifyRows``), and receives the logits
and the rows granted. ``generate`` drives one request's cycles at once (``_run``: each forward runs when asked,
every row granted); ``engine.batch.BatchedEngine`` drives many requests' cycles in step and runs their
forwards together. The cycle code is the same for both. What a cycle is (lookup, autoregressive, catch-up or
speculative), what its controller is asked and when, and which cycles it observes are
``engine.cycle.cycle_rules``, the rules the trace replay (``envs.replay``) drives too; this module does the
forwards, the verification and the commit. Around it: ``engine.inputs`` (``EngineConfig``, the request
checks), ``engine.forward`` (``forward_logits``, ``Forward``, ``VerifyRows``), ``engine.prefill`` (``RequestState``,
the target's prefill and the draft's lazy one) and ``engine.drafting`` (the draft levels).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.backends.kvcache import keep_entries
from engine.backends.pair import ModelPair
from engine.control import Controller, DraftState
from engine.cycle import (
    CyclePlan,
    answer,
    cycle_cap,
    cycle_rules,
    draft_budget,
    lookup_cap,
    tree_cap,
)
from engine.drafting import DraftPhase
from engine.forward import (
    Clock,
    Forward,
    Steps,
    VerifyRows,
    forward_logits,
    peak_memory,
    validate_caches,
)
from engine.inputs import EngineConfig, check_request, prompt_ids_of
from engine.lookup import NgramIndex
from engine.prefill import PrefillPhase, RequestState
from engine.results import CycleRecord, GenerationResult
from engine.sampling import (
    SamplingConfig,
    check_finite,
    logits_to_probs,
    make_target_drawer,
    verify_chain,
    verify_tree,
)
from engine.tree import (
    DraftTree,
    ancestor_matrix,
    clamp_verify,
    tree_attention_mask,
)

if TYPE_CHECKING:
    from transformers import DynamicCache


class SpeculativeEngine(PrefillPhase, DraftPhase):
    """Exact speculative decoding over a ``ModelPair`` with a pluggable per-cycle ``Controller``.

    ``generate`` decodes one request. The per-request cycle API, for a driver that runs many requests' cycles
    itself (``engine.batch``) or times the engine's own forwards (``engine.costs.measure_costs``):
    ``check_request`` (a request's arguments checked), ``prefilled_request`` (its ``RequestState`` once its
    prompt is in the target's cache), ``cycle`` (one cycle, a generator of the ``Forward``s and ``VerifyRows``
    it needs), ``finish_reason`` (whether it is done), ``request_result`` (its ``GenerationResult``) and
    ``forward`` (one forward run at once, the one ``generate`` runs)."""

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
        the same loop; otherwise it must be an ``engine.control.Controller``. ``seed``: an integer in [0, 2**64)
        (there is no random default: a request is reproducible from its arguments). Bad arguments raise
        ``InputError`` (``ControllerError`` for the controller) before any model runs.
        """
        prompt_ids, max_new_tokens = self.check_request(prompt, max_new_tokens, controller, seed)
        width = None if controller is None else controller.tree_width
        tree_depth = tree_cap(width, self.config.max_tree_nodes)
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
        finish = self.finish_reason(req, len(prompt_ids), max_new_tokens)
        while finish is None:
            self._run(self.cycle(req, controller, index, len(prompt_ids), max_new_tokens, tree_depth))
            finish = self.finish_reason(req, len(prompt_ids), max_new_tokens)

        return self.request_result(req, len(prompt_ids), finish, prefill_s)

    def request_result(
        self, req: RequestState, prompt_len: int, finish: str, prefill_s: float
    ) -> GenerationResult:
        """What ``generate`` returns for ``req`` (its prompt ``prompt_len`` tokens long) once it ended for
        ``finish`` (``finish_reason``); ``prefill_s``: its target's prefill seconds."""
        generated = req.tokens[prompt_len:]
        return GenerationResult(
            tokens=generated,
            text=self.pair.tokenizer.decode(generated),
            prompt_len=prompt_len,
            finish_reason=finish,
            prefill_s=prefill_s + req.draft_prefill_s,  # the target's and, if it ran, the draft's
            cycles=req.cycles,
            peak_memory_bytes=peak_memory(self.device),
        )

    def check_request(
        self,
        prompt: str | Sequence[int] | torch.Tensor | np.ndarray,
        max_new_tokens: object,
        controller: Controller | None,
        seed: object,
        sampling: SamplingConfig | None = None,
    ) -> tuple[list[int], int]:
        """(prompt ids, max_new_tokens) of a request, checked as ``generate`` checks its arguments
        (``engine.inputs.check_request``: an ``InputError`` or ``ControllerError`` before any model runs;
        ``sampling``: the request's, default the engine's)."""
        sampling = sampling or self.sampling
        return check_request(self.pair, self.config, prompt, max_new_tokens, controller, seed, sampling)

    def _prompt_ids(self, prompt: str | Sequence[int] | torch.Tensor | np.ndarray) -> list[int]:
        return prompt_ids_of(self.pair, prompt)

    # ------------------------------------------------------------------------------------------ phases
    def _run(self, steps: Steps) -> Any:
        """Drive a cycle generator (or one of its phases) to its end, one request alone: every forward runs at
        once through ``forward``, every verification row asked for is granted. Returns what it returns."""
        try:
            call = next(steps)
            while True:
                if isinstance(call, VerifyRows):
                    answer = call.want
                else:
                    answer = self.forward(
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

    def cycle(
        self,
        req: RequestState,
        controller: Controller | None,
        index: NgramIndex | None,
        prompt_len: int,
        max_new_tokens: int,
        tree_depth: int,
    ) -> Steps:
        """One cycle of ``req`` (a generator: see the module docstring): lookup, an autoregressive step or a
        speculative cycle, as the caps, the lookup and the controller decide; the record is appended to
        ``req.cycles`` (and shown to the controller) and returned. ``index``: the request's context lookup
        (None: off); ``tree_depth``: its ``engine.cycle.tree_cap``. Drive it by sending each ``Forward`` its
        logits and each ``VerifyRows`` the rows granted (at most those asked for); ``generate`` grants all."""
        remaining = max_new_tokens - (len(req.tokens) - prompt_len)
        budget = draft_budget(self.config.max_depth, remaining, self.pair.max_context - len(req.tokens))
        cap = cycle_cap(budget, tree_depth)
        controlled = controller is not None
        rules = cycle_rules(
            cap,
            req.load,
            index.config if index is not None else None,
            controlled,
            controlled and controller.decides_depth_zero,
            len(req.tokens) - req.draft_len,  # the prompt it has not run and its pending tokens
            self.config.draft_catch_up_tokens,
            controlled and controller.decides_lookup,
        )
        plan = CyclePlan(rules, controller)
        proposal, lookup_s, ask_s = [], None, 0.0
        while plan.question is not None and not plan.drafting:  # the questions before any drafting
            t0 = self.clock()
            if plan.question[0] == "lookup":
                index.sync(req.tokens)
                proposal = index.propose(lookup_cap(budget, self.config.max_verify, index.config))
                lookup_s = self.clock() - t0
                plan.reply(len(proposal))
            else:  # verify the lookup's proposal? / depth 0: draft at all this cycle?
                offered = len(proposal) if plan.question[0] == "use_lookup" else 0
                plan.ask(
                    DraftState.before_drafting(
                        len(req.tokens), cap, req.cycles, req.sampling.temperature, req.load, offered
                    )
                )
                ask_s += self.clock() - t0
        kind = "speculative" if plan.drafting else plan.plan.kind
        if kind == "lookup":  # neither the draft nor the controller runs
            record = yield from self._lookup_cycle(req, proposal)
            record.draft_s += lookup_s
        elif kind == "catch_up":
            record = yield from self._catch_up_cycle(req, plan.plan.catch_up)
        elif kind == "speculative":
            record = yield from self._speculative_cycle(req, plan, cap)
        else:
            record = yield from self._autoregressive_step(req)
        record.controller_s += ask_s
        answer(controller, ("cycle", record))  # the controller observes every cycle but a lookup cycle
        if lookup_s is not None and not record.lookup:
            record.overhead_s += lookup_s  # a lookup that found nothing
        req.cycles.append(record)
        if self.config.validate_caches:
            validate_caches(self.pair, req, self.forward)
        return record

    def _catch_up_cycle(self, req: RequestState, size: int) -> Steps:
        """A catch-up cycle (``EngineConfig.draft_catch_up_tokens``): one draft forward of the next chunk of
        the tokens the draft has not run (the prompt's first, then the pending ones; never the last committed
        token, which the next drafting cycle runs) and an autoregressive step, recorded as one (depth 0) with
        the chunk's time as its drafting and its size as ``catch_up``. The draft's cache then holds
        ``tokens[:draft_len]`` as a whole catch-up would have left it (each row is computed alone on the
        native decoder, so chunk boundaries change nothing)."""
        start = req.draft_len
        chunk = req.tokens[start : start + size]
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

    def _autoregressive_step(self, req: RequestState) -> Steps:
        t0 = self.clock()
        ctx = len(req.tokens)
        logits = yield Forward(self.pair.target, req.tokens[-1:], ctx - 1, req.target_cache)  # [1, V]
        t_fwd = self.clock() - t0
        if self.config.check_finite:
            check_finite(logits, "target")
        req.tokens.append(make_target_drawer(logits, req.sampling, req.generator)(0))
        return CycleRecord(ctx, 0, 0, 0, 0, 1, verify_s=self.clock() - t0, forward_s=t_fwd)

    def _lookup_cycle(self, req: RequestState, proposal: list[int]) -> Steps:
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

    def _speculative_cycle(self, req: RequestState, plan: CyclePlan, cap: int) -> Steps:
        """Draft (the lazy draft prefill first, at the request's first drafting cycle), ask the size, verify and
        commit, as ``plan`` asks its controller (``engine.cycle.cycle_rules``)."""
        clock, ctx = self.clock, len(req.tokens)
        if req.draft_prompt is not None:  # the request's first drafting cycle: the draft's prefill first
            yield from self._prefill_draft(req)
        t_start = clock()
        if self.stepwise:
            drafted = yield from self._draft_steps(req, plan, cap)
        else:
            drafted = self._draft(req, plan, cap)
        tree, frontier, draft_probs, fwd_s, ctrl_s = drafted
        t_drafted = clock()

        num_verify = plan.ask(self._state(tree, frontier, ctx, cap, req))  # the size question
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

    def _verify(
        self,
        req: RequestState,
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
        req: RequestState,
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
    def forward(
        self,
        model: torch.nn.Module,
        ids: Sequence[int],
        start: int,
        cache: DynamicCache | None,
        keep: int = 0,
        mask: torch.Tensor | None = None,
        positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One forward of ``ids`` at positions ``start...`` (or ``positions``), run at once, as ``generate`` runs
        every ``Forward`` of its cycles; returns logits [Q, V]."""
        if positions is None:
            positions = range(start, start + len(ids))
        return forward_logits(model, ids, positions, cache, self.device, keep=keep, mask=mask)

    def finish_reason(self, req: RequestState, prompt_len: int, max_new_tokens: int) -> str | None:
        """Why ``req`` (its prompt ``prompt_len`` tokens long) is done ("eos", "stop", "length", "context"), or
        None while it goes on."""
        last = req.tokens[-1]
        if last in req.stop_ids:  # the pair's EOS ids unless the request ignores them, and its stop tokens
            return "eos" if last in self.pair.eos_token_ids else "stop"
        if len(req.tokens) - prompt_len >= max_new_tokens:
            return "length"
        if len(req.tokens) >= self.pair.max_context:
            return "context"
        return None
