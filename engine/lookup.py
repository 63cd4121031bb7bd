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
from dataclasses import dataclass, replace

from engine.errors import InputError, is_int
from engine.load import LoadState


@dataclass(frozen=True)
class LookupConfig:
    """Settings of context lookup drafting (``EngineConfig.lookup``; None there switches it off).

    On every cycle the engine first looks the context's last ``max_ngram`` ... ``min_ngram`` tokens up in the
    committed tokens (prompt and generated); on a match it verifies up to ``max_tokens`` proposed tokens
    (within the cycle's budget and context caps) in one target forward and neither the draft model nor the
    controller runs; without a match the cycle is the controller's (or an autoregressive step when there is
    no controller). A long match goes first: where the context's last ``long_ngram`` tokens occurred before,
    up to ``long_tokens`` of what followed them are proposed (``long_ngram`` 0: no such rule). Defaults chosen
    by replay on the tune splits of both suites (docs/engine.md, "Context lookup"): 3-4:2 never fell
    below 1.05x autoregressive decoding on either, longer proposals after a short match lose on the short
    requests, and 4 tokens after an 8-token match gain on the long ones without a loss on the short."""

    min_ngram: int = 3
    max_ngram: int = 4
    max_tokens: int = 2
    long_ngram: int = 8
    long_tokens: int = 4
    max_requests: int = 0
    """Load limit: under load (a batched engine's step, ``engine.load.LoadState``) lookup runs only while at most
    this many requests decode in the step; above it every cycle is the controller's. 0: at every load. Alone
    (``generate``) lookup always runs. Why: a lookup proposal's rows cost what any rows cost in the batched
    forward, and once the batch is large the rows its rejected tokens take cost more than the tokens it
    gains (train.py tunes the limit on the server replay; docs/engine.md, "Context lookup under
    load")."""

    def __post_init__(self) -> None:
        for name in ("min_ngram", "max_ngram", "max_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InputError(f"LookupConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_ngram < self.min_ngram:
            raise InputError(
                f"LookupConfig.max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})"
            )
        for name in ("long_ngram", "long_tokens", "max_requests"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise InputError(f"LookupConfig.{name} must be an integer >= 0, got {value!r}")
        if self.long_ngram and (self.long_ngram <= self.max_ngram or self.long_tokens < 1):
            raise InputError(
                f"LookupConfig: a long match ({self.long_ngram} tokens) must be longer than max_ngram "
                f"({self.max_ngram}) and propose at least one token (long_tokens {self.long_tokens}); "
                "long_ngram 0 switches the rule off"
            )

    @property
    def most_tokens(self) -> int:
        """The longest proposal either rule makes."""
        return max(self.max_tokens, self.long_tokens if self.long_ngram else 0)

    def runs_at(self, load: LoadState | None) -> bool:
        """Whether lookup runs in a cycle under ``load`` (None: alone): the load limit ``max_requests``."""
        return not self.max_requests or load is None or load.requests <= self.max_requests

    @property
    def rules(self) -> LookupConfig:
        """The same proposals at every load (the limit off): what a lookup proposes depends on this only."""
        return replace(self, max_requests=0) if self.max_requests else self


class NgramIndex:
    """Latest continuation of every n-gram of a growing token sequence (see the module docstring)."""

    def __init__(self, config: LookupConfig, tokens: Sequence[int] = ()):
        self.config = config
        self.tokens: list[int] = []
        sizes = [
            *range(config.min_ngram, config.max_ngram + 1),
            *([config.long_ngram] if config.long_ngram else []),
        ]
        self._maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        # (n-gram size, tokens proposed) in the order ``propose`` tries them: the long match first
        self._rules = [(config.long_ngram, config.long_tokens)] if config.long_ngram else []
        self._rules += [(n, config.max_tokens) for n in range(config.max_ngram, config.min_ngram - 1, -1)]
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
        """The tokens that followed the latest earlier occurrence of the context's last ``long_ngram`` tokens (up
        to ``long_tokens``), else of the longest matching suffix n-gram, ``max_ngram`` down to ``min_ngram`` (up
        to ``max_tokens``); at most ``limit`` either way, empty without a match or when ``limit < 1``."""
        seq = self.tokens
        if limit < 1:
            return []
        for n, tokens in self._rules:
            if len(seq) < n + 1:
                continue
            start = self._maps[n].get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return seq[start : start + min(limit, tokens)]
        return []


LEGACY_ON = "3-4:2"
"""What "on" meant before the long-match rule (a policy file storing "on" was trained with it)."""


def parse_lookup(spec: str | None) -> LookupConfig | None:
    """A command line's lookup setting: "off" (or None / empty) -> None, "on" -> ``LookupConfig()`` (the
    defaults), MIN-MAX:K (or N:K for MIN = MAX = N) -> that rule alone, MIN-MAX:K+L:J -> with the long-match
    rule (L tokens matched: up to J proposed); a suffix @N sets the load limit (``LookupConfig.max_requests``:
    lookup only while at most N requests decode in a step). Anything else is an ``InputError`` that quotes it."""
    text = (spec or "off").strip().lower()
    if text == "off":
        return None
    text, at, limit = text.partition("@")
    if at and not limit.strip().isdigit():
        raise InputError(
            f"lookup setting {spec!r}: the load limit after @ must be a number of requests, such as 3-4:2@2"
        )
    max_requests = int(limit) if at else 0
    rule: list[int] = []  # "on": the defaults
    if text.strip() != "on":
        base, plus, long_rule = text.partition("+")
        rule = _rule_numbers(base, spec, ranged=True)
        rule += _rule_numbers(long_rule, spec, ranged=False) if plus else [0, 0]
    try:
        return LookupConfig(*rule, max_requests=max_requests)
    except InputError as err:
        raise InputError(f"lookup setting {spec!r}: {err}") from None


def _rule_numbers(text: str, spec: str | None, ranged: bool) -> list[int]:
    grams, sep, tokens = text.partition(":")
    low, dash, high = grams.partition("-") if ranged else (grams, "", "")
    numbers = [low, high if dash else low, tokens] if ranged else [low, tokens]
    if not sep or not all(n.isdigit() for n in numbers):
        raise InputError(
            f'lookup setting {spec!r}: expected "off", "on" or MIN-MAX:K such as 3-4:2, optionally with a long-'
            "match rule +L:J such as 3-4:2+8:4"
        )
    return [int(n) for n in numbers]


def resolve_lookup(
    spec: str | None, trained: LookupConfig | None = None, otherwise: LookupConfig | None = None
) -> LookupConfig | None:
    """A command line's lookup setting where "auto" is allowed: "auto" -> ``trained`` (a policy's own setting,
    ``LearnedController.trained_lookup``) when it has one, else ``otherwise``; anything else as
    ``parse_lookup``."""
    if (spec or "").strip().lower() == "auto":
        return trained if trained is not None else otherwise
    return parse_lookup(spec)


def stored_lookup(spec: str | None) -> LookupConfig | None:
    """The setting a stored training config names (a policy file's ``train_config["lookup"]``): as
    ``parse_lookup``, except that "on" is what it meant when such files were written (``LEGACY_ON``; train.py now
    stores the resolved setting)."""
    text = (spec or "off").strip().lower()
    return parse_lookup(LEGACY_ON if text == "on" else text)


def describe_lookup(config: LookupConfig | None) -> str:
    """The inverse of ``parse_lookup``: "off", MIN-MAX:K or MIN-MAX:K+L:J, with @N for a load limit."""
    if config is None:
        return "off"
    base = f"{config.min_ngram}-{config.max_ngram}:{config.max_tokens}"
    base += f"+{config.long_ngram}:{config.long_tokens}" if config.long_ngram else ""
    return base + (f"@{config.max_requests}" if config.max_requests else "")
