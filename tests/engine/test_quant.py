"""Quantized execution (engine.backends.quant, engine.backends.attention): GGUF block decoding, the integer modules, batch
invariance, greedy exactness on every weight format, the converted-weights cache and its errors."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from engine.backends.attention import rowwise_attention
from engine.backends.gguf import QuantizationError, gguf_linears, q4_k_decode
from engine.backends.kvcache import keep_entries, new_cache
from engine.backends.models import load_pair
from engine.backends.quant import (
    INTEGER_FORMATS,
    Int4Linear,
    Int8Linear,
    effective_weight,
    q4_k_to_int4,
    quantize_int4,
    quantize_int8,
)
from engine.backends.quant_cache import QUANT_STAMP, ensure_quantized_gguf, load_quantized
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.forward import forward_logits
from engine.tree import tree_attention_mask
from policies.heuristic import HeuristicController
from tests_helpers import assert_greedy_identity, random_q4_k, write_gguf

pytestmark = pytest.mark.usefixtures("single_thread")


# ------------------------------------------------------------------------------------------ GGUF blocks
def test_q4_k_decode_matches_gguf_reference_bitwise():
    blocks = random_q4_k(16, 512)
    codes, scale, mins = q4_k_decode(blocks, 16, 512)
    assert codes.max() <= 15 and scale.shape == mins.shape == (16, 16)
    ours = (codes.reshape(16, 16, 32) * scale[..., None] - mins[..., None]).reshape(16, 512)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(16, 512)
    assert np.array_equal(ours, reference)


def test_q4_k_decode_negative_control_nibble_order():
    """Swapping the low/high nibble sub-blocks (a plausible layout bug) must not match the reference."""
    blocks = random_q4_k(8, 256, seed=1)
    codes, scale, mins = q4_k_decode(blocks, 8, 256)
    swapped = codes.reshape(8, 4, 2, 32)[:, :, ::-1].reshape(8, 256)
    wrong = (swapped.reshape(8, 8, 32) * scale[..., None] - mins[..., None]).reshape(8, 256)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(8, 256)
    assert not np.allclose(wrong, reference)


def test_q4_k_to_int4_kernel_weight_within_bfloat16_rounding():
    blocks = random_q4_k(32, 256, seed=2)
    reference = torch.from_numpy(
        gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(32, 256)
    )
    codes, scales_zeros = q4_k_to_int4(blocks, 32, 256)
    got = effective_weight(Int4Linear(codes, scales_zeros, None))
    # scale and zero are rounded to bfloat16 (relative 2^-9 each; codes - 8 in [-8, 7]), and the kernel
    # returns bfloat16, so the read-back weight is rounded once more (relative 2^-9)
    scale = scales_zeros[..., 0].float().t().repeat_interleave(32, dim=1)
    zero = scales_zeros[..., 1].float().t().repeat_interleave(32, dim=1)
    bound = (8 * scale.abs() + zero.abs() + reference.abs()) * 2.0**-8 + 1e-6
    assert torch.all((got - reference).abs() <= bound)
    assert (got - reference).abs().max() > 0  # bfloat16 rounding is real: the check above is not vacuous


def test_q4_k_rejects_bad_shapes():
    with pytest.raises(QuantizationError, match="multiple of 256"):
        q4_k_decode(np.zeros((1, 144), np.uint8), 1, 128)
    with pytest.raises(QuantizationError, match="blocks"):
        q4_k_decode(np.zeros((2, 144), np.uint8), 1, 256)


# ---------------------------------------------------------------------------------------- the modules
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_linear_matches_its_effective_weight_and_is_batch_invariant(kind):
    torch.manual_seed(0)
    weight = torch.randn(48, 128) * 0.05
    bias = torch.randn(48)
    module = (
        Int4Linear(*quantize_int4(weight), bias)
        if kind == "int4"
        else Int8Linear(*quantize_int8(weight), bias)
    )
    w = effective_weight(module)
    rel = (w - weight).abs().max() / weight.abs().max()
    assert rel < (0.1 if kind == "int4" else 0.01)
    x = torch.randn(9, 128)
    y = module(x)
    x16 = x.to(torch.bfloat16).float()  # the kernels read bfloat16 inputs
    assert torch.allclose(y, x16 @ w.t() + bias, atol=2e-2, rtol=2e-2)
    rows = torch.cat([module(x[i : i + 1]) for i in range(9)])
    assert torch.equal(rows, y), "row i of a 9-row product must be bitwise the 1-row product"
    assert module(x.reshape(3, 3, 128)).shape == (3, 3, 48)


def test_int4_rejects_shapes_the_kernel_cannot_take():
    with pytest.raises(QuantizationError, match="divisible by 32"):
        quantize_int4(torch.randn(16, 40))


# ------------------------------------------------------------------------------------ batch invariance
def _row_logits_match(model, prompt, rows, mask_rows=None):
    """Logits of ``rows`` extra tokens forwarded together vs one at a time on the same cache; with
    ``mask_rows`` (per row: the new rows it may see) the block uses a tree mask and each row is replayed
    alone on the cache of its own ancestors (what autoregressive decoding of that path would hold)."""
    ctx = len(prompt)
    with torch.inference_mode():
        cache = new_cache(model)
        forward_logits(model, prompt, range(ctx), cache, "cpu", keep=1)
        ids = [(7 * j + 11) % 250 for j in range(rows)]
        if mask_rows is None:
            block = forward_logits(model, ids, range(ctx, ctx + rows), cache, "cpu")
            keep_entries(cache, ctx, [])
            single = [forward_logits(model, ids[j : j + 1], [ctx + j], cache, "cpu")[0] for j in range(rows)]
            return block, torch.stack(single)
        allowed = np.zeros((rows, rows), dtype=bool)
        for j, seen in enumerate(mask_rows):
            allowed[j, seen] = True
        depth = [len(seen) - 1 for seen in mask_rows]
        mask = tree_attention_mask(ctx, allowed, torch.float32, torch.device("cpu"))
        block = forward_logits(model, ids, [ctx + d for d in depth], cache, "cpu", mask=mask)
        keep_entries(cache, ctx, [])
        single = []
        for seen in mask_rows:  # the path to this row, decoded one token at a time
            for k, j in enumerate(seen):
                out = forward_logits(model, ids[j : j + 1], [ctx + k], cache, "cpu")[0]
            single.append(out)
            keep_entries(cache, ctx, [])
        return block, torch.stack(single)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_integer_formats_are_batch_invariant_end_to_end(fmt):
    pair = load_pair("tiny", weights=fmt, device="cpu")
    prompt = pair.encode("def main():")
    for model in (pair.target, pair.draft):
        block, single = _row_logits_match(model, prompt, 8)
        assert torch.equal(block, single)
        tree = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]  # root 0; 1, 2 children of 0; 3 of 1; 4 of 2
        block, single = _row_logits_match(model, prompt, 5, tree)
        assert torch.equal(block, single)


@pytest.mark.parametrize("masked", [False, True])
def test_rowwise_attention_is_row_exact_and_sdpa_is_the_negative_control(masked):
    """Attention alone, 8 query rows over 100 keys (causal, or a tree mask): the row-wise function gives
    each row bitwise what a one-row call over that row's keys gives; PyTorch's SDPA over all rows at once
    (transformers' default) does not."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    q, kv = torch.randn(1, 4, 8, 64), 100
    key, value = torch.randn(1, 2, kv, 64), torch.randn(1, 2, kv, 64)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    seen = [
        list(range(kv - 8)) + [kv - 8 + a for a in range(j + 1) if not masked or a % 2 == j % 2]
        for j in range(8)
    ]
    allowed = torch.zeros(8, kv, dtype=torch.bool)
    for j, keys in enumerate(seen):
        allowed[j, keys] = True
    mask = torch.zeros(1, 1, 8, kv).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    one_row = torch.cat(
        [
            rowwise_attention(module, q[:, :, j : j + 1], key[:, :, keys], value[:, :, keys], None)[0]
            for j, keys in enumerate(seen)
        ],
        dim=1,
    )
    rowwise = rowwise_attention(module, q, key, value, mask if masked else None)[0]
    assert torch.equal(rowwise, one_row)
    sdpa = sdpa_attention_forward(module, q, key, value, mask)[0]
    assert torch.allclose(sdpa, one_row, atol=1e-5)
    assert not torch.equal(sdpa, one_row)


# ------------------------------------------------------------------------------------ greedy exactness
CONTROLLERS = [
    StaticController(1, 1),
    StaticController(3, 3),
    StaticController(4, 2),
    StaticController(3, 6, tree_width=2),
    StaticController(2, 8, tree_width=4),
    HeuristicController(),
]


@pytest.mark.parametrize(
    "formats", [("int4", None), ("int8", None), ("int4", "int4-strict"), ("int8", "float32")]
)
def test_greedy_speculative_equals_autoregressive_on_integer_formats(formats, prompts):
    weights, draft_weights = formats
    pair = load_pair("tiny", weights=weights, draft_weights=draft_weights, device="cpu")
    assert pair.weights == weights and pair.draft_weights == (draft_weights or weights)
    assert_greedy_identity(pair, prompts, CONTROLLERS)


def test_precision_labels_the_pair():
    assert load_pair("tiny", weights="int4", device="cpu").precision == "int4"
    assert load_pair("tiny", weights="int4", draft_weights="int8", device="cpu").precision == "int4+int8"
    assert load_pair("tiny", dtype=torch.float64, device="cpu").precision == "float64"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weights="int3"), "unknown weight format 'int3'"),
        (dict(weights="int4", draft_weights="q4"), "unknown weight format 'q4'"),
        (dict(weights="int4", device="cuda"), "CPU only"),
    ],
)
def test_bad_weight_formats_are_refused(kwargs, match):
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=match):
        load_pair("tiny", **kwargs)


