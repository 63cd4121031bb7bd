"""A lean forward for Qwen2 causal LMs on the CPU: the decode, draft and verification forwards (up to
``MAX_ROWWISE_ROWS`` query rows) without transformers' module plumbing.

With the kquant kernels a target step is ~45 ms, of which transformers' per-layer Python (module calls,
keyword plumbing, mask construction, output objects) took ~2-3 ms (measured, default target, 2 threads).
This forward runs the very same tensor operations in the same order -- RMSNorm, projections, rotary
embedding, the cache append, row-wise attention, the MLP -- read off the model's own modules, so its
logits are bitwise those of ``model(...)`` (a test checks it on every forward shape the engine uses).
Forwards with more rows (prompt prefill, trace-recording blocks) keep transformers' forward.
"""

from __future__ import annotations

import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, apply_rotary_pos_emb

from engine.attention import MAX_ROWWISE_ROWS, ROWWISE_ATTENTION, rowwise_attention


def supports(model) -> bool:
    """Whether ``model`` can take the lean forward: a plain Qwen2 causal LM (no sliding window) on the CPU
    in float32 activations with row-wise attention."""
    if type(model) is not Qwen2ForCausalLM:
        return False
    config = model.config
    return (
        getattr(config, "_attn_implementation", None) == ROWWISE_ATTENTION
        and not getattr(config, "use_sliding_window", False)
        and model.model.embed_tokens.weight.device.type == "cpu"
        and model.model.embed_tokens.weight.dtype == torch.float32
    )


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """Qwen2RMSNorm.forward for float32 activations, operation for operation."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


@torch.no_grad()
def forward(
    model, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor | None = None, keep: int = 0
) -> torch.Tensor:
    """Logits [Q, V] of ``ids`` [1, Q] at ``positions`` [1, Q] on top of ``cache`` (a DynamicCache whose
    layers are appended to); ``mask``: an additive or boolean 4D mask over cache + new rows, None for causal;
    ``keep``: only the last rows (0 = all). Q must be at most ``MAX_ROWWISE_ROWS``."""
    q_len = ids.shape[1]
    if q_len > MAX_ROWWISE_ROWS:
        raise ValueError(f"the lean forward takes at most {MAX_ROWWISE_ROWS} rows, got {q_len}")
    inner = model.model
    x = inner.embed_tokens(ids)
    if x.dtype != torch.float32:
        raise ValueError("the lean forward runs float32 activations only")
    cos, sin = inner.rotary_emb(x, positions)
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms_norm(layer.input_layernorm, x)
        shape = (1, q_len, -1, attn.head_dim)
        q = attn.q_proj(h).view(shape).transpose(1, 2)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = cache.update(k, v, i)
        o, _ = rowwise_attention(attn, q, k, v, mask, scaling=attn.scaling)
        x = x + attn.o_proj(o.reshape(1, q_len, -1).contiguous())
        h = _rms_norm(layer.post_attention_layernorm, x)
        x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
    x = _rms_norm(inner.norm, x)
    if keep:
        x = x[:, -keep:]
    return model.lm_head(x)[0]
