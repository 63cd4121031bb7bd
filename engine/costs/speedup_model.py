"""The speculative decoding cost model (docs/design.md section 6.1), the one every user shares: the size
ladder, expected tokens per cycle, cycle cost and speedup.

Letters follow the article: alpha = per-token acceptance probability, gamma = draft length, c = cost of
one draft step relative to one target step, g(gamma) = cost of verifying gamma tokens relative to one
target step (1 in the simplified model). The article's closed forms come first; then the same quantities
measured on a device (``engine.costs.cost_profile.CostProfile``); then the model over a drafted tree that
the analytic controller (``policies.analytic``) and the observation features (``engine.costs.observation``)
evaluate: verifying the best V nodes is expected to accept E(V) = the sum of their path probabilities, and
yields (1 + E(V)) tokens per cycle of cost depth x t_draft + t_verify(V) (+ t_overhead(V) where the
overhead is known).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine.costs.cost_profile import CostProfile

SIZE_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""The verification sizes a controller chooses from (the size action space of the environments and of
learned policies; the analytic controller's candidates)."""
MEASURED_SIZES = (0, *SIZE_LADDER)
"""The verified-node counts a cost profile measures by default: the root alone (an autoregressive step)
and the ladder."""


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


# --------------------------------------------------------------------------- the model over a drafted tree
def expected_accepted(path_probs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """E(V) for each V in ``sizes``: the sum of the best V path probabilities (``path_probs`` sorted best
    first; each node is accepted iff its whole path is, so the sum is the expected accepted length); V above
    the node count as that count."""
    sizes = np.minimum(sizes, len(path_probs))
    top = int(sizes.max()) if len(sizes) else 0
    cum = np.concatenate([[0.0], np.cumsum(path_probs[:top])])
    return cum[sizes]


def next_level_probs(
    path_probs: np.ndarray, frontier_probs: np.ndarray, step_probs: np.ndarray, tree_width: int = 1
) -> np.ndarray:
    """The path probabilities after drafting one more level, best first: the nodes now and ``tree_width``
    children per frontier node, predicted from the last step's conditional probabilities (the best child of
    each frontier node shares the best last-step probability; its siblings get geometrically less)."""
    step = float(np.clip(np.max(step_probs), 1e-6, 1.0))
    child = np.outer(frontier_probs, step * (1.0 - step) ** np.arange(tree_width)).ravel()
    return np.sort(np.concatenate([path_probs, child]))[::-1]


def cycle_cost_s(
    profile: Any, depth: int, sizes: Sequence[int], context: int, tree_width: int = 1
) -> np.ndarray:
    """[len(sizes)] seconds of a cycle that drafts ``depth`` steps of width ``tree_width`` and verifies each
    of ``sizes`` nodes: depth x t_draft + t_verify(V) + t_overhead(V), from ``profile`` (a ``CostProfile`` or
    any profile of its replay interface, such as one seen at a load). Depth 0 is an autoregressive step."""
    draft_s = depth * profile.draft_step_s(tree_width, context) if depth > 0 else 0.0
    return np.asarray(
        [
            draft_s
            + profile.verify_s(int(v), context, chain=tree_width == 1)
            + profile.overhead_s(int(v), depth=depth, tree_width=tree_width)
            for v in sizes
        ]
    )


def tokens_per_cost(expected: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """(1 + E) / cost: the tokens a cycle emits (the accepted ones and the target's own) per unit of cost."""
    return (1.0 + expected) / cost


def best_size(ratios: np.ndarray, sizes: np.ndarray) -> tuple[float, int]:
    """(the largest ratio, its size); the first of equal ones."""
    i = int(np.argmax(ratios))
    return float(ratios[i]), int(sizes[i])


# --------------------------------------------------------------------------- from the device features
VERIFY_POINTS = np.asarray([0.0, 1.0, 2.0, 4.0, 16.0, 64.0])
"""The node counts at which the device features give the verification cost (over verifying one node)."""


def verify_curve(known: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Verification cost of ``nodes`` nodes, interpolated linearly between ``known``, the costs at
    ``VERIFY_POINTS`` (beyond the last point extrapolated along the last segment)."""
    out = np.interp(nodes, VERIFY_POINTS, known)
    slope = (known[5] - known[4]) / (VERIFY_POINTS[5] - VERIFY_POINTS[4])
    return np.where(nodes > VERIFY_POINTS[5], known[5] + slope * (nodes - VERIFY_POINTS[5]), out)


def relative_speedups(
    path_probs: np.ndarray,
    depth: int,
    sizes: np.ndarray,
    draft_cost: float,
    verify: np.ndarray,
    ar_cost: float,
) -> np.ndarray:
    """[len(sizes)] the speedup over an autoregressive step of verifying the best V nodes after ``depth``
    draft steps, with costs in any one unit and no overhead: ``draft_cost`` per draft step, ``verify[n]``
    for verifying n nodes (a table over 0..max(sizes)), ``ar_cost`` for an autoregressive step."""
    cost = depth * draft_cost + verify[np.minimum(sizes, len(path_probs))]
    return tokens_per_cost(expected_accepted(path_probs, sizes), np.maximum(cost, 1e-6)) * ar_cost
