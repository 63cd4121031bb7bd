"""A draft LM head over part of the vocabulary (``draft_vocab``, ``engine.backends.models.load_pair``):
``RestrictedHead`` (the kept tokens' logits, every other token masked), the token ids it keeps
(``draft_vocab_ids``), and a dense head restricted in place (``restrict_dense_head``; quantized heads are
restricted while converting, ``engine.backends.quant.replace_linears``)."""

from __future__ import annotations

import torch
from torch import nn

from engine.backends.gguf import QuantizationError
from engine.errors import InputError


class RestrictedHead(nn.Module):
    """An LM head over a subset of the vocabulary: logits of the kept tokens from a smaller linear layer,
    ``MASKED_LOGIT`` for every other token (probability exactly 0 after softmax, yet finite, so the
    engine's NaN/inf guard still means what it says). For a draft model only: the exact sampler accepts
    any draft distribution, so the output law is untouched; what changes is the cost of a draft step
    (the head is the largest matrix of a small model) and how often a draft can propose the target's token."""

    MASKED_LOGIT = -1.0e30

    def __init__(self, inner: nn.Module, keep: torch.Tensor, vocab_size: int):
        super().__init__()
        self.inner = inner
        self.register_buffer("keep", keep.to(torch.long).clone())
        self.in_features, self.out_features = inner.in_features, int(vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.inner(x)
        out = sub.new_full((*sub.shape[:-1], self.out_features), self.MASKED_LOGIT)
        out[..., self.keep] = sub
        return out

    def extra_repr(self) -> str:
        return f"kept={self.keep.numel()} of {self.out_features} tokens"


def draft_vocab_ids(
    size: int, vocab_size: int, always: set[int] | frozenset[int] = frozenset()
) -> torch.Tensor:
    """The token ids a restricted draft head keeps: the ``size`` lowest ids (in a byte-level BPE vocabulary
    the 256 bytes, then merges in the order they were learned, most frequent pair first on the
    tokenizer's own training corpus) plus ``always`` (end-of-sequence and other special tokens), topped up
    with the next ids to a multiple of 16 rows (the int4 packing's granularity); sorted."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab_size:
        raise InputError(f"draft vocabulary size must be an integer in [1, {vocab_size}], got {size!r}")
    ids = set(range(size)) | {int(i) for i in always if 0 <= int(i) < vocab_size}
    extra = size
    while len(ids) % 16 and extra < vocab_size:  # the int4 packing needs a multiple of 16 output rows
        ids.add(extra)
        extra += 1
    return torch.tensor(sorted(ids), dtype=torch.long)


def restrict_dense_head(model: nn.Module, keep: torch.Tensor) -> None:
    """Replace a dense ``lm_head`` by a ``RestrictedHead`` over the ``keep`` token ids."""
    head = model.lm_head
    if not isinstance(head, nn.Linear):
        raise QuantizationError(f"lm_head is a {type(head).__name__}; restrict it while converting instead")
    inner = nn.Linear(head.in_features, len(keep), bias=head.bias is not None, dtype=head.weight.dtype)
    with torch.no_grad():
        inner.weight.copy_(head.weight[keep])
        if head.bias is not None:
            inner.bias.copy_(head.bias[keep])
    model.lm_head = RestrictedHead(inner.requires_grad_(False), keep, head.out_features)
