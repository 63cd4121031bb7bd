"""The kquant formats (engine.backends.kquant, engine/backends/csrc/kquant.cpp): GGUF K-quant blocks moved bit for bit into
the kernels' layouts, the compiled products against a float64 reference, batch invariance, NaN propagation,
greedy exactness and the conversion cache."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from engine.backends import native
from engine.backends.gguf import gguf_linears, q6_k_fields
from engine.backends.kquant import (
    KQuantLinear,
    pack_k6,
    q4_k_to_k4,
    q6_k_to_k6,
    quantize_k4,
    quantize_k6,
    reference_matmul,
    unpack_k4,
    unpack_k6,
)
from engine.backends.models import load_pair
from engine.backends.quant_cache import QUANT_STAMP, ensure_quantized_gguf, load_quantized
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from policies.heuristic import HeuristicController
from tests_helpers import assert_greedy_identity, random_q4_k, random_q6_k, write_gguf

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(
        shutil.which("c++") is None, reason="no C++ compiler: the kquant kernels cannot be built"
    ),
]


def _module(kind: str, tensors, k: int, bias=None) -> KQuantLinear:
    names = ("codes", "meta") if kind == "k4" else ("lo", "hi", "meta")
    return KQuantLinear(kind, dict(zip(names, tensors, strict=True)), k, bias)


# ------------------------------------------------------------------------------------------ the layouts
def _k4_float32(codes: torch.Tensor, meta: torch.Tensor) -> np.ndarray:
    """k4 weights evaluated in float32 in gguf's order ((d * sc) * code - dmin * m): equal to gguf's
    dequantisation bit for bit exactly when every field was moved unchanged."""
    packed, mt = codes.numpy(), meta.numpy()
    n, nb = mt.shape[:2]
    q = np.stack([packed & 0xF, packed >> 4], axis=2).reshape(n, nb, 4, 32).astype(np.float32)
    d = mt[:, :, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = mt[:, :, 2:4].copy().view(np.float16).astype(np.float32)
    scale, mins = d * mt[:, :, 4:8].astype(np.float32), dmin * mt[:, :, 8:12].astype(np.float32)
    return (scale[..., None] * q - mins[..., None]).reshape(n, nb * 128)


def _k6_float32(lo: torch.Tensor, hi: torch.Tensor, meta: torch.Tensor) -> np.ndarray:
    """k6 weights in float32 in gguf's order (d * sc * (code - 32))."""
    lo, hi, mt = lo.numpy(), hi.numpy(), meta.numpy()
    n, nb = mt.shape[:2]
    low = np.stack([lo & 0xF, lo >> 4], axis=2).reshape(n, nb, 128)
    high = np.stack([(hi >> s) & 3 for s in (0, 2, 4, 6)], axis=2).reshape(n, nb, 128)
    q = ((low | (high << 4)).astype(np.int32) - 32).astype(np.float32).reshape(n, nb, 8, 16)
    d = mt[:, :, 0:2].copy().view(np.float16).astype(np.float32)
    sc = mt[:, :, 2:10].copy().view(np.int8).astype(np.float32)
    return ((d * sc)[..., None] * q).reshape(n, nb * 128)


def test_q4_k_blocks_move_into_k4_bit_for_bit():
    blocks = random_q4_k(16, 512)
    codes, meta = q4_k_to_k4(blocks, 16, 512)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(16, 512)
    assert np.array_equal(_k4_float32(codes, meta), reference)
    # the kernels apply the exact values (integer products, one float scale): float32 rounding apart, equal
    assert np.abs(unpack_k4(codes, meta, 512) - reference).max() <= 1e-6 * np.abs(reference).max()


def test_q6_k_blocks_move_into_k6_bit_for_bit():
    blocks = random_q6_k(16, 512)
    lo, hi, meta = q6_k_to_k6(blocks, 16, 512)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K).reshape(16, 512)
    assert np.array_equal(_k6_float32(lo, hi, meta), reference)
    assert np.abs(unpack_k6(lo, hi, meta, 512) - reference).max() <= 1e-6 * np.abs(reference).max()


