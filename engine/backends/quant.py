"""Quantized execution on the CPU: the GGUF weights run through torch's weight-only integer kernels.

Weight formats (``WEIGHT_FORMATS``) of a model's linear layers (attention and MLP projections, the LM head):

* ``float32`` -- dense float32, the GGUF blocks dequantised exactly (the converted checkpoint as is).
* ``bfloat16`` -- dense bfloat16 weights and activations (the dequantised values rounded to 8 mantissa bits).
* ``int8`` -- int8 codes with one scale per output channel (``aten._weight_int8pack_mm``), symmetric
  round-to-nearest from the dequantised weights: lossy for every GGUF type (their block scales vary along
  the input dimension, a per-channel scale cannot).
* ``int4`` -- 4-bit codes with a scale and zero per 32 inputs (``aten._weight_int4pack_mm_for_cpu``,
  ``w = (code - 8) * scale + zero``). A Q4_K block is this layout: each 32-weight sub-block is
  ``d * sc * code - dmin * m`` with a 4-bit code, so Q4_K tensors keep every code; only the scale
  ``d * sc`` and the zero ``8 * scale - dmin * m`` are rounded (to bfloat16, below). Tensors the GGUF
  stores with more bits (Q5_0, Q6_K, Q8_0) go to int8 instead: the int4 kernel's smallest group is 32 and
  Q6_K scales change every 16 weights, so no 4-bit layout holds them, and rounding them to 4 bits would
  throw away precision the GGUF's authors chose to keep (``int4-strict`` forces 4 bits on every tensor
  whose shape allows it, e.g. for a cheaper draft). Models without a GGUF source (float checkpoints, the
  tiny test pair) are rounded to 4 bits per group (min..max on 16 levels) in both int4 formats.

The kernels are fast only with bfloat16 inputs (measured, torch 2.13, AVX-512 CPU, 8960 x 1536, 2
threads: int4 0.4-0.7 ms per 1-row product in bfloat16, 12-13 ms in float32 or float16, which take a
reference path), so scales are stored in bfloat16 and each quantized layer casts its input to bfloat16
and its output back: the model around the linears (embeddings, norms, attention, residual stream) keeps
the checkpoint's float32.

Both integer kernels are batch invariant (row i of an M-row product is bitwise the 1-row product), which
with the rest of the model (``check_batch_invariance``) makes greedy speculative decoding token-identical
to autoregressive decoding by construction, not only by measurement.

Converted weights are cached next to the float32 checkpoint (``<cache>/quant/<name>/<format>/``) as
plain 4-bit / 8-bit codes and scales in safetensors (portable: the kernel's packed layout is made at load
time), with a stamp written last; a missing or unreadable cache is rebuilt (``engine.backends.quant_cache``).
A restricted draft head is ``engine.backends.draft_head.RestrictedHead``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from engine.backends import kquant
from engine.backends.draft_head import RestrictedHead
from engine.backends.gguf import (
    SUB_BLOCK,
    QuantizationError,
    q4_k_decode,
)

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4", "int4-strict", "kquant", "kquant-strict")
INTEGER_FORMATS = ("int8", "int4", "int4-strict", "kquant", "kquant-strict")
# engine.backends.kquant: the compiled kernels (engine.backends.native)
KQUANT_FORMATS = ("kquant", "kquant-strict")
KERNEL_DTYPE = torch.bfloat16  # the integer kernels' activation and scale dtype (their fast path)
GROUP_SIZE = SUB_BLOCK  # int4 quantisation group along the input dimension (a Q4_K sub-block)
INNER_K_TILES = 8  # the CPU packing's k-tiling (any of 2, 4, 8; the kernel reads what the packing wrote)


# ----------------------------------------------------------------------------------------------- modules
class _IntegerLinear(nn.Module):
    """``y = x @ W.T + b`` through a weight-only integer kernel: the input cast to bfloat16 (the kernels'
    fast path), the output back to the input's dtype, the bias added in float32."""

    in_features: int
    out_features: int

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(_IntegerLinear):
    """``y = x @ W.T + b`` with W held as 4-bit codes and a bfloat16 scale and zero per 32 inputs."""

    def __init__(self, codes: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None):
        """``codes``: uint8 [N, K] in 0..15; ``scales_zeros``: [K / 32, N, 2] (scale, zero)."""
        super().__init__()
        n, k = codes.shape
        _check_int4_shape(n, k, "Int4Linear")
        self.in_features, self.out_features = k, n
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), INNER_K_TILES
        )
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", _aligned(scales_zeros.to(KERNEL_DTYPE)))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_zeros)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP_SIZE}"


