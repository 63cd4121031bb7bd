"""Measurements: one measured request as a plain (JSON-ready) dict, the decision-logging wrapper around the
learned controller, and the reduction of measurements to the reported figures.

A measurement: ``tokens``, ``num_tokens``, ``total_s`` (prefill + decode), ``ttft_s``, ``decode_s``,
``finish_reason``, ``peak_memory_mb`` and ``cycles``: one row per decode cycle, columns ``CYCLE_FIELDS``
(transformers' peers: one row per assisted step, verified and depth unknown = -1).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from engine.control import Controller, DraftState
from engine.results import CycleRecord

CYCLE_FIELDS = ("emitted", "seconds", "accepted", "verified", "depth")


def run_engine(engine, ids: list[int], controller: Controller | None, max_new_tokens: int, seed: int) -> dict:
    """One ``SpeculativeEngine.generate`` call as a measurement."""
    res = engine.generate(ids, max_new_tokens=max_new_tokens, controller=controller, seed=seed)
    cycles = [  # accepted and verified: -1 for an autoregressive step (no draft, no lookup); last: lookup
        [
            c.emitted,
            c.total_s,
            c.accepted if c.depth or c.lookup else -1,
            c.num_verified if c.depth or c.lookup else -1,
            c.depth,
            int(c.lookup),
        ]
        for c in res.cycles
    ]
    decode_s = float(sum(c.total_s for c in res.cycles))
    return {
        "tokens": list(res.tokens),
        "num_tokens": len(res.tokens),
        "total_s": res.prefill_s + decode_s,
        "ttft_s": res.prefill_s,
        "decode_s": decode_s,
        "finish_reason": res.finish_reason,
        "peak_memory_mb": res.peak_memory_bytes / 2**20,
        "cycles": cycles,
        "first_chunk": 1,
    }


class DecisionLoggingController(Controller):
    """Delegates to ``inner`` and logs every decision, for the action maps of the report.

    ``depth_log`` rows: (context_len, depth, top step prob, max frontier path prob, continue 0/1);
    ``size_log`` rows: (context_len, depth, nodes drafted, top node path prob, nodes to verify).
    """

    def __init__(self, inner: Controller):
        self.inner = inner
        self.tree_width = inner.tree_width
        # the wrapped policy is asked what it is asked live
        self.decides_depth_zero = inner.decides_depth_zero
        self.depth_log: list[tuple] = []
        self.size_log: list[tuple] = []

    def reset(self) -> None:
        self.inner.reset()

    def should_continue(self, state: DraftState) -> bool:
        go = bool(self.inner.should_continue(state))
        drafted = state.depth > 0  # before drafting (depth 0) there are no step or frontier probabilities
        self.depth_log.append(
            (
                state.context_len,
                state.depth,
                float(np.max(state.step_probs)) if drafted else float("nan"),
                float(np.exp(state.frontier_scores[0])) if drafted else float("nan"),
                int(go),
            )
        )
        return go

    def num_to_verify(self, state: DraftState) -> int:
        size = int(self.inner.num_to_verify(state))
        self.size_log.append(
            (
                state.context_len,
                state.depth,
                len(state.node_scores),
                float(np.exp(state.node_scores[0])),
                size,
            )
        )
        return size

    def observe(self, record: CycleRecord) -> None:
        self.inner.observe(record)

    def __repr__(self) -> str:
        return f"DecisionLoggingController({self.inner!r})"


# ---------------------------------------------------------------------------------------------- reduction
def per_prompt(runs: Iterable[dict]) -> dict[str, dict[str, dict]]:
    """controller -> prompt id -> one row: medians over repetitions of the times, pooled cycles."""
    grouped: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for run in runs:
        grouped[(run["controller"], run["prompt_id"])].append(run)
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for (name, pid), reps in grouped.items():
        first = reps[0]
        row = {
            "prompt_id": pid,
            "language": first["language"],
            "reps": len(reps),
            "num_tokens": statistics.median(r["num_tokens"] for r in reps),
            "decode_tokens": statistics.median(r["num_tokens"] - r["first_chunk"] for r in reps),
            "cycles": [c for r in reps for c in r["cycles"]],
            "peak_memory_mb": max(r["peak_memory_mb"] for r in reps),
        }
        for key in ("total_s", "ttft_s", "decode_s"):
            row[key] = statistics.median(r[key] for r in reps)
        out[name][pid] = row
    return dict(out)


def itl_samples(cycles: Sequence[Sequence[float]]) -> np.ndarray:
    """Amortised inter-token latencies: a cycle of T seconds committing n tokens gives n samples of T/n."""
    parts = [np.full(int(c[0]), c[1] / c[0]) for c in cycles if c[0] > 0]
    return np.concatenate(parts) if parts else np.zeros(0)


def accepted_lengths(cycles: Sequence[Sequence[float]]) -> list[int]:
    """Accepted drafted tokens of every speculative cycle (autoregressive steps excluded)."""
    return [int(c[2]) for c in cycles if c[2] >= 0]


def aggregate(rows: Sequence[dict]) -> dict[str, float]:
    """The reported figures of one controller over some prompts (per-prompt rows from ``per_prompt``)."""
    nan = float("nan")
    tokens = sum(r["num_tokens"] for r in rows)
    total = sum(r["total_s"] for r in rows)
    decode_tokens = sum(r["decode_tokens"] for r in rows)
    decode = sum(r["decode_s"] for r in rows)
    cycles = [c for r in rows for c in r["cycles"]]
    itl = itl_samples(cycles)
    accepted = accepted_lengths(cycles)

    def pct(q: float) -> float:
        return float(np.percentile(itl, q)) if itl.size else nan

    return {
        "prompts": float(len(rows)),
        "tokens": float(tokens),
        "total_s": float(total),
        "tokens_per_s": tokens / total if total > 0 else nan,
        "decode_tokens_per_s": decode_tokens / decode if decode > 0 else nan,
        "mean_accepted": float(np.mean(accepted)) if accepted else nan,
        "ttft_s": float(np.median([r["ttft_s"] for r in rows])) if rows else nan,
        "itl_p50_s": pct(50),
        "itl_p90_s": pct(90),
        "itl_p99_s": pct(99),
        "peak_memory_mb": max((r["peak_memory_mb"] for r in rows), default=nan),
    }


def group_by_language(rows: dict[str, dict]) -> dict[str, list[dict]]:
    """language -> rows (in prompt order), plus "all"."""
    out: dict[str, list[dict]] = defaultdict(list)
    for row in rows.values():
        out[row["language"]].append(row)
    out["all"] = list(rows.values())
    return dict(out)