def test_q6_k_negative_control_high_bit_order():
    """Reading the 2-bit planes in the wrong order (a plausible layout bug) must not match the reference."""
    blocks = random_q6_k(8, 256, seed=1)
    codes, d, sc = q6_k_fields(blocks, 8, 256)
    swapped = codes.reshape(8, 2, 4, 32)[:, :, [1, 0, 2, 3]].reshape(8, 256)  # quarters 0 and 1 exchanged
    d2, sc2 = np.repeat(d.reshape(8, 1), 2, axis=1), sc.reshape(8, 2, 8)
    wrong = _k6_float32(*pack_k6(swapped, d2, sc2))
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K).reshape(8, 256)
    assert np.array_equal(_k6_float32(*pack_k6(codes, d2, sc2)), reference)
    assert not np.allclose(wrong, reference)


@pytest.mark.parametrize("k", [128, 200, 896])
def test_round_to_nearest_quantizers_stay_within_half_a_step(k):
    torch.manual_seed(0)
    weight = torch.randn(32, k) * 0.05
    w4 = unpack_k4(*quantize_k4(weight), k)
    w6 = unpack_k6(*quantize_k6(weight), k)
    err4, err6 = np.abs(w4 - weight.double().numpy()), np.abs(w6 - weight.double().numpy())
    # 16 levels over a 32-input range (plus the 6-bit rounding of its scale), 63 levels over +-max|w| of 16
    assert err4.max() < 0.06 * float(weight.abs().max()) and err6.max() < 0.02 * float(weight.abs().max())
    assert err6.mean() < err4.mean() / 2  # 6 bits are finer than 4: the check above is not vacuous


# ---------------------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("kind", ["k4", "k6"])
@pytest.mark.parametrize("k", [128, 200, 896])
def test_kernel_matches_float64_reference_and_is_batch_invariant(kind, k):
    torch.manual_seed(1)
    weight = torch.randn(40, k) * 0.05
    bias = torch.randn(40)
    module = _module(kind, quantize_k4(weight) if kind == "k4" else quantize_k6(weight), k, bias)
    x = torch.randn(19, k)  # more rows than one tile of 8
    y = module(x)
    expected = reference_matmul(x, module.weight_float64()) + bias.double().numpy()
    assert np.abs(y.double().numpy() - expected).max() < 1e-5 * np.abs(expected).max()
    rows = torch.cat([module(x[i : i + 1]) for i in range(19)])
    assert torch.equal(rows, y), "row i of a 19-row product must be bitwise the 1-row product"
    assert torch.equal(module(x[5:8]), y[5:8])
    assert module(x.reshape(19, 1, k)).shape == (19, 1, 40)


@pytest.mark.parametrize("kind", ["k4", "k6"])
def test_prefill_sized_products_are_chunked_without_changing_a_bit(kind):
    # 600 rows of 8960 inputs: above the chunking threshold (256 rows), in chunks of 64 rows (512 KiB of
    # codes), the last one partial; every row must still be bitwise its 1-row product
    torch.manual_seed(3)
    k, m = 8960, 600
    weight = torch.randn(24, k) * 0.05
    module = _module(kind, quantize_k4(weight) if kind == "k4" else quantize_k6(weight), k, torch.randn(24))
    x = torch.randn(m, k)
    y = module(x)
    rows = torch.cat([module(x[i : i + 1]) for i in range(0, m, 37)])
    assert torch.equal(rows, y[::37])
    assert torch.equal(module(x[:200]), y[:200])  # one chunk (below the threshold) = the same rows chunked
    expected = reference_matmul(x[:16], module.weight_float64()) + module.bias.double().numpy()
    assert np.abs(y[:16].double().numpy() - expected).max() < 1e-5 * np.abs(expected).max()


MANY_ROW_COUNTS = (15, 16, 17, 63, 64, 65, 256, 257, 341)