class Int8Linear(_IntegerLinear):
    """``y = x @ W.T + b`` with W held as int8 codes and one bfloat16 scale per output channel."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", _aligned(codes.to(torch.int8)))
        self.register_buffer("scales", _aligned(scales.to(KERNEL_DTYPE)))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, per-channel"


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy from torch's allocator (64-byte aligned). Tensors read from safetensors can
    sit at any offset of the file's buffer, and the int8 kernel's vector loads then crash the process
    (measured: a segmentation fault at a pointer 56 bytes off a 64-byte boundary)."""
    return t.clone(memory_format=torch.contiguous_format)


def _int4_ok(n: int, k: int) -> bool:
    """Shapes the int4 packing takes: in_features a multiple of the group, out_features of 16."""
    return k % GROUP_SIZE == 0 and n % 16 == 0


def _check_int4_shape(n: int, k: int, name: str) -> None:
    if not _int4_ok(n, k):
        raise QuantizationError(
            f"{name}: int4 needs in_features divisible by {GROUP_SIZE} and out_features by 16, got [{n}, {k}]"
        )


# ------------------------------------------------------------------------------------ quantisers (float)
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (codes int8 [N, K], scales bfloat16 [N]); codes are rounded
    against the bfloat16 scale the kernel uses; an all-zero row gets scale 1 (codes 0)."""
    w = weight.detach().to(torch.float64)
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(KERNEL_DTYPE)
    codes = torch.round(w / scales.to(torch.float64)[:, None]).clamp_(-128, 127).to(torch.int8)
    return codes, scales


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine round-to-nearest 4-bit per group of 32 inputs (min..max of the group on 16 levels):
    (codes uint8 [N, K], scales_zeros bfloat16 [K / 32, N, 2]); codes are rounded against the bfloat16
    scale and zero the kernel uses."""
    n, k = weight.shape
    _check_int4_shape(n, k, "quantize_int4")
    w = weight.detach().to(torch.float64).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi)).to(KERNEL_DTYPE)
    zero = (lo + 8.0 * scale.to(torch.float64)).to(
        KERNEL_DTYPE
    )  # code * scale + lo = (code - 8) * scale + zero
    s64, z64 = scale.to(torch.float64)[..., None], zero.to(torch.float64)[..., None]
    codes = torch.round((w - z64) / s64 + 8.0).clamp_(0, 15)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
    return codes.reshape(n, k).to(torch.uint8), scales_zeros


def effective_weight(module: nn.Module) -> torch.Tensor:
    """The float32 weight [N, K] a (quantized or dense) linear layer actually applies, read back through
    its own kernel (identity input, exact in bfloat16), so that error reports measure what runs."""
    if isinstance(module, nn.Linear):
        return module.weight.detach().to(torch.float32)
    eye = torch.eye(module.in_features, dtype=torch.float32)
    bias = module.bias
    module.bias = None
    try:
        out = module(eye)  # [K, N]: row i = W[:, i]
    finally:
        module.bias = bias
    return out.t().contiguous()