# ------------------------------------------------------------------------------------ cache and errors


@pytest.fixture()
def small_gguf(tmp_path):
    """A GGUF with one layer's worth of linears in three types (Q4_K, Q8_0, F32)."""
    rng = np.random.default_rng(3)
    q8 = gguf.quants.quantize(
        rng.standard_normal((64, 256)).astype(np.float32) * 0.05, gguf.GGMLQuantizationType.Q8_0
    )
    path = tmp_path / "m.gguf"
    write_gguf(
        path,
        [
            ("blk.0.attn_q.weight", random_q4_k(256, 256), gguf.GGMLQuantizationType.Q4_K),
            ("blk.0.ffn_down.weight", q8, gguf.GGMLQuantizationType.Q8_0),
            (
                "blk.0.attn_norm.weight",
                rng.standard_normal(256).astype(np.float32),
                gguf.GGMLQuantizationType.F32,
            ),
        ],
    )
    return path


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.q_proj = torch.nn.Linear(256, 256, bias=True)
        self.mlp = torch.nn.Module()
        self.mlp.down_proj = torch.nn.Linear(256, 64, bias=False)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Layer()])


def test_gguf_conversion_cache_roundtrip_and_rebuild(small_gguf, tmp_path):
    names = {lin.module: lin.qtype for lin in gguf_linears(small_gguf)}
    assert names == {"model.layers.0.self_attn.q_proj": "Q4_K", "model.layers.0.mlp.down_proj": "Q8_0"}
    path = ensure_quantized_gguf(small_gguf, "m", "abc", "int4", tmp_path / "cache", progress=False)
    stamp = json.loads((path / QUANT_STAMP).read_text())
    assert stamp["modules"]["model.layers.0.self_attn.q_proj"]["kind"] == "int4"  # Q4_K codes kept
    assert stamp["modules"]["model.layers.0.mlp.down_proj"]["kind"] == "int8"  # 8-bit source: int8
    weights = path / "weights.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_quantized_gguf(small_gguf, "m", "abc", "int4", tmp_path / "cache", progress=False) == path
    assert weights.stat().st_mtime_ns == mtime, "a valid cache must be reused, not rebuilt"

    model = _Model()
    bias = model.model.layers[0].self_attn.q_proj.bias.detach().clone()
    load_quantized(model, path)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Int4Linear) and torch.equal(q_proj.bias, bias)
    reference = {lin.module: lin.dequantize() for lin in gguf_linears(small_gguf)}
    err = (effective_weight(q_proj) - reference["model.layers.0.self_attn.q_proj"]).abs().max()
    assert err < 0.01 * reference["model.layers.0.self_attn.q_proj"].abs().max()

    weights.write_bytes(weights.read_bytes()[:100])  # truncated by a crash
    with pytest.raises(QuantizationError, match="unreadable"):
        load_quantized(_Model(), path)
    # another source digest invalidates the cache: it is rebuilt, and readable again
    rebuilt = ensure_quantized_gguf(small_gguf, "m", "def", "int4", tmp_path / "cache", progress=False)
    load_quantized(_Model(), rebuilt)