@pytest.mark.parametrize("kind", ["k4", "k6"])
@pytest.mark.parametrize("k", [1536, 200])
def test_many_row_products_are_bitwise_the_one_row_products(kind, k):
    """Calls of 16+ rows take the block-outer kernels (AVX2: each weight block unpacked once for all rows,
    kquant.cpp: k4_tile_many) and groups of 6 rows: around every boundary (16 rows, the 6-row groups, the
    256-row chunking, a chunk of 340 rows at K = 1536) each row is bitwise its 1-row product and the 4-row
    passes' result (the build with the many-row path off). Negative control: one activation of the last row
    nudged changes that row's outputs and no other's."""
    rng = np.random.RandomState(11)
    n = 40  # two full tiles and a partial one
    weight = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    module = _module(kind, quantize_k4(weight) if kind == "k4" else quantize_k6(weight), k, bias)
    passes = native.variant("KQ_MANY_ROWS=1000000000")
    for m in MANY_ROW_COUNTS:
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        y = module(x)
        one = torch.cat([module(x[i : i + 1]) for i in range(m)])
        assert torch.equal(y, one), (kind, k, m)
        assert torch.equal(y, getattr(passes, f"{kind}_matmul")(x, *module.tiles(), bias, k, n)), (kind, k, m)
        nudged = x.clone()
        nudged[-1, 0] += 0.5 * float(x[-1].abs().max())
        z = module(nudged)
        assert torch.equal(z[:-1], y[:-1]) and not torch.equal(z[-1], y[-1]), (kind, k, m)


def test_kernel_is_independent_of_the_thread_count():
    torch.manual_seed(2)
    module = _module("k4", quantize_k4(torch.randn(96, 256) * 0.05), 256)
    x = torch.randn(3, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = module(x)
        torch.set_num_threads(2)
        two = module(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_activation_quantization_is_what_the_reference_says():
    """The negative control of the reference check: the products are of int8 activations, not of x."""
    torch.manual_seed(3)
    module = _module("k6", quantize_k6(torch.randn(16, 256) * 0.05), 256)
    x = torch.randn(2, 256)
    exact = x.double().numpy() @ module.weight_float64().T
    got = module(x).double().numpy()
    assert np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()  # int8 activations are not x


def test_non_finite_input_gives_nan_in_its_row_only():
    module = _module("k4", quantize_k4(torch.randn(16, 256) * 0.05), 256)
    x = torch.randn(3, 256)
    x[1, 7] = float("inf")
    assert torch.isnan(_module("k6", quantize_k6(torch.randn(16, 256) * 0.05), 256)(x)[1]).all()
    y = module(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


def test_kernel_refuses_bad_inputs():
    module = _module("k6", quantize_k6(torch.randn(16, 256)), 256)
    with pytest.raises(RuntimeError, match=r"input must be \[\.\.\., 256\]"):
        module.ops.k6_matmul(torch.randn(2, 128), module.lo, module.hi, module.meta, None, 256, 16)
    with pytest.raises(RuntimeError, match="bias must be"):
        module.ops.k6_matmul(torch.randn(2, 256), module.lo, module.hi, module.meta, torch.zeros(3), 256, 16)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        module.ops.k6_matmul(torch.randn(2, 256), module.lo[:, :1], module.hi, module.meta, None, 256, 16)
    with pytest.raises(RuntimeError, match="bytes, expected"):  # 17 outputs need two tiles
        module.ops.k6_matmul(torch.randn(2, 256), module.lo, module.hi, module.meta, None, 256, 17)


def test_unavailable_kernels_are_a_clear_error(monkeypatch):
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(
        native, "_error", "the compiled kquant kernels are unavailable on this machine (test)"
    )
    with pytest.raises(native.NativeUnavailable, match="unavailable"):
        _module("k4", quantize_k4(torch.randn(16, 128)), 128)
    assert not native.available()


def test_cpu_default_takes_kquant_only_with_a_simd_path(monkeypatch, capsys):
    """weights="auto" on the CPU: kquant where the kernels have an AVX-512 or AVX2 path; torch's int4 kernels
    (with a warning naming the reason) where they build only the slow portable path or not at all."""
    from engine.backends import models

    class Ops:
        def __init__(self, isa):
            self._isa = isa

        def simd(self):
            return self._isa != "portable"

        def isa(self):
            return self._isa

    monkeypatch.setattr(native, "_error", None)
    for isa in ("avx512-vnni", "avx2"):
        monkeypatch.setattr(native, "_module", Ops(isa))
        assert models.default_cpu_weights() == ("kquant", "kquant-strict")
    monkeypatch.setattr(models, "_fallback_warned", False)
    monkeypatch.setattr(native, "_module", Ops("portable"))
    assert models.default_cpu_weights() == models.FALLBACK_CPU_WEIGHTS
    assert "portable path" in capsys.readouterr().err
    monkeypatch.setattr(models, "_fallback_warned", False)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(
        native, "_error", "the compiled kquant kernels are unavailable on this machine (test)"
    )
    assert models.default_cpu_weights() == models.FALLBACK_CPU_WEIGHTS
    assert "unavailable on this machine (test)" in capsys.readouterr().err


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
    "formats", [("kquant", None), ("kquant", "kquant-strict"), ("kquant-strict", "float32")]
)
def test_greedy_speculative_equals_autoregressive_on_kquant(formats, prompts):
    weights, draft_weights = formats
    pair = load_pair("tiny", weights=weights, draft_weights=draft_weights, device="cpu")
    assert pair.precision == weights + (f"+{draft_weights}" if draft_weights else "")
    assert_greedy_identity(pair, prompts, CONTROLLERS)


def test_restricted_draft_head_on_kquant(prompts):
    pair = load_pair("tiny", weights="kquant", draft_weights="kquant-strict", draft_vocab=100, device="cpu")
    engine = SpeculativeEngine(pair)
    ids = pair.encode(prompts[0])
    ar = engine.generate(ids, max_new_tokens=24)
    assert engine.generate(ids, max_new_tokens=24, controller=StaticController(3, 3)).tokens == ar.tokens


# ------------------------------------------------------------------------------------------ the cache


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        layer.self_attn.q_proj = torch.nn.Linear(256, 256, bias=True)
        layer.self_attn.v_proj = torch.nn.Linear(256, 64, bias=False)
        layer.mlp.down_proj = torch.nn.Linear(256, 64, bias=False)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])


