"""K-quant weights run as stored: the GGUF's Q4_K and Q6_K blocks through the project's compiled kernels
(``engine/backends/csrc/kquant.cpp``, built by ``engine.backends.native``).

Two layouts, both in blocks of 128 inputs (half a GGUF super-block, so models whose width is not a
multiple of 256 fit too), each output row a run of blocks:

* ``k4`` -- 4-bit codes, per 32 inputs a 6-bit scale ``sc`` and min ``m``, per block fp16 ``d`` and
  ``dmin``: ``w = d * sc * code - dmin * m``. A Q4_K super-block is two k4 blocks (same ``d``/``dmin``),
  codes and 6-bit scales moved, not rounded: the weights are the file's, bit for bit.
* ``k6`` -- 6-bit codes (4 low bits + 2 high bits, packed), per 16 inputs an int8 scale, per block fp16
  ``d``: ``w = d * sc * (code - 32)``. A Q6_K super-block is two k6 blocks, bit for bit.

Activations are quantised per row to int8 per 128 inputs (``d = max|x| / 127``, round half to even) and
every product is an integer dot product scaled once per block, as llama.cpp computes its K-quant products
(its activation blocks are 256 wide). Each output is computed by one thread with the same operations
whatever the number of rows, so the products are batch invariant by construction.

Tensors of other GGUF types, and float weights (models without a GGUF source), are rounded to nearest into
k6 (``kquant``: Q5_0, Q8_0 and float sources keep 6 bits) or k4 (``kquant-strict``: 4 bits everywhere).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

QB = 128  # inputs per block
K4_META = 12  # fp16 d, fp16 dmin, sc[4], m[4]
K6_META = 10  # fp16 d, int8 sc[8]


def blocks(k: int) -> int:
    return -(-k // QB)


def _pad(w: np.ndarray) -> np.ndarray:
    """Zero-pad the input dimension to whole blocks."""
    n, k = w.shape
    kp = blocks(k) * QB
    return w if kp == k else np.pad(w, ((0, 0), (0, kp - k)))


# ------------------------------------------------------------------------------------------------ k4
def pack_k4(
    codes: np.ndarray, d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """k4 tensors from fields: codes uint8 [N, Kp] (0..15), d/dmin float16 [N, nb], sc/m uint8 [N, nb, 4]."""
    n, kp = codes.shape
    nb = kp // QB
    c = codes.reshape(n, nb, 2, 64).astype(np.uint8)
    packed = (c[:, :, 0] | (c[:, :, 1] << 4)).astype(np.uint8)  # byte i: input i (low), 64 + i (high)
    meta = np.empty((n, nb, K4_META), dtype=np.uint8)
    meta[:, :, 0:2] = d.astype(np.float16).reshape(n, nb, 1).view(np.uint8)
    meta[:, :, 2:4] = dmin.astype(np.float16).reshape(n, nb, 1).view(np.uint8)
    meta[:, :, 4:8] = sc
    meta[:, :, 8:12] = m
    return torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(meta)


def unpack_k4(codes: torch.Tensor, meta: torch.Tensor, k: int) -> np.ndarray:
    """The float64 weights [N, K] a k4 layer applies (exact: fp16 x small integers)."""
    packed, mt = codes.numpy(), meta.numpy()
    n, nb = mt.shape[0], mt.shape[1]
    q = np.stack([packed & 0xF, packed >> 4], axis=2).reshape(n, nb * QB).astype(np.float64)
    d = mt[:, :, 0:2].copy().view(np.float16).astype(np.float64)  # [n, nb, 1]
    dmin = mt[:, :, 2:4].copy().view(np.float16).astype(np.float64)
    scale = np.repeat((d * mt[:, :, 4:8]).reshape(n, nb * 4), 32, axis=1)
    mins = np.repeat((dmin * mt[:, :, 8:12]).reshape(n, nb * 4), 32, axis=1)
    return (scale * q - mins)[:, :k]


def q4_k_to_k4(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q4_K blocks of a [rows, cols] tensor -> k4 tensors, every field moved unchanged."""
    from engine.backends.gguf import QK_K, q4_k_fields

    codes, d, dmin, sc, mn = q4_k_fields(raw, rows, cols)
    nb2 = cols // QK_K  # super-blocks per row
    d2 = np.repeat(d.reshape(rows, nb2), 2, axis=1)
    dmin2 = np.repeat(dmin.reshape(rows, nb2), 2, axis=1)
    return pack_k4(codes, d2, dmin2, sc.reshape(rows, nb2 * 2, 4), mn.reshape(rows, nb2 * 2, 4))


