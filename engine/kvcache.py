"""KV-cache surgery on transformers' ``DynamicCache``: keep the committed tokens, drop the rest.

After a cycle the caches must hold exactly the committed tokens (DESIGN.md section 2). Verified nodes
off the accepted path are removed by moving the accepted entries down to the end of the committed
prefix and cropping; a pure prefix only needs the crop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


def new_cache(model: torch.nn.Module) -> DynamicCache:
    return DynamicCache(config=model.config)


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