@pytest.mark.parametrize(
    "fmt, kinds", [("kquant", ("k4", "k6", "k6")), ("kquant-strict", ("k4", "k4", "k4"))]
)
def test_gguf_conversion_to_kquant(fmt, kinds, tmp_path):
    rng = np.random.default_rng(3)
    q8 = gguf.quants.quantize(
        rng.standard_normal((64, 256)).astype(np.float32) * 0.05, gguf.GGMLQuantizationType.Q8_0
    )
    path = tmp_path / "m.gguf"
    write_gguf(
        path,
        [
            ("blk.0.attn_q.weight", random_q4_k(256, 256), gguf.GGMLQuantizationType.Q4_K),
            ("blk.0.attn_v.weight", random_q6_k(64, 256), gguf.GGMLQuantizationType.Q6_K),
            ("blk.0.ffn_down.weight", q8, gguf.GGMLQuantizationType.Q8_0),
        ],
    )
    cache = ensure_quantized_gguf(path, "m", "abc", fmt, tmp_path / "cache", progress=False)
    modules = json.loads((cache / QUANT_STAMP).read_text())["modules"]
    names = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert tuple(modules[n]["kind"] for n in names) == kinds
    # Q4_K (and Q6_K in kquant) moved bit for bit: only the reference's own float32 rounding differs
    assert modules[names[0]]["max_abs_error"] < 1e-6 * float(
        np.abs(gguf.quants.dequantize(random_q4_k(256, 256), gguf.GGMLQuantizationType.Q4_K)).max()
    )
    if fmt == "kquant":
        assert modules[names[1]]["max_abs_error"] < 1e-7
    assert modules[names[2]]["max_abs_error"] > 1e-5  # Q8_0 re-rounded: the checks above are not vacuous
    model = _Model()
    load_quantized(model, cache)
    reference = {lin.module: lin.dequantize() for lin in gguf_linears(path)}
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, KQuantLinear)
        err = np.abs(layer.weight_float64() - reference[name].double().numpy()).max()
        assert err == modules[name]["max_abs_error"] or abs(err - modules[name]["max_abs_error"]) < 1e-12


# Fingerprint of the kernels' outputs (every path: AVX-512, AVX2, portable) on fixed inputs (sha256 of the float32 bytes). Recorded
# traces hold what these kernels computed: a change that alters any bit must increment
# engine.backends.native.KERNEL_NUMERICS (the trace caches' key) and then update this fingerprint.
KERNEL_FINGERPRINT = "0bdaec540f053436"


def _kernel_digest(ops=None) -> str:
    """The fingerprint of the products in ``ops`` (a compiled extension; default: the machine's build)."""
    import hashlib

    rng = np.random.RandomState(7)  # numpy's legacy generator: the same numbers on every machine
    digest = hashlib.sha256()
    for kind, k in (("k4", 896), ("k6", 1536), ("k4", 200)):
        weight = torch.from_numpy(rng.standard_normal((24, k)).astype(np.float32) * 0.05)
        module = _module(kind, quantize_k4(weight) if kind == "k4" else quantize_k6(weight), k)
        if ops is not None:
            module.ops = ops
        for m in (1, 3, 9):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            digest.update(module(x).numpy().tobytes())
    return digest.hexdigest()[:16]


