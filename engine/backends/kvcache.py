"""KV caches: transformers' ``DynamicCache`` with layers that grow in place, and the surgery that keeps the
committed tokens and drops the rest.

After a cycle the caches must hold exactly the committed tokens (docs/design.md section 2). Verified nodes
off the accepted path are removed by moving the accepted entries down to the end of the committed
prefix and cropping; a pure prefix only needs the crop.

``GrowingLayer`` replaces ``DynamicLayer``'s append (``torch.cat`` of the whole cache with the new
entries, a copy of every key and value of every layer at every step: 14 MB a decode step of the default
target at 256 tokens, measured as the largest cost outside the weight kernels) by a write into spare
capacity: the layer keeps one buffer per keys/values, doubles it when full, and exposes the filled part
as a view. The values attention reads are the same numbers in the same order; only their storage differs.

A cache made with a capacity (``new_cache(model, capacity)``, the batched engine's memory reservation:
``engine.batch``) allocates exactly that many entries at its first append and never more: an append past it
raises ``CacheFull`` instead of doubling the buffer, so a request's KV memory never exceeds what was reserved
for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.errors import DraftpilotError

MIN_CAPACITY = 256  # entries a layer's buffer holds at first (then doubled as needed)


class CacheFull(DraftpilotError):
    """An append would take a KV cache past the capacity reserved for it (``new_cache(model, capacity)``)."""


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views of buffers with spare capacity: appending writes
    into the buffer (amortised O(new entries)) instead of concatenating the whole cache. Cropping and
    ``keep_entries`` work on the views as before; an append after them continues at the view's end.
    ``limit``: None (the buffer doubles as needed), or the entries it may ever hold (its buffer is allocated
    at exactly that size; more raises ``CacheFull``)."""

    limit: int | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf = self._vbuf = None

    def _backed(self) -> bool:
        """Whether keys/values are still the leading views of this layer's buffers."""
        kbuf, vbuf = self._kbuf, self._vbuf
        return (
            kbuf is not None
            and self.keys.data_ptr() == kbuf.data_ptr()
            and self.keys.stride() == kbuf.stride()
            and self.values.data_ptr() == vbuf.data_ptr()
            and self.values.stride() == vbuf.stride()
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kbuf, vbuf, old = self.reserve(key_states.shape[-2], key_states, value_states)
        new = old + key_states.shape[-2]
        kbuf[..., old:new, :] = key_states
        vbuf[..., old:new, :] = value_states
        self.extend(new)
        return self.keys, self.values

    def reserve(
        self, count: int, key_like: torch.Tensor, value_like: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Make room for ``count`` more entries: (keys buffer, values buffer, entries held now), buffers
        [batch, kv_heads, capacity, head_dim] with capacity >= held + count. The caller writes the new
        entries at [held, held + count) and then calls ``extend(held + count)``. ``key_like`` /
        ``value_like``: tensors of the entries' shape (all but the sequence axis), dtype and device."""
        value_like = key_like if value_like is None else value_like
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)
        old = self.get_seq_length()
        new = old + count
        if not (old and self._backed()) or new > self._kbuf.shape[-2]:
            if self.limit is None:
                capacity = max(MIN_CAPACITY, new, 2 * (self._kbuf.shape[-2] if self._kbuf is not None else 0))
            elif new > self.limit:
                raise CacheFull(
                    f"the KV cache would hold {new} entries, past the {self.limit} reserved for the request"
                )
            else:
                capacity = self.limit
            kbuf = key_like.new_empty((*key_like.shape[:-2], capacity, key_like.shape[-1]))
            vbuf = value_like.new_empty((*value_like.shape[:-2], capacity, value_like.shape[-1]))
            if old:
                kbuf[..., :old, :] = self.keys
                vbuf[..., :old, :] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf
        return self._kbuf, self._vbuf, old

    def extend(self, length: int) -> None:
        """Expose the first ``length`` entries of the buffers as the cache (after ``reserve`` and a write)."""
        self.keys, self.values = self._kbuf[..., :length, :], self._vbuf[..., :length, :]

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


def new_cache(model: torch.nn.Module, capacity: int | None = None) -> DynamicCache:
    """An empty cache of ``GrowingLayer``s for ``model``; ``capacity``: the entries each layer may ever hold
    (allocated at once at the first append; ``CacheFull`` past it), None: buffers that double as needed."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if capacity is not None:
        if any(type(layer) is not GrowingLayer for layer in cache.layers):
            raise ValueError("a cache capacity needs DynamicLayer layers (no sliding window)")
        for layer in cache.layers:
            layer.limit = int(capacity)
    return cache


def cache_bytes(cache: DynamicCache | None) -> int:
    """Bytes of the key/value buffers the cache's ``GrowingLayer``s hold now (0 for None)."""
    total = 0
    for layer in cache.layers if cache is not None else ():
        for buf in (getattr(layer, "_kbuf", None), getattr(layer, "_vbuf", None)):
            if buf is not None:
                total += buf.numel() * buf.element_size()
    return total


def kv_bytes_per_entry(model: torch.nn.Module) -> int:
    """Bytes one cached position takes in ``model``'s KV cache: layers x kv heads x head dim x 2 (keys and
    values) x the activations' element size (what the embedding yields, the dtype the cache stores)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    embed = model.get_input_embeddings()
    with torch.inference_mode():
        probe = embed(torch.zeros((1, 1), dtype=torch.long, device=embed.weight.device))
    return config.num_hidden_layers * kv_heads * head_dim * 2 * probe.element_size()


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def keep_entries(cache: DynamicCache, start: int, keep: Sequence[int]) -> None:
    """Make the cache ``entries[:start] + entries[keep]`` (``keep`` ascending, each >= start)."""
    keep = list(keep)
    if keep == list(range(start, start + len(keep))):  # already contiguous: a crop is enough
        _crop(cache, start + len(keep))
        return
    for layer in cache.layers:
        # keys/values: [batch, kv_heads, seq, head_dim]; the gather copies before the in-place write
        index = torch.as_tensor(keep, device=layer.keys.device)
        end = start + len(keep)
        layer.keys[:, :, start:end] = layer.keys.index_select(2, index)
        layer.values[:, :, start:end] = layer.values.index_select(2, index)
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]


def _crop(cache: DynamicCache, length: int) -> None:
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
