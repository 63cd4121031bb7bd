"""Batch-invariant attention: each query row computed exactly as a one-row decode step would compute it.

Greedy speculative decoding is token-identical to autoregressive decoding only if the target's logits for
a position do not depend on how many other rows share its forward. The integer linear kernels are batch
invariant (``engine.backends.quant``), norms, rotary embeddings and activations work row by row, but PyTorch's
CPU scaled-dot-product attention is not: with k query rows it blocks and reduces differently than with
one (measured on the default target, int4: verification logits off by up to 0.09 from the one-row
values, flipping greedy tokens).

``rowwise_attention`` therefore runs one SDPA call per query row over exactly the keys that row may see:
a causal row sees a prefix of the cache (a slice, no copy); a tree row (4D additive mask) sees the
committed prefix plus its ancestors, gathered into a contiguous block, which is exactly the cache an
autoregressive decode of that path would hold (same entries, same order, same positions). Each call is
then the very call a one-row decode makes, so each row's output is bitwise that of the one-row step.

Forwards with more than ``MAX_ROWWISE_ROWS`` (65) query rows (prompt prefill, trace recording blocks) use one
ordinary SDPA call: they are not compared row against row (a prefill is the same call in every mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ROWWISE_ATTENTION = "draftpilot_rowwise"
MAX_VERIFY_NODES = 64
"""The most drafted nodes one verification may send to the target: ``EngineConfig.max_verify`` (default and
upper bound), the top of the size ladders."""
MAX_ROWWISE_ROWS = MAX_VERIFY_NODES + 1
"""Query rows up to which attention runs row by row: every verification forward (the root plus at most
``MAX_VERIFY_NODES`` nodes; the engine caps what it verifies at ``EngineConfig.max_verify``) stays in the
row-wise, batch-invariant regime."""

_plan_cache: tuple = (None, None)
"""(mask tensor, per-row key plan) of the last mask seen: one mask serves every layer of a forward. One tuple,
replaced whole, so concurrent engines (evaluation.concurrency) never pair one mask with another's plan."""


def row_keys(mask: torch.Tensor) -> list[int | torch.Tensor]:
    """Per query row of a [1, 1, q, kv] mask: an int n when the row sees exactly keys [0, n), else the
    index tensor of the keys it sees."""
    global _plan_cache
    cached_mask, cached_plan = _plan_cache
    if cached_mask is mask:
        return cached_plan
    m = mask[0, 0]
    allowed = m if m.dtype == torch.bool else m == 0
    plan: list[int | torch.Tensor] = []
    for row in allowed:
        idx = row.nonzero().flatten()
        n = int(idx.numel())
        plan.append(n if n == 0 or int(idx[-1]) == n - 1 else idx)
    _plan_cache = (mask, plan)
    return plan


def rowwise_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers attention function (``AttentionInterface``): query [B, H, q, D], key/value
    [B, Hkv, kv, D] -> ([B, q, H, D], None)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len > MAX_ROWWISE_ROWS or query.shape[0] != 1 or dropout:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    gqa = query.shape[1] != key.shape[1]
    if attention_mask is None:  # causal: row j sees the cache and rows 0..j
        plan: list = [kv_len - q_len + j + 1 for j in range(q_len)]
    else:
        if attention_mask.shape[-1] != kv_len:
            raise ValueError(
                f"attention mask covers {attention_mask.shape[-1]} keys, the cache holds {kv_len}"
            )
        plan = row_keys(attention_mask)
    rows = []
    for j, keys in enumerate(plan):
        if isinstance(keys, int):
            k, v = key[:, :, :keys], value[:, :, :keys]
        else:
            k, v = key.index_select(2, keys), value.index_select(2, keys)
        rows.append(
            F.scaled_dot_product_attention(query[:, :, j : j + 1], k, v, scale=scaling, enable_gqa=gqa)
        )
    out = rows[0] if q_len == 1 else torch.cat(rows, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)


def use_rowwise_attention(model) -> None:
    """Make ``model`` (a transformers causal LM on the CPU) compute attention row by row."""
    model.set_attn_implementation(ROWWISE_ATTENTION)