def test_unknown_gguf_type_names_the_tensor_and_type(tmp_path):
    path = tmp_path / "iq.gguf"
    raw = np.zeros((8, 66), dtype=np.uint8)  # one IQ2_XXS block (66 bytes) per row of 256
    write_gguf(path, [("blk.0.attn_k.weight", raw, gguf.GGMLQuantizationType.IQ2_XXS)])
    with pytest.raises(QuantizationError, match=r"blk\.0\.attn_k\.weight.*IQ2_XXS"):
        ensure_quantized_gguf(path, "iq", "abc", "int8", tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache" / "quant" / "iq" / "int8").exists(), "a failed conversion leaves no cache"


def test_integer_formats_listed():
    assert set(INTEGER_FORMATS) == {"int8", "int4", "int4-strict", "kquant", "kquant-strict"}


# ------------------------------------------------------------------------------- restricted draft head
@pytest.mark.parametrize(
    "formats",
    [dict(weights="int4"), dict(weights="int4", draft_weights="float32"), dict(dtype=torch.float64)],
)
def test_restricted_draft_head_keeps_greedy_exactness(formats, prompts):
    pair = load_pair("tiny", device="cpu", draft_vocab=160, **formats)
    head = pair.draft.lm_head
    # ids 0..159, EOS (256), then 160..174 to a multiple of 16 rows
    assert head.out_features == pair.vocab_size == 272 and head.keep.tolist() == list(range(175)) + [256]
    assert pair.precision.endswith("-dv160")
    engine = SpeculativeEngine(pair)
    for prompt in prompts:
        ids = pair.encode(prompt)
        ar = engine.generate(ids, max_new_tokens=24)
        for controller in CONTROLLERS[:4]:
            assert engine.generate(ids, max_new_tokens=24, controller=controller).tokens == ar.tokens, (
                controller
            )
    with torch.inference_mode():
        logits = pair.draft(torch.tensor([pair.encode("abc")])).logits[0]
    outside = torch.ones(272, dtype=torch.bool)
    outside[head.keep] = False
    assert torch.all(logits[:, outside] == head.MASKED_LOGIT) and torch.isfinite(logits).all()


def test_bad_draft_vocab_is_refused():
    with pytest.raises(ValueError, match="draft vocabulary size"):
        load_pair("tiny", weights="int4", device="cpu", draft_vocab=10**6)


# ---------------------------------------------------------------------------------------- command line
def test_generate_cli_takes_weight_formats_and_depth_zero(capsys):
    from generate import main

    rc = main(
        [
            "--pair",
            "tiny",
            "--prompt",
            "hi",
            "--weights",
            "int4",
            "--draft-weights",
            "int8",
            "--draft-vocab",
            "200",
            "--depth",
            "0",
            "--max-new-tokens",
            "6",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "weights=int4+int8-dv200" in out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--weights", "int3"], "unknown weight format 'int3'"),
        (["--draft-vocab", "100000"], "draft vocabulary size"),
    ],
)
def test_generate_cli_refuses_bad_formats_with_one_error_line(argv, match, capsys):
    from generate import main

    rc = main(["--pair", "tiny", "--prompt", "hi", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and match in err
