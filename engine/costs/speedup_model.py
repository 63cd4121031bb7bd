"""The speculative decoding cost model (docs/design.md section 6.1): expected tokens per cycle and speedup.

Letters follow the article: alpha = per-token acceptance probability, gamma = draft length, c = cost of
one draft step relative to one target step, g(gamma) = cost of verifying gamma tokens relative to one
target step (1 in the simplified model). The last functions give the same quantities measured on a
device (``engine.costs.cost_profile.CostProfile``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.costs.cost_profile import CostProfile


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha): expected tokens emitted per cycle."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_general(accept_probs: Sequence[float]) -> float:
    """General form: 1 + sum_i P(first i drafts all accepted), given P(accept i | first i-1 accepted)."""
    total, survive = 1.0, 1.0
    for prob in accept_probs:
        survive *= prob
        total += survive
    return total


def speedup(alpha: float, gamma: int, c: float, g: float | Callable[[int], float] = 1.0) -> float:
    """S = E(alpha, gamma) / (g(gamma) + c * gamma): cycle output over cycle cost, in target steps."""
    g_val = g(gamma) if callable(g) else g
    return expected_tokens(alpha, gamma) / (g_val + c * gamma)


def best_gamma(alpha: float, c: float, g: float | Callable[[int], float] = 1.0, max_gamma: int = 16) -> int:
    """The gamma in 1..max_gamma with the largest speedup (the article's grid)."""
    return max(range(1, max_gamma + 1), key=lambda gam: speedup(alpha, gam, c, g))


# --------------------------------------------------------------------------- empirical (measured) costs
def cycle_time(
    profile: CostProfile, depth: int, num_verified: int, context: int, tree_width: int = 1
) -> float:
    """The empirical cycle time T(D, V, context) in seconds from a measured cost profile (one pending
    draft token, no controller time): see ``CostProfile.cycle_s``."""
    return profile.cycle_s(depth, num_verified, context, tree_width)


def empirical_c(profile: CostProfile, context: int) -> float:
    """The article's c on the profiled device: one draft step over one target step at ``context``."""
    return profile.c_ratio(context)


def empirical_g(profile: CostProfile, gamma: int, context: int) -> float:
    """The article's g(gamma) on the profiled device: verifying gamma tokens over one target step."""
    return profile.verify_s(gamma, context) / profile.verify_s(0, context)
