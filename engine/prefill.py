"""A request's state between cycles (``RequestState``: the module docstring of ``engine.engine`` states its
invariant) and how it starts: the target's prefill and first token, the draft's empty cache, and the draft's
lazy prefill at the first drafting cycle (``PrefillPhase``, a part of ``SpeculativeEngine``; the batched engine
prefills in chunks and calls ``prefilled_request`` with the last chunk's logits)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.backends.kvcache import new_cache
from engine.backends.pair import ModelPair
from engine.forward import Clock, Forward, Steps
from engine.load import LoadState
from engine.results import CycleRecord
from engine.sampling import SamplingConfig, check_finite, make_target_drawer

if TYPE_CHECKING:
    from engine.inputs import EngineConfig


@dataclass
class RequestState:
    """One request's decoding state between cycles (its invariant: ``engine.engine``'s module docstring):
    what ``SpeculativeEngine.prefilled_request`` makes and ``SpeculativeEngine.cycle`` advances."""

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


class PrefillPhase:
    """The prefill methods of ``SpeculativeEngine`` (module docstring)."""

    pair: ModelPair
    config: EngineConfig
    sampling: SamplingConfig
    clock: Clock
    forward: Callable[..., torch.Tensor]
    """``SpeculativeEngine.forward``: one forward, run at once."""

    def _prefill(self, prompt_ids: list[int], generator: torch.Generator, with_draft: bool) -> RequestState:
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
    ) -> RequestState:
        """The target's prefill (one forward of the prompt) and the first token, drawn with ``sampling``.
        ``capacity``: the (target, draft) cache entries reserved for the request (``engine.backends.kvcache.
        new_cache``; ``engine.batch``), None: caches that grow as needed."""
        target_cap, draft_cap = capacity if capacity is not None else (None, None)
        target_cache = new_cache(self.pair.target, target_cap)
        logits = self.forward(self.pair.target, prompt_ids, 0, target_cache, keep=1)  # [1, V]
        return self.prefilled_request(
            prompt_ids, logits, target_cache, generator, with_draft, sampling, stop_ids, draft_cap
        )

    def prefilled_request(
        self,
        prompt_ids: list[int],
        logits: torch.Tensor,
        target_cache: object,
        generator: torch.Generator,
        with_draft: bool,
        sampling: SamplingConfig,
        stop_ids: frozenset[int],
        draft_capacity: int | None = None,
    ) -> RequestState:
        """The request once its prompt is in ``target_cache`` (by a driver's own prefill, ``engine.batch``'s
        chunks): the first token drawn from ``logits`` (the prompt's last row, [1, V]) with ``sampling`` and
        ``generator``; the draft's cache made (``with_draft``; ``draft_capacity`` entries reserved), empty."""
        if self.config.check_finite:
            check_finite(logits, "target")
        first = make_target_drawer(logits, sampling, generator)(0)
        # the draft's prefill waits for the first drafting cycle (``_draft``): a request a controller
        # decodes autoregressively never pays for it
        draft_cache = new_cache(self.pair.draft, draft_capacity) if with_draft else None
        return RequestState(
            prompt_ids + [first],
            target_cache,
            draft_cache,
            0,
            generator,
            sampling,
            frozenset(stop_ids),
            draft_prompt=list(prompt_ids),
        )

    def _prefill_draft(self, req: RequestState) -> Steps:
        """The draft's lazy prefill, at the request's first drafting cycle: one forward of exactly the prompt
        (what an eager prefill would run, so the draft's cache, and every tree it drafts, is the same
        whenever it happens), or of the rest of it after catch-up cycles ran its first chunks; the tokens
        committed since stay pending. Timed as prefill, not as drafting."""
        t0 = self.clock()
        start = req.draft_len
        yield Forward(self.pair.draft, req.draft_prompt[start:], start, req.draft_cache, keep=1)
        req.draft_len, req.draft_prompt = len(req.draft_prompt), None
        req.draft_prefill_s += self.clock() - t0
