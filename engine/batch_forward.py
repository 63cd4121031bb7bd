"""One forward carrying the rows of several sequences, each on top of its own KV cache (``engine.batch``).

A ``Rows`` item is what ``engine.forward.forward_logits`` takes for one sequence (ids, positions, its cache, a
tree mask or None for causal, the rows to keep); ``forward_rows(model, items)`` returns each item's logits as
``forward_logits`` of that item alone would, computing the linear layers over every item's rows at once (one
pass over the weights for all sequences: the throughput of batching) and everything else per sequence:

* kquant models on the native decoder (``engine/backends/csrc/decoder.cpp``, ``Decoder.forward_batch``): all layers in
  one C++ call; attention per (sequence, key/value head) over that sequence's cache only. The kernels compute
  every output row independently of the others and attention reads exactly the row's keys in cache order, so
  each item's logits are bitwise those of its forward alone, whatever else is batched with it (tested with a
  negative control).
* other Qwen2 models (the torch path, device-generic: the model's own modules, so it runs on CUDA too): the
  projections and the MLP over all rows, the rotary embedding, the cache append, row-wise attention
  (``engine.backends.attention``: one SDPA call per query row over the keys that row sees) and the norms per item,
  the same calls in the same order as the lean forward of the item alone. Bitwise batch invariant where the
  linear layers are (the integer formats, whose kernels compute each row alone); float32 products on the CPU
  are not (MKL's 1-3-row products differ from larger ones by ~1e-7), so there greedy identity is measured
  (tests), as it already is for speculation in float32 (docs/kernels.md, "Row-wise attention").
* anything else (another architecture, an item of more than ``MAX_ROWWISE_ROWS`` rows: a prefill) runs
  alone through ``forward_logits``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, apply_rotary_pos_emb

from engine.backends import lean
from engine.backends.attention import MAX_ROWWISE_ROWS, rowwise_attention
from engine.backends.kvcache import GrowingLayer
from engine.forward import forward_logits


@dataclass
class Rows:
    """One sequence's part of a batched forward: the arguments of ``forward_logits`` for that sequence."""

    ids: Sequence[int]
    positions: Sequence[int]
    cache: object
    """Its own KV cache (a ``DynamicCache`` from ``engine.backends.kvcache.new_cache``), appended to by the forward."""
    mask: torch.Tensor | None = None
    """Additive (or boolean) 4D tree mask over cache + new rows; None: causal."""
    keep: int = 0
    """Only the last ``keep`` rows' logits (0: all)."""


def forward_rows(
    model: torch.nn.Module, items: Sequence[Rows], device: torch.device, native: bool | None = None
) -> list[torch.Tensor]:
    """The logits of each item ([rows or keep, V]), each as ``forward_logits`` of that item alone computes
    them (bitwise where the linear layers are batch invariant: see the module docstring). Items must use
    distinct caches. ``native``: force (True) or refuse (False) the native decoder; None: where it applies."""
    if len({id(item.cache) for item in items}) != len(items):
        raise ValueError("each sequence of a batched forward needs its own cache")
    out: list[torch.Tensor | None] = [None] * len(items)
    batched = []
    for i, item in enumerate(items):
        if len(item.ids) > MAX_ROWWISE_ROWS or not _batchable(model, item.cache):
            out[i] = _alone(model, item, device)
        else:
            batched.append(i)
    if len(batched) == 1 and native is None:
        out[batched[0]] = _alone(model, items[batched[0]], device)  # exactly the single-sequence forward
    elif batched:
        group = [items[i] for i in batched]
        decoder = lean.native_decoder(model) if lean.NATIVE and native is not False else None
        if decoder is not None and all(type(x) is GrowingLayer for it in group for x in it.cache.layers):
            logits = _native(model, decoder, group, device)
        elif native:
            raise ValueError("the native decoder does not apply to this model or these caches")
        else:
            logits = _torch(model, group, device)
        for i, row in zip(batched, logits):
            out[i] = row
    return out


def _batchable(model: torch.nn.Module, cache: object) -> bool:
    """Whether ``model`` takes the batched paths: a Qwen2 causal LM without a sliding window, on a cache."""
    config = model.config
    return (
        type(model) is Qwen2ForCausalLM
        and not getattr(config, "use_sliding_window", False)
        and cache is not None
    )


def _alone(model: torch.nn.Module, item: Rows, device: torch.device) -> torch.Tensor:
    return forward_logits(model, item.ids, item.positions, item.cache, device, keep=item.keep, mask=item.mask)