# ------------------------------------------------------------------------------------- GGUF Q4_K -> int4
def q4_k_to_int4(blocks: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K blocks -> the int4 kernel's (codes uint8 [rows, cols], scales_zeros bfloat16 [cols / 32, rows,
    2]) with ``(code - 8) * scale + zero ~= scale * code - min``: the GGUF's codes unchanged, scale and
    zero ``8 * scale - min`` rounded to bfloat16 for the kernel."""
    codes, scale, mins = q4_k_decode(blocks, rows, cols)
    zero = (8.0 * scale.astype(np.float64) - mins.astype(np.float64)).astype(np.float32)
    scales_zeros = torch.from_numpy(np.stack([scale, zero], axis=-1).transpose(1, 0, 2).copy()).to(
        KERNEL_DTYPE
    )
    return torch.from_numpy(codes), scales_zeros


# -------------------------------------------------------------------------------------- conversion
FLOAT_SOURCES = ("float32", "float16", "bfloat16", "float64", "F32", "F16", "BF16")
"""Source types without block quantisation: ``int4`` rounds them to 4 bits (nothing finer to keep)."""


def quantized_state(
    linears: Iterator[
        tuple[
            str,
            str,
            int,
            int,
            Callable[[], tuple[torch.Tensor, torch.Tensor]] | None,
            Callable[[], torch.Tensor],
        ]
    ],
    fmt: str,
) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Quantize linear weights to ``fmt``. ``linears`` yields (module name, source type, N, K, exact int4
    converter or None, float32 weight getter). Returns safetensors-ready tensors and per-module info
    (kind, source type, max |error| and mean relative error of the applied weight, in exact arithmetic,
    against the float32 weight)."""
    if fmt not in INTEGER_FORMATS:
        raise QuantizationError(
            f"not an integer format: {fmt!r} (integer formats: {', '.join(INTEGER_FORMATS)})"
        )
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, dict] = {}
    for module, qtype, n, k, exact_int4, dense in linears:
        reference = dense()  # dequantised once: the source of the rounding and the error reference
        if fmt in KQUANT_FORMATS:
            kind, fields, applied = _kquant_fields(
                qtype, exact_int4, reference, strict=fmt == "kquant-strict"
            )
            for field, t in fields.items():
                tensors[f"{module}.{kind}_{field}"] = t
            reference = reference.double().numpy()
            err = np.abs(applied - reference)
            info[module] = {
                "kind": kind,
                "source": qtype,
                "shape": [n, k],
                "max_abs_error": float(err.max()),
                "mean_rel_error": float(err.mean() / max(float(np.abs(reference).mean()), 1e-30)),
            }
            continue
        if fmt in ("int4", "int4-strict") and exact_int4 is not None and _int4_ok(n, k):
            codes, sz = exact_int4()
            kind = "int4"
        elif (fmt == "int4-strict" or qtype in FLOAT_SOURCES or qtype == "Q4_K") and _int4_ok(n, k):
            # (a Q4_K source without its blocks: random weights laid out as a published file)
            codes, sz = quantize_int4(reference)
            kind = "int4"
        else:
            codes, sz = quantize_int8(reference)
            kind = "int8"
        if kind == "int4":
            packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()  # two codes a byte, low first
            tensors[f"{module}.codes4"], tensors[f"{module}.scales_zeros"] = packed, sz
            s64, z64 = (sz[..., i].double().t().repeat_interleave(GROUP_SIZE, dim=1) for i in (0, 1))
            applied = (codes.double() - 8.0) * s64 + z64
        else:
            tensors[f"{module}.codes8"], tensors[f"{module}.scales"] = codes, sz
            applied = codes.double() * sz.double()[:, None]
        reference = reference.double()
        err = (applied - reference).abs()
        info[module] = {
            "kind": kind,
            "source": qtype,
            "shape": [n, k],
            "max_abs_error": float(err.max()),
            "mean_rel_error": float(err.mean() / reference.abs().mean().clamp_min(1e-30)),
        }
    return tensors, info


def _kquant_fields(
    qtype: str, exact: Callable[[], tuple] | None, reference: torch.Tensor, strict: bool
) -> tuple[str, dict[str, torch.Tensor], np.ndarray]:
    """One tensor in a kquant format: (layout "k4"/"k6", its tensors, the float64 weights it applies).
    ``exact``: the GGUF blocks' own conversion (Q4_K -> k4, Q6_K -> k6), None for other sources."""
    if exact is not None and qtype == "Q4_K":
        codes, meta = exact()
        return "k4", {"codes": codes, "meta": meta}, kquant.unpack_k4(codes, meta, reference.shape[1])
    if exact is not None and qtype == "Q6_K" and not strict:
        lo, hi, meta = exact()
        return "k6", {"lo": lo, "hi": hi, "meta": meta}, kquant.unpack_k6(lo, hi, meta, reference.shape[1])
    if strict or qtype == "Q4_K":  # a Q4_K source without its blocks (random weights): rounded to k4
        codes, meta = kquant.quantize_k4(reference)
        return "k4", {"codes": codes, "meta": meta}, kquant.unpack_k4(codes, meta, reference.shape[1])
    lo, hi, meta = kquant.quantize_k6(reference)
    return "k6", {"lo": lo, "hi": hi, "meta": meta}, kquant.unpack_k6(lo, hi, meta, reference.shape[1])


