"""The converted-weights cache (``<cache>/quant/<name>/<format>/``): a GGUF's linear weights converted once to
an integer format (``ensure_quantized_gguf``: plain codes and scales in safetensors, a stamp written last; a
missing, unreadable or stale cache is rebuilt) and swapped into a model (``load_quantized``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from engine.backends import kquant
from engine.backends.gguf import SUPPORTED_GGUF_TYPES, QuantizationError, gguf_linears
from engine.backends.quant import KQUANT_FORMATS, linear_names, q4_k_to_int4, quantized_state, replace_linears

QUANT_STAMP = "draftpilot-quantized.json"
QUANT_VERSION = 2  # bump when the cached layout changes: older caches are rebuilt


def quant_cache_dir(root: Path, name: str, fmt: str) -> Path:
    return root / "quant" / name / fmt


def ensure_quantized_gguf(
    gguf_path: Path, name: str, sha256: str, fmt: str, root: Path, progress: bool = True
) -> Path:
    """The cached ``fmt`` conversion of a GGUF's linear weights (built once; rebuilt if incomplete,
    unreadable or from another source/version). Returns the directory holding ``weights.safetensors``
    and the stamp."""
    from safetensors.torch import save_file

    final = quant_cache_dir(root, name, fmt)
    if _cache_valid(final, sha256, fmt):
        return final
    start = time.perf_counter()

    def source():
        from tqdm.auto import tqdm

        for lin in tqdm(list(gguf_linears(gguf_path)), desc=f"{name} -> {fmt}", disable=not progress):
            exact = None
            if fmt in KQUANT_FORMATS and lin.qtype in ("Q4_K", "Q6_K"):
                convert = kquant.q4_k_to_k4 if lin.qtype == "Q4_K" else kquant.q6_k_to_k6
                exact = lambda lin=lin, convert=convert: convert(lin.raw, lin.rows, lin.cols)  # noqa: E731
            elif lin.qtype == "Q4_K":
                exact = lambda lin=lin: q4_k_to_int4(lin.raw, lin.rows, lin.cols)  # noqa: E731
            elif lin.qtype not in SUPPORTED_GGUF_TYPES:
                raise QuantizationError(
                    f"{gguf_path.name}: tensor {lin.gguf_name} has GGUF type {lin.qtype}, which cannot be "
                    f"converted (supported: {', '.join(SUPPORTED_GGUF_TYPES)})"
                )
            yield lin.module, lin.qtype, lin.rows, lin.cols, exact, lin.dequantize

    tensors, info = quantized_state(source(), fmt)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{fmt}-", dir=final.parent))
    try:
        save_file(tensors, str(tmp / "weights.safetensors"))
        stamp = {
            "version": QUANT_VERSION,
            "format": fmt,
            "source": gguf_path.name,
            "sha256": sha256,
            "modules": info,
            "seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / QUANT_STAMP).write_text(json.dumps(stamp, indent=1) + "\n")  # last: marks completion
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _cache_valid(path: Path, sha256: str, fmt: str) -> bool:
    try:
        stamp = json.loads((path / QUANT_STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (
        stamp.get("version") == QUANT_VERSION
        and stamp.get("sha256") == sha256
        and stamp.get("format") == fmt
        and (path / "weights.safetensors").is_file()
    )


def load_quantized(model: nn.Module, path: Path, head_rows: torch.Tensor | None = None) -> dict[str, dict]:
    """Swap ``model``'s linears for the cached quantized ones at ``path``; returns the stamp's module info.
    Raises ``QuantizationError`` if the cache is unreadable or does not fit the model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        stamp = json.loads((path / QUANT_STAMP).read_text())
        state = load_file(str(path / "weights.safetensors"))
    except (OSError, ValueError, SafetensorError) as err:
        raise QuantizationError(f"unreadable quantized cache {path}: {err}") from err
    modules = sorted(stamp["modules"])
    expected = set(linear_names(model))
    if set(modules) != expected:
        missing, extra = sorted(expected - set(modules))[:3], sorted(set(modules) - expected)[:3]
        raise QuantizationError(
            f"quantized cache {path} does not fit the model (missing {missing}, extra {extra})"
        )
    model.to(torch.float32)
    replace_linears(model, state, modules, head_rows)
    return stamp["modules"]
