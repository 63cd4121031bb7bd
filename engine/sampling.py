"""Exact speculative sampling: logits processing and the two verification rules.

Terms follow vLLM's rejection sampler: a drafted token is *accepted* or rejected; at the first rejection a
*recovered* token is drawn from the residual distribution; when every verified draft is accepted a
*bonus* token is drawn from the target at the next position. In the paper's letters (Leviathan et al.,
2023) ``target_probs`` is p and ``draft_probs`` is q.

Two rules, both exact (docs/design.md section 1):

* ``verify_chain``: drafts sampled from q; accept x with probability min(1, p(x)/q(x)); recover from
  norm(max(p - q, 0)); bonus from p.
* ``verify_tree``: deterministic drafts (top-k expansions, or argmax chains). With one-hot proposals the
  recursive rejection rule reduces to: draw z ~ p at the current node, move to the child whose token is z
  if there is one, otherwise emit z. Greedy decoding is the case z = argmax p.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.errors import DraftpilotError, InputError

MIN_TEMPERATURE = 1e-6
"""The smallest temperature that samples; a positive temperature below it is greedy (``SamplingConfig``
normalises it to 0). Sampling divides float32 logits by the temperature: above this threshold the quotient
stays finite for any logit below 3e32 in magnitude, so the law is a proper distribution; far below it (1e-40,
a subnormal) the quotient overflows to inf and softmax gives NaN. The law at such a temperature is the
argmax's up to ties closer than the logits' rounding, so greedy is what it means."""


class NonFiniteLogitsError(DraftpilotError, FloatingPointError):
    """A model produced NaN or inf logits; the request was stopped instead of emitting a wrong token."""


@dataclass(frozen=True)
class SamplingConfig:
    """How next tokens are drawn; applied identically to target and draft distributions."""

    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it before softmax. A temperature below
    ``MIN_TEMPERATURE`` is stored as 0 (greedy): the one place where that rule lives, so ``generate`` and
    the server agree."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = no limit)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = no limit)."""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{name} must be a number, got {value!r}")
        if not (0.0 <= self.temperature < float("inf")):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < MIN_TEMPERATURE:  # greedy: logits / temperature would overflow float32
            object.__setattr__(self, "temperature", 0.0)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InputError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Sampling distribution(s) from logits ``[..., V]``: temperature, top-k, top-p, softmax (float32).

    Greedy gives the one-hot distribution on the argmax (first index on ties, like ``torch.argmax``).
    """
    logits = logits.float()
    if cfg.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / cfg.temperature
    vocab = logits.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass strictly before it already reaches top_p; the top token always stays
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if not bool(torch.isfinite(probs).all()):  # finite logits over a tiny temperature overflow to inf
        raise NonFiniteLogitsError(
            f"the sampling distribution at temperature {cfg.temperature!r} is not finite (NaN or inf): the "
            "scaled logits overflow; the request was stopped rather than drawing a wrong token"
        )
    return probs


def score_logprobs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Log-probabilities used to *rank* draft nodes (not to sample): the temperature-scaled softmax
    without truncation, so every candidate keeps a finite score; greedy ranks with temperature 1."""
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def check_finite(logits: torch.Tensor, where: str) -> None:
    """Raise a clear error instead of letting NaN/inf logits turn into a silently wrong token."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogitsError(
            f"non-finite logits (NaN or inf) from the {where} model; the request was stopped "
            "rather than emitting a wrong token (check the dtype, the weights and the inputs)"
        )


def verify_chain(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Leviathan et al.'s rule for a chain of drafts *sampled* from the draft distribution.

    target_probs: [K+1, V] target distributions at the K draft positions and the bonus position.
    draft_probs:  [K, V]   draft distributions the K draft tokens were sampled from.
    draft_tokens: [K]      the drafted token ids.
    Returns (num_accepted, next_token): next_token is the recovered token at the first rejection, or the
    bonus token when all K are accepted.
    """
    num_draft_tokens = draft_tokens.shape[0]
    assert target_probs.dim() == 2 and target_probs.shape[0] == num_draft_tokens + 1, target_probs.shape
    assert draft_probs.shape == (num_draft_tokens, target_probs.shape[1]), draft_probs.shape
    device = target_probs.device
    if num_draft_tokens:
        idx = torch.arange(num_draft_tokens, device=device)
        p_tok = target_probs[idx, draft_tokens]  # [K]
        q_tok = draft_probs[idx, draft_tokens]  # [K] > 0: the token was sampled from q
        u = torch.rand(num_draft_tokens, generator=generator, device=device, dtype=torch.float64)
        rejected = (u * q_tok.double() >= p_tok.double()).tolist()  # u >= p/q without dividing by q
        for i, rej in enumerate(rejected):
            if rej:
                residual = (target_probs[i].double() - draft_probs[i].double()).clamp_(min=0.0)
                if float(residual.sum()) <= 0.0:  # measure-zero after a rejection; guard rounding only
                    residual = target_probs[i].double()
                return i, _draw(residual, generator)
    return num_draft_tokens, _draw(target_probs[num_draft_tokens], generator)


def verify_tree(
    node_tokens: Sequence[int],
    node_parents: Sequence[int],
    draw_target: Callable[[int], int],
) -> tuple[list[int], int]:
    """Recursive rejection sampling on a tree of deterministic (one-hot) drafts.

    node_tokens[i], node_parents[i]: token and parent of node i; parent -1 is the root (the pending
    token). Parents must come before children. draw_target(r) draws one token from the target law at
    row r, where row 0 is the root and row i+1 is node i (argmax for greedy).
    Returns (accepted node indices from the root down, next_token): next_token is the recovered token
    when the walk leaves the tree, or the bonus token when it ends on a leaf.
    """
    assert len(node_tokens) == len(node_parents)
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(zip(node_tokens, node_parents)):
        assert -1 <= parent < i, f"node {i} has parent {parent}: parents must precede children"
        # duplicate sibling tokens cannot both be walked into; the first (highest-ranked) one wins
        children.setdefault(parent, {}).setdefault(int(tok), i)
    path: list[int] = []
    node = -1
    while True:
        z = draw_target(node + 1)
        child = children.get(node, {}).get(z)
        if child is None:
            return path, z
        path.append(child)
        node = child


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def make_target_drawer(
    target_logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None
) -> Callable[[int], int]:
    """A ``draw_target`` for ``verify_tree`` from target logits [N+1, V]; processes only the rows the
    walk visits (at most depth + 1), since softmax/top-p over the whole vocabulary is not free."""
    if cfg.greedy:
        argmax = target_logits.argmax(-1).tolist()
        return argmax.__getitem__
    return lambda row: _draw(logits_to_probs(target_logits[row], cfg), generator)