def build_module(
    state: dict[str, torch.Tensor],
    module: str,
    bias: torch.Tensor | None,
    rows: torch.Tensor | None = None,
    in_features: int | None = None,
) -> nn.Module:
    """The quantized module ``module`` from cached tensors; ``rows``: keep only these output rows (a
    restricted LM head, ``RestrictedHead``); ``in_features``: the layer's input width (the kquant layouts
    store whole blocks of 128 inputs)."""
    if rows is not None:
        bias = None if bias is None else bias[rows]
    if f"{module}.codes4" in state:
        packed, sz = state[f"{module}.codes4"], state[f"{module}.scales_zeros"]
        if rows is not None:
            packed, sz = packed[rows], sz[:, rows]
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        return Int4Linear(codes, sz, bias)
    for kind, fields in (("k4", ("codes", "meta")), ("k6", ("lo", "hi", "meta"))):
        if f"{module}.{kind}_meta" in state:
            tensors = {f: state[f"{module}.{kind}_{f}"] for f in fields}
            if rows is not None:
                tensors = {f: t[rows] for f, t in tensors.items()}
            if in_features is None:
                raise QuantizationError(f"{module}: a kquant layer needs its input width")
            return kquant.KQuantLinear(kind, tensors, in_features, bias)
    if f"{module}.codes8" in state:
        codes, scales = state[f"{module}.codes8"], state[f"{module}.scales"]
        if rows is not None:
            codes, scales = codes[rows], scales[rows]
        return Int8Linear(codes, scales, bias)
    raise QuantizationError(f"no quantized weights for {module}")


def replace_linears(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    modules: list[str],
    head_rows: torch.Tensor | None = None,
) -> None:
    """Swap each named ``nn.Linear`` of ``model`` for its quantized module (bias kept, float32);
    ``head_rows``: the LM head keeps only these tokens (``RestrictedHead``)."""
    for name in modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        if not isinstance(old, nn.Linear):
            raise QuantizationError(f"{name} is a {type(old).__name__}, not a Linear")
        rows = head_rows if name == "lm_head" else None
        new = build_module(state, name, old.bias, rows, old.in_features)
        if rows is not None:
            new = RestrictedHead(new, rows, old.out_features)
        if (new.out_features, new.in_features) != (old.out_features, old.in_features):
            raise QuantizationError(
                f"{name}: quantized weight is [{new.out_features}, {new.in_features}], the model's "
                f"[{old.out_features}, {old.in_features}]"
            )
        setattr(parent, child, new)


def linear_names(model: nn.Module) -> list[str]:
    """The linear layers a weight format applies to: every ``nn.Linear`` (projections and the LM head)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantize_model(
    model: nn.Module,
    fmt: str,
    head_rows: torch.Tensor | None = None,
    source_types: dict[str, str] | None = None,
) -> dict[str, dict]:
    """Quantize ``model``'s linear layers in place from their current float weights (round to nearest;
    models without a GGUF source, e.g. the tiny test pair). ``source_types``: module name -> the GGUF block
    type the module would have in a published file (kquant then picks the layout that type converts to:
    Q4_K -> k4, others k6; ``engine.backends.random_pair``). Returns per-module info with max errors."""
    names = linear_names(model)
    types = source_types or {}

    def source():
        for name in names:
            w = model.get_submodule(name).weight
            yield (
                name,
                types.get(name, str(w.dtype).removeprefix("torch.")),
                w.shape[0],
                w.shape[1],
                None,
                (lambda w=w: w.detach().float()),
            )

    state, info = quantized_state(source(), fmt)
    model.to(torch.float32)
    replace_linears(model, state, names, head_rows)
    return info


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a forward reads: linear weights/codes/scales, norms, biases (embeddings excluded:
    a forward reads only the rows of its tokens)."""
    total = 0
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in embeddings or t.dtype == torch.int64:
            continue
        total += t.numel() * t.element_size()
    return total
