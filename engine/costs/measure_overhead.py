"""The per-cycle overhead of a cost profile measurement: real engine cycles with static controllers, their
time outside the forwards and the controller, fitted as base + per_node * V + per_draft_row * (depth - 1) * W
(``CostProfile.overhead_s``); with the autoregressive step's overhead and one controller call's time."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tqdm.auto import tqdm

from engine.control import StaticController
from engine.costs.cost_profile import median_spread
from engine.costs.profile_config import ProfileConfig
from engine.engine import SpeculativeEngine


def overhead_configs(widths: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(depth, verify, width): V and depth varied apart so their shares can be told apart."""
    wide = max(widths)
    configs = [(1, 0, 1), (1, 1, 1), (4, 1, 1), (4, 4, 1), (2, 4, wide), (3, 16, wide)]
    return list(dict.fromkeys(configs))


def measure_overhead(
    engine: SpeculativeEngine, config: ProfileConfig, ids: Callable[[int], list[int]], bar: tqdm
) -> dict:
    """Per-cycle overhead from real cycles: total - forwards - controller, fitted as
    base + per_node * V + per_draft_row * (depth - 1) * W. Requests are round-robin over the
    configurations, like the forward cells (``ids(n)``: n random token ids)."""
    configs, need = overhead_configs(config.widths), config.overhead_cycles
    samples: dict[tuple, list[float]] = {c: [] for c in configs}
    ar: list[float] = []  # autoregressive steps (no controller): total - forward
    rows, ctrl_calls = [], []
    prompt = ids(config.overhead_prompt_len)
    engine.generate(prompt, max_new_tokens=3, controller=StaticController(2, 2, tree_width=1))  # warm-up
    for attempt in range(4):  # EOS can end a request early: top up with other prompts
        tokens = prompt if attempt == 0 else ids(len(prompt))
        if len(ar) < need:
            res = engine.generate(tokens, max_new_tokens=need + 2, controller=None)
            ar += [r.total_s - r.forward_s for r in res.cycles[1:]]
            bar.update(1)
        for depth, verify, width in configs:
            if len(samples[(depth, verify, width)]) >= need:
                continue
            res = engine.generate(
                tokens,
                max_new_tokens=need * (depth + 1) + 2,
                controller=StaticController(depth, verify, tree_width=width),
            )
            for rec in res.cycles[1:]:  # the first cycle of a request warms the new shapes up
                if rec.depth == 0:
                    continue  # autoregressive fallback near the budget
                over = rec.total_s - rec.forward_s - rec.controller_s
                samples[(depth, verify, width)].append(over)
                rows.append((rec.num_verified, (rec.depth - 1) * width, over))
                ctrl_calls.append(rec.controller_s / (rec.depth + 1))
            bar.update(1)
    per_config = []
    for (depth, verify, width), got in samples.items():
        med, spread = median_spread(got) if got else (float("nan"), 0.0)
        per_config.append(
            {
                "depth": depth,
                "verify": verify,
                "width": width,
                "median_s": med,
                "spread": spread,
                "cycles": len(got),
            }
        )
    coef, spread = fit_overhead(np.asarray(rows, dtype=np.float64).reshape(-1, 3))
    return {
        "coef": coef,
        "spread": spread,
        "ar": median_spread(ar)[0] if ar else 0.0,
        "policy_call_s": float(np.median(ctrl_calls)) if ctrl_calls else 0.0,
        "configs": per_config,
    }


def fit_overhead(rows: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares of overhead on [1, V, draft rows] with non-negative coefficients (a negative share
    is noise: drop that term and refit); returns (coefficients, IQR/median of measured / fitted)."""
    x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
    y = rows[:, 2]
    active = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [i for i in active if coef[i] < 0 and i != 0]
        if not negative:
            break
        active.remove(negative[0])
    coef[0] = max(coef[0], 0.0)
    fitted = x @ coef
    ratio = y / np.where(fitted > 0, fitted, np.nan)
    ratio = ratio[np.isfinite(ratio)]
    return coef, (median_spread(ratio.tolist())[1] if ratio.size else 0.0)