def _inputs(model, items: Sequence[Rows], device: torch.device):
    """(embedded rows [1, R, H], per item (cos, sin) [1, Q, D]): the embedding over all rows (a gather), the
    rotary embedding per item (its shapes as alone)."""
    ids = torch.as_tensor([[t for it in items for t in it.ids]], device=device)
    inner = model.model
    x = inner.embed_tokens(ids)
    rotary, start = [], 0
    for it in items:
        q = len(it.ids)
        positions = torch.as_tensor([list(it.positions)], device=device)
        rotary.append(inner.rotary_emb(x[:, start : start + q], positions))
        start += q
    return x, rotary


def _head(model, items: Sequence[Rows], hidden: list[torch.Tensor], norm) -> list[torch.Tensor]:
    """The final norm per item (its rows as alone), then the LM head over every item's kept rows at once."""
    kept = []
    for it, h in zip(items, hidden):
        h = norm(h)
        kept.append(h[..., -it.keep :, :] if it.keep else h)
    logits = model.lm_head(torch.cat(kept, dim=-2))
    sizes = [h.shape[-2] for h in kept]
    return list(torch.split(logits.reshape(-1, logits.shape[-1]), sizes))


def _native(model, decoder, items: Sequence[Rows], device: torch.device) -> list[torch.Tensor]:
    inner, config = model.model, model.config
    x, rotary = _inputs(model, items, device)
    if x.dtype != torch.float32:
        raise ValueError("the native decoder runs float32 activations only")
    like = x.new_empty((1, config.num_key_value_heads, 0, inner.layers[0].self_attn.head_dim))
    keys, values, pasts, rows, counts, indices = [], [], [], [], [], []
    for it in items:
        q = len(it.ids)
        buffers = [layer.reserve(q, like) for layer in it.cache.layers]
        past = buffers[0][2]
        count, index = lean.row_plan(it.mask, past, q)
        keys.append([b[0] for b in buffers])
        values.append([b[1] for b in buffers])
        pasts.append(past)
        rows.append(q)
        counts.append(count)
        indices.append(index)
    counts_all = torch.cat(counts)
    index_all = torch.empty(0, dtype=torch.long)
    if any(index.numel() for index in indices):  # rows that see a prefix list it
        width = int(counts_all.max())
        index_all = torch.zeros((len(counts_all), width), dtype=torch.long)
        start = 0
        for count, index in zip(counts, indices):
            for j in range(len(count)):
                n = int(count[j])
                index_all[start + j, :n] = index[j, :n] if index.numel() else torch.arange(n)
            start += len(count)
    cos = torch.cat([c[0] for c, _ in rotary])
    sin = torch.cat([s[0] for _, s in rotary])
    h = decoder.forward_batch(x[0], cos, sin, keys, values, pasts, rows, counts_all, index_all)
    for it, past, q in zip(items, pasts, rows):
        for layer in it.cache.layers:
            layer.extend(past + q)
    return _head(model, items, list(torch.split(h, rows)), lambda t: lean.rms_norm(inner.norm, t))


def _torch(model, items: Sequence[Rows], device: torch.device) -> list[torch.Tensor]:
    """The torch path (any device and dtype the model runs in): the lean forward's operations (transformers'
    Qwen2 forward), linears over all rows, the rest per item."""
    inner = model.model
    x, rotary = _inputs(model, items, device)
    sizes = [len(it.ids) for it in items]
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = torch.cat([layer.input_layernorm(part) for part in torch.split(x, sizes, dim=1)], dim=1)
        q_all, k_all, v_all = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        outs = []
        for it, (cos, sin), q, k, v in zip(
            items,
            rotary,
            torch.split(q_all, sizes, dim=1),
            torch.split(k_all, sizes, dim=1),
            torch.split(v_all, sizes, dim=1),
        ):
            shape = (1, q.shape[1], -1, attn.head_dim)
            q, k = apply_rotary_pos_emb(
                q.reshape(shape).transpose(1, 2), k.reshape(shape).transpose(1, 2), cos, sin
            )
            k, v = it.cache.update(k, v.reshape(shape).transpose(1, 2), i)
            o, _ = rowwise_attention(attn, q, k, v, it.mask, scaling=attn.scaling)
            outs.append(o.reshape(1, q.shape[2], -1))
        x = x + attn.o_proj(torch.cat(outs, dim=1).contiguous())
        h = torch.cat([layer.post_attention_layernorm(part) for part in torch.split(x, sizes, dim=1)], dim=1)
        x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
    return _head(model, items, list(torch.split(x, sizes, dim=1)), inner.norm)
