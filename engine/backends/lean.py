"""A lean forward for Qwen2 causal LMs on the CPU: the decode, draft and verification forwards (up to
``MAX_ROWWISE_ROWS`` query rows) without transformers' module plumbing.

With the kquant kernels a target step is ~45 ms, of which transformers' per-layer Python (module calls,
keyword plumbing, mask construction, output objects) took ~2-3 ms (measured, default target, 2 threads).
This forward runs the very same tensor operations in the same order -- RMSNorm, projections, rotary
embedding, the cache append, row-wise attention, the MLP -- read off the model's own modules, so its
logits are bitwise those of ``model(...)`` (a test checks it on every forward shape the engine uses).
Forwards with more rows (prompt prefill, trace-recording blocks) keep transformers' forward.

When every linear layer of the decoder runs the compiled kquant kernels (``engine.backends.kquant``), the layers run
in one call of the native decoder instead (``engine/backends/csrc/decoder.cpp``): the same computation written out in
C++ (no per-operation dispatch from Python, q/k/v and gate/up each on one quantised input), batch
invariant by construction like the kernels, so greedy speculation through it stays token-identical to
autoregressive decoding through it; its logits are close to, not bitwise, transformers' (other summation
orders), which is why it is used for the kquant formats only, whose products are the project's own anyway.
The embedding, the final norm and the LM head stay in Python (one call each).
"""

from __future__ import annotations

import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, apply_rotary_pos_emb

from engine.backends.attention import MAX_ROWWISE_ROWS, ROWWISE_ATTENTION, row_keys, rowwise_attention
from engine.backends.kquant import KQuantLinear
from engine.backends.kvcache import GrowingLayer

NATIVE = True
"""Whether kquant models take the native decoder (tests and benchmarks switch it off to compare)."""


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


def _linears(layer) -> list:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def native_decoder(model):
    """The native decoder of ``model`` (built once and kept on the model), or None when its layers are not
    all kquant (or the lean forward does not apply)."""
    decoder = model.__dict__.get("_draftpilot_decoder", False)
    if decoder is not False:
        return decoder
    decoder = None
    if supports(model) and all(
        isinstance(linear, KQuantLinear) for layer in model.model.layers for linear in _linears(layer)
    ):
        decoder = build_decoder(model.model.layers[0].self_attn.q_proj.ops, model)
    model.__dict__["_draftpilot_decoder"] = decoder
    return decoder


def build_decoder(ops, model):
    """A ``Decoder`` of the compiled extension ``ops`` over ``model``'s kquant layers (weights shared, not
    copied)."""
    config, first = model.config, model.model.layers[0]
    decoder = ops.Decoder(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        first.self_attn.head_dim,
        config.intermediate_size,
        float(first.input_layernorm.variance_epsilon),
    )
    for layer in model.model.layers:
        linears = _linears(layer)
        decoder.add_layer(
            layer.input_layernorm.weight.detach().contiguous(),
            layer.post_attention_layernorm.weight.detach().contiguous(),
            [x.tiles() for x in linears],
            [x.bias for x in linears],
        )
    return decoder


def _native_forward(model, decoder, ids, positions, cache, mask, keep: int) -> torch.Tensor:
    inner, q_len = model.model, ids.shape[1]
    x = inner.embed_tokens(ids)
    if x.dtype != torch.float32:
        raise ValueError("the lean forward runs float32 activations only")
    cos, sin = inner.rotary_emb(x, positions)
    config = model.config
    like = x.new_empty((1, config.num_key_value_heads, 0, inner.layers[0].self_attn.head_dim))
    buffers = [layer.reserve(q_len, like) for layer in cache.layers]
    past = buffers[0][2]
    counts, index = row_plan(mask, past, q_len)
    h = decoder.forward(
        x[0], cos[0], sin[0], [b[0] for b in buffers], [b[1] for b in buffers], past, counts, index
    )
    for layer in cache.layers:
        layer.extend(past + q_len)
    h = rms_norm(inner.norm, h)
    if keep:
        h = h[-keep:]
    return model.lm_head(h)


def row_plan(mask: torch.Tensor | None, past: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys each of ``q_len`` new rows sees on top of ``past`` cached entries, as the native decoder takes
    them: (counts [q_len], index), index empty when every row sees a prefix, else [q_len, L] with row j's key
    positions in ``index[j, :counts[j]]``. ``mask``: None for causal (row j sees the cache and rows 0..j) or a
    4D mask over cache + new rows."""
    if mask is None:  # causal: row j sees the cache and rows 0..j
        return torch.arange(past + 1, past + q_len + 1), torch.empty(0, dtype=torch.long)
    if mask.shape[-1] != past + q_len:
        raise ValueError(f"attention mask covers {mask.shape[-1]} keys, the cache holds {past + q_len}")
    plan = row_keys(mask)
    counts = torch.as_tensor([n if isinstance(n, int) else int(n.numel()) for n in plan])
    if all(isinstance(n, int) for n in plan):
        return counts, torch.empty(0, dtype=torch.long)
    index = torch.zeros((q_len, int(counts.max())), dtype=torch.long)
    for j, n in enumerate(plan):
        index[j, : counts[j]] = torch.arange(n) if isinstance(n, int) else n
    return counts, index


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
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
    decoder = native_decoder(model) if NATIVE else None
    if decoder is not None and all(type(layer) is GrowingLayer for layer in cache.layers):
        return _native_forward(model, decoder, ids, positions, cache, mask, keep)
    inner = model.model
    x = inner.embed_tokens(ids)
    if x.dtype != torch.float32:
        raise ValueError("the lean forward runs float32 activations only")
    cos, sin = inner.rotary_emb(x, positions)
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = rms_norm(layer.input_layernorm, x)
        shape = (1, q_len, -1, attn.head_dim)
        q = attn.q_proj(h).view(shape).transpose(1, 2)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = cache.update(k, v, i)
        o, _ = rowwise_attention(attn, q, k, v, mask, scaling=attn.scaling)
        x = x + attn.o_proj(o.reshape(1, q_len, -1).contiguous())
        h = rms_norm(layer.post_attention_layernorm, x)
        x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
    x = rms_norm(inner.norm, x)
    if keep:
        x = x[:, -keep:]
    return model.lm_head(x)[0]