def test_kernel_arithmetic_matches_the_recorded_fingerprint():
    assert _kernel_digest() == KERNEL_FINGERPRINT, (
        "the kernels' outputs changed: increment engine.backends.native.KERNEL_NUMERICS (recorded traces no longer "
        "match) and update KERNEL_FINGERPRINT"
    )


def _same_bits_as_the_machine_build(ops) -> None:
    """Every product of the real layers' shapes (and a ragged one) through ``ops`` equals the machine's
    build at 1-17 and 300 rows."""
    rng = np.random.RandomState(3)
    shapes = (("k4", 96, 1536), ("k6", 96, 1536), ("k4", 32, 8960), ("k6", 32, 896), ("k4", 21, 200))
    for kind, n, k in shapes:
        weight = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        module = _module(kind, quantize_k4(weight) if kind == "k4" else quantize_k6(weight), k, bias)
        for m in (1, 2, 5, 8, 9, 17, 33, 300):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            want = module(x)
            got = getattr(ops, f"{kind}_matmul")(x, *module.tiles(), bias, k, n)
            assert torch.equal(got, want), (kind, n, k, m)


def test_avx2_kernels_compute_the_avx512_bits(avx2_kernels):
    """The AVX2 path (a CPU without AVX-512 VNNI compiles it) gives the fingerprint bit for bit, and every
    product of the real layers' shapes equals the machine's build."""
    assert _kernel_digest(avx2_kernels) == KERNEL_FINGERPRINT
    _same_bits_as_the_machine_build(avx2_kernels)


def test_portable_kernels_compute_the_simd_bits(portable_kernels):
    """The portable path (a CPU without AVX2) computes the same bits too: the arithmetic is defined per
    output (exact integer sums per block, then the same float operations), not by the instructions."""
    assert _kernel_digest(portable_kernels) == KERNEL_FINGERPRINT
    _same_bits_as_the_machine_build(portable_kernels)


def test_amx_prefill_products_compute_the_vnni_bits():
    """Where the CPU has AMX (and the OS grants it), prefill-sized products (17+ rows) take tile multiplies
    for whole groups of 16 rows; the build without AMX must give the same bits at every row count."""
    if not native.kernels().amx():
        pytest.skip("no AMX here (CPU, compiler or OS)")
    _same_bits_as_the_machine_build(native.variant("KQ_NO_AMX"))


@pytest.mark.parametrize("kind", ["k4", "k6"])
@pytest.mark.parametrize("n", [1, 16, 37])
def test_tiles_only_move_bytes(kind, n):
    """The kernels' tiled layout is the row layout's bytes rearranged (rows padded to 16): back and forth
    is the identity, and a tile holds what the kernels' header says."""
    from engine.backends.kquant import tile_tensors, untile_tensors

    torch.manual_seed(n)
    parts = quantize_k4(torch.randn(n, 256)) if kind == "k4" else quantize_k6(torch.randn(n, 256))
    names = ("codes", "meta") if kind == "k4" else ("lo", "hi", "meta")
    rows = dict(zip(names, parts, strict=True))
    tiled = tile_tensors(kind, rows, n, 2)
    back = untile_tensors(kind, tiled, n, 2)
    assert all(torch.equal(back[name], rows[name].reshape(back[name].shape)) for name in names)
    first = names[0]
    # quad-row 3 of block 1 of tile 0, row 0: bytes 12..15 of row 0's codes of block 1
    assert torch.equal(tiled[first][0, 1, 3, 0], rows[first].reshape(n, 2, 64)[0, 1, 12:16])
    meta = rows["meta"].reshape(n, 2, -1)
    assert torch.equal(tiled["meta"][0, 1, 0:2], meta[0, 1, 0:2])  # the first row's fp16 d
    if n > 1:
        assert torch.equal(tiled["meta"][0, 1, 2:4], meta[1, 1, 0:2])  # the second row's d
    pad = -(-n // 16) * 16 - n
    if pad:
        assert int(tiled["meta"].reshape(-1, 2, tiled["meta"].shape[-1])[-1, :, 30:32].sum()) == 0
