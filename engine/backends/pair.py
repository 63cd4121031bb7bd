"""``ModelPair`` (a target, a draft and the tokenizer both use), built from two loaded models only after
they are checked to give token ids the same meaning (``make_pair``): what every loader
(``engine.backends.models``, ``engine.backends.random_pair``) returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.backends.attention import use_rowwise_attention
from engine.errors import DraftpilotError


class IncompatiblePairError(DraftpilotError, ValueError):
    """The two models do not give token ids the same meaning."""


@dataclass
class ModelPair:
    """A target model, a draft model and the tokenizer both use."""

    target: Any
    draft: Any
    tokenizer: Any
    name: str
    eos_token_ids: frozenset[int]
    max_context: int
    weights: str = ""
    """Weight format of the target's linear layers (``engine.backends.quant.WEIGHT_FORMATS``)."""
    draft_weights: str = ""
    """Weight format of the draft's linear layers."""
    quant_info: dict | None = None
    """Per-module conversion info of quantized models (kind, source type), {"target": ..., "draft": ...}."""
    draft_vocab: int = 0
    """Tokens the draft's LM head keeps (0: the whole vocabulary; ``engine.backends.draft_head.RestrictedHead``)."""

    @property
    def precision(self) -> str:
        """How the pair computes, for cache keys and reports: the weight format ("int4", "float32", ...),
        "target+draft" formats when they differ."""
        target = self.weights or str(self.dtype).removeprefix("torch.")
        draft = self.draft_weights or target
        label = target if draft == target else f"{target}+{draft}"
        return f"{label}-dv{self.draft_vocab}" if self.draft_vocab else label

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return self.target.get_output_embeddings().out_features

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for ``prompt``; ``chat`` wraps it as one user turn with the chat template."""
        if not chat:
            return list(self.tokenizer.encode(prompt))
        messages = [{"role": "user", "content": prompt}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def make_pair(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    target_tok: Any,
    draft_tok: Any,
    name: str,
    weights: str = "",
    draft_weights: str = "",
    info: tuple | None = None,
    draft_vocab: int | None = None,
) -> ModelPair:
    check_compatible(target, draft, target_tok, draft_tok)
    for model in (target, draft):
        model.requires_grad_(False)
        if next(model.parameters()).device.type == "cpu":
            use_rowwise_attention(model)  # batch-invariant attention (engine.backends.attention)
    eos = eos_ids(target, target_tok)
    max_context = min(_context_limit(target), _context_limit(draft))
    quant_info = None if info is None or info == (None, None) else {"target": info[0], "draft": info[1]}
    return ModelPair(
        target,
        draft,
        target_tok,
        name,
        frozenset(int(i) for i in eos),
        max_context,
        weights or str(next(target.parameters()).dtype).removeprefix("torch."),
        draft_weights or weights or str(next(draft.parameters()).dtype).removeprefix("torch."),
        quant_info,
        int(draft_vocab or 0),
    )


def check_compatible(
    target: torch.nn.Module, draft: torch.nn.Module, target_tok: Any, draft_tok: Any
) -> None:
    """Refuse pairs whose token ids do not mean the same thing (docs/design.md section 1)."""
    t_vocab = target.get_output_embeddings().out_features
    d_vocab = draft.get_output_embeddings().out_features
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


def _context_limit(model: torch.nn.Module) -> int:
    return int(getattr(model.config, "max_position_embeddings", None) or 2**31 - 1)


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """End-of-sequence ids declared by the model's generation config, its config or the tokenizer."""
    eos: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        ids = getattr(src, "eos_token_id", None)
        eos.update([ids] if isinstance(ids, int) else (ids or []))
    return eos
