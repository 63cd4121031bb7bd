"""Context lookup drafting: propose the tokens that followed the latest earlier occurrence of the context's
last n tokens (prompt-lookup / n-gram drafting). A draft that costs no model forward.

Exactness: the proposal is a deterministic function of the committed tokens, so it is verified as a one-node
-wide chain by the same rule as any deterministic draft (``engine.sampling.verify_tree``: walk the target's
draws down the chain); the output keeps the target's law whatever the proposal, greedy or sampled. For the
same reason replay is exact: the accepted length is the number of leading proposal tokens the trajectory
repeats (``envs.replay``).

``NgramIndex`` keeps, for every n-gram size in ``[min_ngram, max_ngram]``, the position that followed the
latest occurrence of each n-gram, updated as tokens are committed (O(max_ngram) dictionary writes a token),
so a lookup costs a few dictionary reads whatever the context length. The longest matching n wins; among
occurrences of one n-gram the latest wins (the most recent text is the likeliest to repeat).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import InputError, is_int


@dataclass(frozen=True)
class LookupConfig:
    """Settings of context lookup drafting (``EngineConfig.lookup``; None there switches it off).

    On every cycle the engine first looks the context's last ``max_ngram`` ... ``min_ngram`` tokens up in the
    committed tokens (prompt and generated); on a match it verifies up to ``max_tokens`` proposed tokens
    (within the cycle's budget and context caps) in one target forward and neither the draft model nor the
    controller runs; without a match the cycle is the controller's (or an autoregressive step when there is
    no controller). Defaults chosen by replay on the tune splits of both suites (docs/architecture.md, "Context
    lookup"): 3-4:2 never fell below 1.05x autoregressive decoding on either, longer proposals lose on the
    short requests."""

    min_ngram: int = 3
    max_ngram: int = 4
    max_tokens: int = 2

    def __post_init__(self) -> None:
        for name in ("min_ngram", "max_ngram", "max_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InputError(f"LookupConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_ngram < self.min_ngram:
            raise InputError(
                f"LookupConfig.max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})"
            )


class NgramIndex:
    """Latest continuation of every n-gram of a growing token sequence (see the module docstring)."""

    def __init__(self, config: LookupConfig, tokens: Sequence[int] = ()):
        self.config = config
        self.tokens: list[int] = []
        self._maps: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.min_ngram, config.max_ngram + 1)
        }
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens. When token i arrives, the n-grams ending at i - 1 get continuation i."""
        seq = self.tokens
        for tok in tokens:
            seq.append(int(tok))
            i = len(seq) - 1
            for n, table in self._maps.items():
                if i - n >= 0:
                    table[tuple(seq[i - n : i])] = i

    def sync(self, tokens: Sequence[int]) -> None:
        """Catch up with ``tokens``, a sequence this index's tokens are a prefix of (the engine's committed
        tokens after a cycle)."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens) :])

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest matching suffix
        n-gram (``max_ngram`` down to ``min_ngram``); empty without a match or when ``limit < 1``."""
        seq = self.tokens
        if limit < 1:
            return []
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if len(seq) < n + 1:
                continue
            start = self._maps[n].get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return seq[start : start + limit]
        return []


def parse_lookup(spec: str | None) -> LookupConfig | None:
    """A command line's lookup setting: "off" (or None / empty) -> None, "on" -> ``LookupConfig()``, MIN-MAX:K
    (or N:K for MIN = MAX = N) -> that ``LookupConfig``. Anything else is an ``InputError`` that quotes it."""
    text = (spec or "off").strip().lower()
    if text == "off":
        return None
    if text == "on":
        return LookupConfig()
    grams, sep, tokens = text.partition(":")
    low, dash, high = grams.partition("-")
    numbers = [low, high if dash else low, tokens]
    if not sep or not all(n.isdigit() for n in numbers):
        raise InputError(f'lookup setting {spec!r}: expected "off", "on" or MIN-MAX:K such as 3-4:3')
    try:
        return LookupConfig(*(int(n) for n in numbers))
    except InputError as err:
        raise InputError(f"lookup setting {spec!r}: {err}") from None


def describe_lookup(config: LookupConfig | None) -> str:
    """The inverse of ``parse_lookup``: "off" or MIN-MAX:K."""
    if config is None:
        return "off"
    return f"{config.min_ngram}-{config.max_ngram}:{config.max_tokens}"
