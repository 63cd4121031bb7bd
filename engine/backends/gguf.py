"""The GGUF file side of the weight formats: reading a GGUF's linear weights (names, block types, lazy
float32 dequantisation) and decoding the fields of its Q4_K and Q6_K blocks, which ``engine.backends.quant``
(torch's int4 kernel) and ``engine.backends.kquant`` (the compiled kernels) lay out for their kernels."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import DraftpilotError


class QuantizationError(DraftpilotError, ValueError):
    """A tensor cannot be converted to the requested format (shape or type not supported)."""


# ------------------------------------------------------------------------------------- GGUF Q4_K blocks
Q4_K_BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of 4-bit codes
QK_K = 256  # weights per super-block
SUB_BLOCK = 32  # weights per Q4_K sub-block (one scale and min each)


def _super_blocks(blocks: np.ndarray, nbytes: int, rows: int, cols: int, qtype: str) -> np.ndarray:
    """The raw bytes of a K-quant tensor as [super-blocks, nbytes], shape-checked."""
    if cols % QK_K:
        raise QuantizationError(f"{qtype} rows must be a multiple of {QK_K} weights, got {cols}")
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, nbytes)
    if b.shape[0] != rows * cols // QK_K:
        raise QuantizationError(f"{qtype}: {b.shape[0]} blocks for a [{rows}, {cols}] tensor")
    return b


def q4_k_fields(
    blocks: np.ndarray, rows: int, cols: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks of a [rows, cols] tensor -> their fields: (codes uint8 [rows, cols] in input order,
    d float16 [blocks], dmin float16 [blocks], sc uint8 [blocks, 8], m uint8 [blocks, 8]) with
    ``weight = d * sc * code - dmin * m`` per 32-weight sub-block.

    Layout (ggml's block_q4_K): per 256 weights, fp16 ``d`` and ``dmin``, 8 pairs of 6-bit (sc, m) packed
    in 12 bytes, and 128 bytes of codes; sub-block 2j takes the low nibbles of bytes 32j..32j+31, sub-block
    2j+1 their high nibbles.
    """
    b = _super_blocks(blocks, Q4_K_BLOCK_BYTES, rows, cols, "Q4_K")
    nb = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16)[:, 0]
    dmin = b[:, 2:4].copy().view(np.float16)[:, 0]
    s = b[:, 4:16]
    sc = np.empty((nb, 8), dtype=np.uint8)
    mn = np.empty((nb, 8), dtype=np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    qs = b[:, 16:].reshape(nb, 4, 32)  # 4 groups of 32 bytes, each two sub-blocks
    codes = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(rows, cols)  # sub-block order 0..7
    return codes.astype(np.uint8), d, dmin, sc, mn


def q4_k_decode(blocks: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks of a [rows, cols] tensor -> (codes uint8 [rows, cols], scales float32 [rows, cols / 32],
    mins float32 [rows, cols / 32]) with ``weight = scale * code - min`` per 32-weight sub-block;
    ``scale = d * sc`` and ``min = dmin * m`` are exact in float32 (11 x 6 bits)."""
    codes, d, dmin, sc, mn = q4_k_fields(blocks, rows, cols)
    groups = cols // SUB_BLOCK
    scale = (d.astype(np.float32)[:, None] * sc.astype(np.float32)).reshape(rows, groups)
    mins = (dmin.astype(np.float32)[:, None] * mn.astype(np.float32)).reshape(rows, groups)
    return codes, scale, mins


Q6_K_BLOCK_BYTES = 210  # 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, fp16 d


def q6_k_fields(blocks: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K blocks of a [rows, cols] tensor -> (codes uint8 [rows, cols] in input order (0..63), d float16
    [blocks], sc int8 [blocks, 16]) with ``weight = d * sc * (code - 32)`` per 16 weights.

    Layout (ggml's block_q6_K): per 256 weights ``ql`` (128 bytes), ``qh`` (64), ``scales`` (16), fp16
    ``d``; in each half of 128 weights, byte i of its 64 ``ql`` bytes holds the low 4 bits of weight i (low
    nibble) and of weight 64 + i (high nibble), byte t of its 32 ``qh`` bytes the high 2 bits of weights
    t, t + 32, t + 64, t + 96 (bits 0-1, 2-3, 4-5, 6-7).
    """
    b = _super_blocks(blocks, Q6_K_BLOCK_BYTES, rows, cols, "Q6_K")
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 64)
    qh = b[:, 128:192].reshape(nb, 2, 32)
    sc = b[:, 192:208].copy().view(np.int8)
    d = b[:, 208:210].copy().view(np.float16)[:, 0]
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)  # [nb, 2, 128]: weights 0..63, then 64..127
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # weights t + 32 * j
    codes = (low | (high << 4)).reshape(rows, cols).astype(np.uint8)
    return codes, d, sc


# -------------------------------------------------------------------------------------- GGUF reading
GGUF_LINEAR_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip
SUPPORTED_GGUF_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


def gguf_linear_name(gguf_name: str) -> str | None:
    """The Hugging Face (Qwen2/Llama layout) module name of a GGUF linear weight, or None if it is not one."""
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in GGUF_LINEAR_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_LINEAR_NAMES[parts[2]]}"
    return None


@dataclass
class GgufLinear:
    """One linear weight of a GGUF file: its module name, type and a lazy float32 dequantisation."""

    module: str
    gguf_name: str
    qtype: str
    rows: int
    cols: int
    raw: np.ndarray

    def dequantize(self) -> torch.Tensor:
        import gguf

        if self.qtype not in SUPPORTED_GGUF_TYPES:
            raise QuantizationError(
                f"GGUF tensor {self.gguf_name}: type {self.qtype} is not supported "
                f"(supported: {', '.join(SUPPORTED_GGUF_TYPES)})"
            )
        qtype = gguf.GGMLQuantizationType[self.qtype]
        w = gguf.quants.dequantize(self.raw, qtype)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(self.rows, self.cols))


def gguf_linears(path: str | Path) -> Iterator[GgufLinear]:
    """Every linear weight of a GGUF file (Qwen2/Llama tensor names), in file order."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        module = gguf_linear_name(t.name)
        if module is None:
            continue
        cols, rows = (int(x) for x in t.shape[:2])  # GGUF lists the innermost (input) dimension first
        try:
            qtype = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        except ValueError:
            qtype = f"type id {int(t.tensor_type)}"
        yield GgufLinear(module, t.name, qtype, rows, cols, t.data)
