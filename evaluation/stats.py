"""Paired bootstrap confidence intervals for throughput ratios over prompts.

The quantity is a ratio of aggregates, (sum tokens_A / sum time_A) / (sum tokens_B / sum time_B), over
the same prompts; the bootstrap resamples *prompts* (with replacement, the two controllers' numbers of
a prompt stay together: paired), recomputes the ratio, and reports the percentile interval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ratio_of_aggregates(tokens_a, seconds_a, tokens_b, seconds_b) -> float:
    """(sum tokens_a / sum seconds_a) / (sum tokens_b / sum seconds_b)."""
    return float((np.sum(tokens_a) / np.sum(seconds_a)) / (np.sum(tokens_b) / np.sum(seconds_b)))


def paired_bootstrap_ratio(
    tokens_a: Sequence[float],
    seconds_a: Sequence[float],
    tokens_b: Sequence[float],
    seconds_b: Sequence[float],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    rng: np.random.Generator | int = 0,
) -> dict[str, float]:
    """Point estimate and percentile bootstrap interval of the throughput ratio A / B over paired prompts.

    Returns ``{"ratio", "low", "high", "prompts", "resamples", "confidence"}``; with one prompt the
    interval collapses to the point (there is nothing to resample).
    """
    arrays = [np.asarray(x, dtype=np.float64) for x in (tokens_a, seconds_a, tokens_b, seconds_b)]
    n = len(arrays[0])
    if n == 0 or any(len(a) != n for a in arrays):
        raise ValueError(
            f"need the same non-zero number of prompts for both controllers, got {[len(a) for a in arrays]}"
        )
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    point = ratio_of_aggregates(*arrays)
    idx = rng.integers(0, n, size=(resamples, n))  # [B, n] prompt indices
    ta, sa, tb, sb = (a[idx].sum(axis=1) for a in arrays)  # [B] each
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = (ta / sa) / (tb / sb)
    boot = boot[np.isfinite(boot)]
    alpha = (1 - confidence) / 2
    low, high = np.quantile(boot, [alpha, 1 - alpha]) if boot.size else (np.nan, np.nan)
    # percentile intervals of a ratio can in rare, tiny samples miss the point estimate: widen to include it
    return {
        "ratio": point,
        "low": float(min(low, point)),
        "high": float(max(high, point)),
        "prompts": n,
        "resamples": int(resamples),
        "confidence": confidence,
    }


def paired_ratio_from_rows(
    rows_a: dict[str, dict],
    rows_b: dict[str, dict],
    *,
    resamples: int,
    rng: np.random.Generator | int,
    language: str | None = None,
) -> dict[str, float] | None:
    """``paired_bootstrap_ratio`` over the prompts both controllers ran (optionally one language);
    rows are ``evaluation.measurements.per_prompt`` rows keyed by prompt id. None when no prompt is shared."""
    ids = [
        pid for pid in rows_a if pid in rows_b and (language is None or rows_a[pid]["language"] == language)
    ]
    if not ids:
        return None
    return paired_bootstrap_ratio(
        [rows_a[i]["num_tokens"] for i in ids],
        [rows_a[i]["total_s"] for i in ids],
        [rows_b[i]["num_tokens"] for i in ids],
        [rows_b[i]["total_s"] for i in ids],
        resamples=resamples,
        rng=rng,
    )
