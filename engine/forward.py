"""One model forward and the messages a cycle's forwards travel in: ``forward_logits`` (the one place the
engine and the trace recorder call a model, long causal forwards in chunks where the native decoder makes
that bitwise: ``chunked_prefill``), the ``Forward`` and ``VerifyRows`` a cycle generator yields (``Steps``),
the device-synchronised ``Clock``, and the debug check of a request's caches (``validate_caches``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.backends import lean
from engine.backends.attention import MAX_ROWWISE_ROWS
from engine.backends.kvcache import GrowingLayer, cache_len, new_cache
from engine.backends.pair import ModelPair

if TYPE_CHECKING:
    from transformers import DynamicCache

Steps = Generator["Forward | VerifyRows", Any, Any]
"""A cycle (or one of its phases) as a generator: it yields the forwards and verification rows it needs
and returns its result (``SpeculativeEngine._run`` drives one alone, ``engine.batch`` several at once)."""


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
    """A model forward a cycle asks for: the arguments of ``SpeculativeEngine.forward``; answered with the
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


def validate_caches(pair: ModelPair, req: Any, forward: Callable[..., torch.Tensor]) -> None:
    """Raise AssertionError unless each of ``req``'s caches (an ``engine.prefill.RequestState``) equals a fresh forward (``forward``: the engine's)
    over the tokens it should hold (``EngineConfig.validate_caches``)."""
    for name, model, cache, length in (
        ("target", pair.target, req.target_cache, len(req.tokens) - 1),
        ("draft", pair.draft, req.draft_cache, req.draft_len),
    ):
        if cache is None or (name == "draft" and req.draft_len == 0):
            continue  # no draft, or nothing run on it yet (its prefill waits for the first drafting cycle)
        if cache_len(cache) != length:
            raise AssertionError(f"{name} cache holds {cache_len(cache)} entries, expected {length}")
        fresh = new_cache(model)
        forward(model, req.tokens[:length], 0, fresh, keep=1)
        for i, (got, want) in enumerate(zip(cache.layers, fresh.layers)):
            for a, b in ((got.keys, want.keys), (got.values, want.values)):
                if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
                    err = (a - b).abs().max().item()
                    raise AssertionError(
                        f"{name} cache layer {i} differs from a fresh forward (max {err:.2e})"
                    )


def peak_memory(device: torch.device) -> int:
    """Peak memory of the process: the device's allocated bytes on CUDA, else the resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