def quantize_k4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest k4 of float weights [N, K]: per 32 inputs the range [min(w, 0), max(w)] on 16 levels,
    its scale and min as 6-bit multiples of the block's fp16 ``d`` / ``dmin``; codes rounded against the
    stored scales."""
    w = _pad(weight.detach().to(torch.float64).numpy())
    n, kp = w.shape
    nb = kp // QB
    g = w.reshape(n, nb, 4, 32)
    lo = np.minimum(g.min(axis=3), 0.0)  # the min term is -dmin * m <= 0
    hi = np.maximum(g.max(axis=3), lo)
    scale, mins = (hi - lo) / 15.0, -lo
    d = (scale.max(axis=2) / 63.0).astype(np.float16).astype(np.float64)
    dmin = (mins.max(axis=2) / 63.0).astype(np.float16).astype(np.float64)
    sc = np.where(d[..., None] > 0, np.rint(scale / np.where(d > 0, d, 1.0)[..., None]), 0).clip(0, 63)
    m = np.where(dmin[..., None] > 0, np.rint(mins / np.where(dmin > 0, dmin, 1.0)[..., None]), 0).clip(0, 63)
    s_eff, m_eff = d[..., None] * sc, dmin[..., None] * m
    codes = np.where(
        s_eff[..., None] > 0, np.rint((g + m_eff[..., None]) / np.where(s_eff > 0, s_eff, 1.0)[..., None]), 0
    ).clip(0, 15)
    return pack_k4(codes.reshape(n, kp).astype(np.uint8), d, dmin, sc.astype(np.uint8), m.astype(np.uint8))


# ------------------------------------------------------------------------------------------------ k6
def pack_k6(
    codes: np.ndarray, d: np.ndarray, sc: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k6 tensors from fields: codes uint8 [N, Kp] (0..63), d float16 [N, nb], sc int8 [N, nb, 8]."""
    n, kp = codes.shape
    nb = kp // QB
    c = codes.reshape(n, nb, 4, 32).astype(np.uint8)  # quarters: inputs 0-31, 32-63, 64-95, 96-127
    low = c & 0xF
    lo = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    h = c >> 4
    hi = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    meta = np.empty((n, nb, K6_META), dtype=np.uint8)
    meta[:, :, 0:2] = d.astype(np.float16).reshape(n, nb, 1).view(np.uint8)
    meta[:, :, 2:10] = sc.astype(np.int8).view(np.uint8)
    return (
        torch.from_numpy(np.ascontiguousarray(lo.astype(np.uint8))),
        torch.from_numpy(np.ascontiguousarray(hi.astype(np.uint8))),
        torch.from_numpy(meta),
    )


def unpack_k6(lo: torch.Tensor, hi: torch.Tensor, meta: torch.Tensor, k: int) -> np.ndarray:
    """The float64 weights [N, K] a k6 layer applies."""
    lo, hi, mt = lo.numpy(), hi.numpy(), meta.numpy()
    n, nb = mt.shape[0], mt.shape[1]
    low = np.stack([lo & 0xF, lo >> 4], axis=2).reshape(n, nb, 128)  # inputs 0..63 then 64..127
    high = np.stack([(hi >> s) & 3 for s in (0, 2, 4, 6)], axis=2).reshape(n, nb, 128)
    q = (low | (high << 4)).astype(np.float64) - 32.0
    d = mt[:, :, 0:2].copy().view(np.float16).astype(np.float64)
    sc = mt[:, :, 2:10].copy().view(np.int8).astype(np.float64)
    scale = np.repeat(d * sc, 16, axis=2)
    return (scale * q).reshape(n, nb * QB)[:, :k]


def q6_k_to_k6(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q6_K blocks of a [rows, cols] tensor -> k6 tensors, every field moved unchanged."""
    from engine.backends.gguf import QK_K, q6_k_fields

    codes, d, sc = q6_k_fields(raw, rows, cols)
    nb2 = cols // QK_K
    return pack_k6(codes, np.repeat(d.reshape(rows, nb2), 2, axis=1), sc.reshape(rows, nb2 * 2, 8))


def quantize_k6(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest k6 of float weights [N, K]: per 16 inputs a symmetric scale ``max|w| / 31`` stored
    as an int8 multiple of the block's fp16 ``d``; codes rounded against the stored scales."""
    w = _pad(weight.detach().to(torch.float64).numpy())
    n, kp = w.shape
    nb = kp // QB
    g = w.reshape(n, nb, 8, 16)
    scale = np.abs(g).max(axis=3) / 31.0
    d = (scale.max(axis=2) / 127.0).astype(np.float16).astype(np.float64)
    sc = np.where(d[..., None] > 0, np.rint(scale / np.where(d > 0, d, 1.0)[..., None]), 0).clip(0, 127)
    s_eff = d[..., None] * sc
    codes = np.where(s_eff[..., None] > 0, np.rint(g / np.where(s_eff > 0, s_eff, 1.0)[..., None]), 0) + 32
    return pack_k6(codes.clip(0, 63).reshape(n, kp).astype(np.uint8), d, sc.astype(np.int8))


# ------------------------------------------------------------------------------------ the kernels' tiles
NT = 16  # weight rows interleaved in one tile of the kernels' layout
WIDTHS = {"codes": 64, "lo": 64, "hi": 32}  # bytes a row and block of each field (meta: K4_META / K6_META)


def _meta_fields(kind: str) -> list[tuple[int, int]]:
    """The fields of a row's meta bytes as (offset, size): k4: d, dmin, sc[4], m[4]; k6: d, sc[8]."""
    if kind == "k4":
        return [(0, 2), (2, 2)] + [(4 + i, 1) for i in range(8)]
    return [(0, 2)] + [(2 + i, 1) for i in range(8)]


def tile_tensors(kind: str, tensors: dict[str, torch.Tensor], n: int, nb: int) -> dict[str, torch.Tensor]:
    """The row layouts above -> the kernels' tiled layouts (``engine/backends/csrc/kquant.cpp``'s header): rows
    interleaved 16 at a time (the last tile zero-padded), so the 16 lanes of a vector are 16 outputs. A
    codes tile of a block is [16 quad-rows, 16 rows, 4 bytes]: byte i of quad-row r of row j is byte 4r + i
    of that row's 64 code bytes (the nibbles unchanged); the meta of a tile's block is each field of the 16
    rows in turn (d[16], dmin[16], sc[0][16], ...). Only bytes move."""
    t = -(-n // NT)
    out = {}
    for name, x in tensors.items():
        width = WIDTHS.get(name) or (K4_META if kind == "k4" else K6_META)
        x = x.to(torch.uint8).reshape(n, nb, width)
        if t * NT != n:
            x = torch.cat([x, x.new_zeros(t * NT - n, nb, width)])
        x = x.reshape(t, NT, nb, width)
        if name == "meta":
            parts = [
                x[..., o : o + k].permute(0, 2, 1, 3).reshape(t, nb, NT * k) for o, k in _meta_fields(kind)
            ]
            out[name] = torch.cat(parts, dim=2).contiguous()
        else:  # [t, 16 rows, nb, width / 4 quads, 4] -> [t, nb, quads, 16 rows, 4]
            out[name] = x.reshape(t, NT, nb, width // 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    return out


def untile_tensors(kind: str, tiled: dict[str, torch.Tensor], n: int, nb: int) -> dict[str, torch.Tensor]:
    """The inverse of ``tile_tensors``: the row layouts [n, nb, width]."""
    t = -(-n // NT)
    out = {}
    for name, x in tiled.items():
        if name == "meta":
            parts, at = [], 0
            for _, k in _meta_fields(kind):
                parts.append(x[..., at : at + NT * k].reshape(t, nb, NT, k).permute(0, 2, 1, 3))
                at += NT * k
            rows = torch.cat(parts, dim=3)
        else:
            width = WIDTHS[name]
            rows = x.reshape(t, nb, width // 4, NT, 4).permute(0, 3, 1, 2, 4).reshape(t, NT, nb, width)
        out[name] = rows.reshape(t * NT, nb, -1)[:n].contiguous()
    return out


def tiled_parts(parts, in_features: int) -> list[torch.Tensor]:
    """Row-layout tensors (k4: codes, meta; k6: lo, hi, meta) -> the kernels' tiled tensors in the same order
    (for calling the compiled products or the native decoder directly)."""
    kind, names = ("k4", ("codes", "meta")) if len(parts) == 2 else ("k6", ("lo", "hi", "meta"))
    tiled = tile_tensors(
        kind, dict(zip(names, parts, strict=True)), int(parts[0].shape[0]), blocks(in_features)
    )
    return [tiled[name] for name in names]


# -------------------------------------------------------------------------------------------- modules
class KQuantLinear(nn.Module):
    """``y = x @ W.T + b`` with W in the k4 or k6 layout, through the compiled kernels; float32 in and out.
    Built from the row layouts (what the conversion cache stores); holds the kernels' tiled layout and, as
    ``ops``, the compiled kernels it calls (``engine.backends.native.kernels``)."""

    def __init__(
        self, kind: str, tensors: dict[str, torch.Tensor], in_features: int, bias: torch.Tensor | None
    ):
        super().__init__()
        from engine.backends.native import kernels

        self.ops = kernels()  # fails here, at load, with the reason, if the kernels cannot be built
        if kind not in ("k4", "k6"):
            raise ValueError(f"unknown kquant layout {kind!r}")
        self.kind, self.in_features = kind, int(in_features)
        names = ("codes", "meta") if kind == "k4" else ("lo", "hi", "meta")
        self.out_features = int(tensors[names[0]].shape[0])
        tiled = tile_tensors(
            kind, {name: tensors[name] for name in names}, self.out_features, blocks(self.in_features)
        )
        for name in names:
            self.register_buffer(name, tiled[name])
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())

    def tiles(self) -> list[torch.Tensor]:
        """The tiled tensors in the kernels' argument order."""
        return [self.codes, self.meta] if self.kind == "k4" else [self.lo, self.hi, self.meta]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self.forward(x.float()).to(x.dtype)
        # the bias is added inside the kernel (one call: this runs ~200 times a step)
        op = self.ops.k4_matmul if self.kind == "k4" else self.ops.k6_matmul
        return op(x, *self.tiles(), self.bias, self.in_features, self.out_features)

    def row_tensors(self) -> list[torch.Tensor]:
        """The weights in the row layouts (``pack_k4`` / ``pack_k6``'s), in the kernels' argument order."""
        names = ("codes", "meta") if self.kind == "k4" else ("lo", "hi", "meta")
        rows = untile_tensors(
            self.kind,
            dict(zip(names, self.tiles(), strict=True)),
            self.out_features,
            blocks(self.in_features),
        )
        return [rows[name] for name in names]

    def weight_float64(self) -> np.ndarray:
        """The weights this layer applies, [N, K] float64 (exact)."""
        if self.kind == "k4":
            return unpack_k4(*self.row_tensors(), self.in_features)
        return unpack_k6(*self.row_tensors(), self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout={self.kind}"


def reference_matmul(x: torch.Tensor, weight: np.ndarray) -> np.ndarray:
    """What the kernels compute, in float64 (for tests): activations quantised exactly as the kernels do
    (``quantize_activations``), times the applied weights."""
    from engine.backends.native import kernels

    q, d = kernels().quantize_activations(x.reshape(-1, x.shape[-1]).float())
    k = weight.shape[1]
    xa = q.numpy().astype(np.float64).reshape(q.shape[0], -1, QB) * d.numpy().astype(np.float64)[..., None]
    return xa.reshape(q.shape[0], -1)[:, :k] @ weight.T
