"""The device cost profile: what one cycle costs, measured by the engine itself (docs/design.md section 6).

Replay environments take their time from a ``CostProfile`` instead of a clock: draft step time by
frontier width and context, the first draft step by the number of pending tokens, verification time by
the number of verified nodes and context, the fixed per-cycle overhead, the controller call, prefill,
each with its measured noise. This is the article's c and g(gamma) made empirical. ``engine.costs.measure_costs``
measures one (``python -m engine.costs.measure_costs``); this module holds and queries it (its file:
``engine.costs.profile_io``; its report: ``engine.costs.profile_report``).

*Context* everywhere is the committed token count at the start of the cycle (``CycleRecord.context_len``).
Queries interpolate piecewise-linearly; below the grid they clamp, above it they extrapolate linearly
with the last segment's slope (never decreasing: noise must not make a longer context cheaper).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from engine.costs.profile_io import PROFILE_VERSION, ProfileError, read_profile, write_profile
from engine.costs.profile_report import format_profile
from engine.errors import DraftpilotError, InputError

_IQR_PER_SIGMA = 0.6744897501960817  # standard normal quartile: IQR/median of lognormal = 2 sinh(q sigma)


def spread_to_sigma(spread: float) -> float:
    """Lognormal sigma whose IQR/median equals ``spread``."""
    return math.asinh(max(float(spread), 0.0) / 2.0) / _IQR_PER_SIGMA


def median_spread(samples: list[float]) -> tuple[float, float]:
    """(median, IQR / median) of timed samples: a profile cell's time and spread."""
    arr = np.asarray(samples, dtype=np.float64)
    med = float(np.median(arr))
    iqr = float(np.percentile(arr, 75) - np.percentile(arr, 25))
    return med, (iqr / med if med > 0 else 0.0)


def _lerp(xs: np.ndarray, table: np.ndarray, x: float, extrapolate: bool = True) -> np.ndarray:
    """Piecewise-linear value of ``table`` [n, ...] at ``x`` along its first axis (grid ``xs``, ascending).
    Below the grid: the first row. Above: linear extrapolation, floored at the last row (or the last
    row itself when ``extrapolate`` is False)."""
    if len(xs) == 1 or x <= xs[0]:
        return table[0]
    if x >= xs[-1] and not extrapolate:
        return table[-1]
    i = min(int(np.searchsorted(xs, x, side="right")) - 1, len(xs) - 2)
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    value = table[i] + w * (table[i + 1] - table[i])
    return np.maximum(value, table[-1]) if x > xs[-1] else value


def _lerp2(
    xs: np.ndarray,
    contexts: np.ndarray,
    table: np.ndarray,
    x: float,
    context: float,
    extrapolate: bool = True,
) -> float:
    return float(_lerp(contexts, _lerp(xs, table, x, extrapolate), context, extrapolate))


class _Grid2:
    """A table [xs, contexts] as Python floats, read as ``_lerp2`` reads it: the same operations in the same
    order on the same doubles (so the same results, bit for bit), without numpy's per-call cost on scalars
    (the replays and the server replay ask the profile millions of times)."""

    __slots__ = ("xs", "contexts", "rows", "last_x", "last_c")

    def __init__(self, xs: np.ndarray, contexts: np.ndarray, table: np.ndarray):
        self.xs, self.contexts = [float(v) for v in xs], [float(v) for v in contexts]
        self.rows = [[float(v) for v in row] for row in np.asarray(table, dtype=np.float64)]
        self.last_x, self.last_c = len(self.xs) - 1, len(self.contexts) - 1

    def _column(self, x: float, c: int, extrapolate: bool) -> float:
        xs, rows, n = self.xs, self.rows, self.last_x
        if n == 0 or x <= xs[0]:
            return rows[0][c]
        if x >= xs[n] and not extrapolate:
            return rows[n][c]
        i = min(bisect.bisect_right(xs, x) - 1, n - 1)
        w = (x - xs[i]) / (xs[i + 1] - xs[i])
        value = rows[i][c] + w * (rows[i + 1][c] - rows[i][c])
        return max(value, rows[n][c]) if x > xs[n] else value

    def at(self, x: float, context: float, extrapolate: bool = True) -> float:
        cs, m = self.contexts, self.last_c
        if m == 0 or context <= cs[0]:
            return self._column(x, 0, extrapolate)
        if context >= cs[m] and not extrapolate:
            return self._column(x, m, extrapolate)
        j = min(bisect.bisect_right(cs, context) - 1, m - 1)
        w = (context - cs[j]) / (cs[j + 1] - cs[j])
        low, high = self._column(x, j, extrapolate), self._column(x, j + 1, extrapolate)
        value = low + w * (high - low)
        return max(value, self._column(x, m, extrapolate)) if context > cs[m] else value


def chunk_curve(profile: Any, max_pending: int, context: int) -> np.ndarray:
    """``profile.draft_chunk_s(p, context)`` for p = 1 .. ``max_pending``: the profile's own vectorised
    ``draft_chunk_curve`` where it has one, else one call per count (profiles of the replay interface)."""
    curve = getattr(profile, "draft_chunk_curve", None)
    if curve is not None:
        return curve(max_pending, context)
    return np.array([profile.draft_chunk_s(p, context) for p in range(1, max_pending + 1)], dtype=np.float64)


@dataclass
class CostProfile:
    """Measured cycle costs on one device, pair and dtype (seconds; spreads are IQR/median over reps).

    Tables are indexed [grid value, context]. Build one with ``engine.costs.measure_costs.measure_profile`` or by
    hand (tests); ``save``/``load`` round-trip it through JSON.
    """

    contexts: list[int]
    """Context grid (committed tokens), ascending."""
    widths: list[int]
    """Frontier widths W of the draft steps after the first, ascending."""
    draft_step_table: list[list[float]]
    """[W, context] median time of one draft forward over a frontier of W nodes (tree mask if W > 1)."""
    sizes: list[int]
    """Verified-node counts V, ascending (0 = the root alone, an autoregressive target step)."""
    verify_table: list[list[float]]
    """[V, context] median time of the target forward over the root and V nodes."""
    verify_chain_table: list[list[float]] = field(default_factory=list)
    """[V, context] median time of the target forward over the root and a CHAIN of V nodes (causal, no tree
    mask: what the engine runs for chains); empty: chains are charged like trees (``verify_table``)."""
    chunks: list[int] = field(default_factory=list)
    """Pending-token counts P of the first draft step (a causal chunk); empty: use the width table."""
    draft_chunk_table: list[list[float]] = field(default_factory=list)
    """[P, context] median time of the first draft step over P pending tokens."""
    prefill_lengths: list[int] = field(default_factory=list)
    prefill_target_s: list[float] = field(default_factory=list)
    prefill_draft_s: list[float] = field(default_factory=list)
    overhead_base_s: float = 0.0
    """Per-cycle time outside forwards and controller, at depth 1 and V = 0."""
    overhead_per_node_s: float = 0.0
    """Extra overhead per verified node (acceptance sampling over more rows, cache compaction)."""
    overhead_per_draft_row_s: float = 0.0
    """Extra overhead per draft logit row after the first (log-softmax, top-k, tree bookkeeping)."""
    ar_overhead_s: float = 0.0
    """Overhead of an autoregressive step (depth 0: no draft, no tree)."""
    policy_call_s: float = 0.0
    """One controller call measured with a trivial policy (the engine's state building); a learned
    policy's own inference time comes on top."""
    draft_step_spread: list[list[float]] = field(default_factory=list)
    verify_spread: list[list[float]] = field(default_factory=list)
    verify_chain_spread: list[list[float]] = field(default_factory=list)
    draft_chunk_spread: list[list[float]] = field(default_factory=list)
    overhead_spread: float = 0.0
    """IQR/median of measured overhead over its fitted value."""
    batched: dict[str, Any] = field(default_factory=dict)
    """The batch axis (``engine.costs.measure_costs --batch-axis``; empty otherwise, and in older profiles): forwards
    through ``engine.batch_forward.forward_rows`` carrying several sequences, each on its own cache, as
    ``engine.batch`` runs them. ``context``: committed tokens of every sequence; ``target`` / ``draft``: lists
    of [sequences, rows in all, median seconds] (target: each sequence's root and a chain of nodes, causal;
    draft: a frontier of nodes at one depth per sequence); ``target_spread`` / ``draft_spread``: the
    IQR/median of each entry, in the same order. Query with ``batched_forward_s``. A batch axis fitted to a live
    server's step log (``envs.step_costs``, ``benchmarks/step_costs.py``) holds linear tables and
    ``step_overhead_s``: what each step costs beyond its forwards and per-cycle overheads (the server replay's
    default step overhead)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Conditions: device, dtype, pair, versions, threads, random_weights, date, measurement config."""
    details: dict[str, Any] = field(default_factory=dict)
    """Extra measurements kept for reports (prefill spreads, per-configuration overhead medians)."""
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._curve_rows: dict[tuple[str, int], np.ndarray] = {}
        self._grids: dict[str, _Grid2] = {}
        shapes = {
            "draft_step": (self.widths, "draft_step_table"),
            "verify": (self.sizes, "verify_table"),
            "draft_chunk": (self.chunks, "draft_chunk_table"),
            "verify_chain": (self.sizes if self.verify_chain_table else [], "verify_chain_table"),
        }
        self._arrays["contexts"] = self._grid("contexts", self.contexts)
        for key, (grid, table_name) in shapes.items():
            if key in ("draft_chunk", "verify_chain") and not grid:
                continue
            self._arrays[key + "_grid"] = self._grid(key, grid)
            table = np.asarray(getattr(self, table_name), dtype=np.float64)
            want = (len(grid), len(self.contexts))
            if table.shape != want or not np.all(np.isfinite(table)) or np.any(table < 0):
                raise ProfileError(
                    f"{table_name} must be a {want} table of finite times >= 0, got {table.shape}"
                )
            self._arrays[key] = table
            spread = getattr(self, key + "_spread")
            spread = np.zeros(want) if not len(spread) else np.asarray(spread, dtype=np.float64)
            if spread.shape != want:
                raise ProfileError(f"{key}_spread must have shape {want}, got {spread.shape}")
            self._arrays[key + "_sigma"] = np.vectorize(spread_to_sigma, otypes=[float])(spread)
        if self.batched:
            self._check_batched()
        if len(self.prefill_target_s) != len(self.prefill_lengths) or (
            self.prefill_draft_s and len(self.prefill_draft_s) != len(self.prefill_lengths)
        ):
            raise ProfileError("prefill times must have one entry per prefill length")
        scalars = {
            name: getattr(self, name)
            for name in (
                "overhead_base_s",
                "overhead_per_node_s",
                "overhead_per_draft_row_s",
                "ar_overhead_s",
                "policy_call_s",
                "overhead_spread",
            )
        }
        scalars.update(prefill_target_s=self.prefill_target_s, prefill_draft_s=self.prefill_draft_s)
        for name, value in scalars.items():
            try:
                values = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError):
                raise ProfileError(f"{name} must be a number of seconds, got {value!r}") from None
            if not np.all(np.isfinite(values)):
                raise ProfileError(f"{name} must be finite, got {value!r}")

    def _check_batched(self) -> None:
        """``batched`` holds a context and, per model, a full grid of sequences x rows per sequence of finite
        times >= 0 (and spreads, if any, one per entry); kept as arrays [rows per sequence, sequences]."""
        table = self.batched
        context = table.get("context") if isinstance(table, dict) else None
        overhead = table.get("step_overhead_s", 0.0) if isinstance(table, dict) else 0.0
        if (
            isinstance(overhead, bool)
            or not isinstance(overhead, (int, float))
            or not 0 <= overhead < math.inf
        ):
            raise ProfileError(f"batched['step_overhead_s'] must be seconds >= 0, got {overhead!r}")
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ProfileError(f"batched must hold a positive integer context, got {context!r}")
        for key in ("target", "draft"):
            entries = table.get(key)
            try:
                arr = np.asarray(entries, dtype=np.float64)
            except (TypeError, ValueError):
                arr = np.zeros((0, 0))
            if arr.ndim != 2 or arr.shape[1:] != (3,) or not len(arr) or not np.all(np.isfinite(arr)):
                raise ProfileError(
                    f"batched[{key!r}] must be a list of [sequences, rows, seconds], got {entries!r}"
                )
            sequences, rows, seconds = arr.T
            per = rows / np.maximum(sequences, 1)
            s_grid, r_grid = np.unique(sequences), np.unique(per)
            if (
                np.any(sequences < 1)
                or np.any(sequences != np.round(sequences))
                or np.any(per != np.round(per))
                or np.any(per < 1)
                or np.any(seconds < 0)
                or len(arr) != len(s_grid) * len(r_grid)
                or len({(a, b) for a, b in zip(sequences, per)}) != len(arr)
            ):
                raise ProfileError(
                    f"batched[{key!r}] must cover a grid of sequences x rows per sequence (integers >= 1, rows "
                    f"a multiple of sequences) with times >= 0, got {entries!r}"
                )
            spread = table.get(key + "_spread") or []
            if not isinstance(spread, list) or len(spread) not in (0, len(arr)):
                raise ProfileError(f"batched[{key + '_spread'!r}] must have one entry per {key} entry")
            grid = np.zeros((len(r_grid), len(s_grid)))
            for s, r, t in zip(sequences, per, seconds):
                grid[np.searchsorted(r_grid, r), np.searchsorted(s_grid, s)] = t
            self._arrays["batched_" + key] = grid
            self._arrays["batched_" + key + "_grid"] = (r_grid, s_grid)

    @staticmethod
    def _grid(name: str, values: list[int]) -> np.ndarray:
        grid = np.asarray(values, dtype=np.float64)
        if grid.ndim != 1 or grid.size == 0 or np.any(np.diff(grid) <= 0):
            raise ProfileError(f"{name} grid must be a non-empty ascending list, got {values!r}")
        return grid

    # ------------------------------------------------------------------------------------------ queries
    def _at(self, key: str, x: float, context: float, extrapolate: bool = True) -> float:
        """``_lerp2`` of table ``key`` (its grid ``<key>_grid``, the contexts; a ``<name>_sigma`` table reads
        ``<name>_grid``; ``batched_<model>`` its own pair of grids) at (x, context), through its ``_Grid2``."""
        grid = self._grids.get(key)
        if grid is None:
            a = self._arrays
            if key.startswith("batched_"):
                xs, contexts = a[key + "_grid"]
            else:
                xs, contexts = a[key.removesuffix("_sigma") + "_grid"], a["contexts"]
            grid = self._grids[key] = _Grid2(xs, contexts, a[key])
        return grid.at(x, context, extrapolate)

    def draft_step_s(self, width: int, context: int) -> float:
        """One draft forward over a frontier of ``width`` nodes at ``context``."""
        return self._at("draft_step", width, context)

    def draft_chunk_s(self, num_pending: int, context: int) -> float:
        """The first draft step of a cycle: a causal chunk of ``num_pending`` tokens."""
        if "draft_chunk" not in self._arrays:
            return self.draft_step_s(num_pending, context)
        return self._at("draft_chunk", num_pending, context)

    def draft_chunk_curve(self, max_pending: int, context: int) -> np.ndarray:
        """``draft_chunk_s(p, context)`` for p = 1 .. ``max_pending`` as one array, the same values (the
        hindsight oracle reads every pending count at every position)."""
        key = "draft_chunk" if "draft_chunk" in self._arrays else "draft_step"
        rows = self._curve_rows.get((key, max_pending))
        if rows is None:
            a = self._arrays
            rows = np.stack([_lerp(a[key + "_grid"], a[key], p) for p in range(1, max_pending + 1)])
            self._curve_rows[(key, max_pending)] = rows
        return np.asarray(_lerp(self._arrays["contexts"], rows.T, context), dtype=np.float64)

    def verify_s(self, num_nodes: int, context: int, chain: bool = False) -> float:
        """The target forward over the root and ``num_nodes`` verified nodes at ``context``; ``chain``: the
        nodes form a chain (the engine runs it causally, without a tree mask: another, cheaper kernel path
        on CPU once there are 4+ rows)."""
        # the root alone (an autoregressive step) is one causal row whatever the draft's shape: the same
        # forward in both tables, read from the chain one (no mask, as the engine runs it), so that one noisy
        # cell of the tree table cannot make autoregressive steps look dearer than they are
        chain = chain or num_nodes == 0
        key = "verify_chain" if chain and "verify_chain" in self._arrays else "verify"
        return self._at(key, num_nodes, context)

    def overhead_s(self, num_nodes: int, depth: int = 1, tree_width: int = 1) -> float:
        """Per-cycle time outside forwards and controller; ``depth=0`` is an autoregressive step."""
        if depth <= 0:
            return self.ar_overhead_s
        draft_rows = (depth - 1) * tree_width  # logit rows after the first step's single row
        return (
            self.overhead_base_s
            + self.overhead_per_node_s * num_nodes
            + self.overhead_per_draft_row_s * draft_rows
        )

    def prefill_s(self, prompt_len: int, with_draft: bool = True) -> float:
        """Target prefill (plus the draft's when ``with_draft``) of a ``prompt_len``-token prompt."""
        if not self.prefill_lengths:
            raise ProfileError("this profile has no prefill measurements")
        lengths = np.asarray(self.prefill_lengths, dtype=np.float64)
        total = float(_lerp(lengths, np.asarray(self.prefill_target_s), prompt_len))
        if with_draft and self.prefill_draft_s:
            total += float(_lerp(lengths, np.asarray(self.prefill_draft_s), prompt_len))
        return total

    def cycle_parts(
        self, depth: int, num_verified: int, context: int, tree_width: int = 1, num_pending: int = 1
    ) -> dict[str, float]:
        """The expected cycle time split into first draft step, later draft steps, verify and overhead."""
        if depth <= 0:
            return {
                "first_draft_s": 0.0,
                "more_draft_s": 0.0,
                "verify_s": self.verify_s(0, context),
                "overhead_s": self.ar_overhead_s,
            }
        return {
            "first_draft_s": self.draft_chunk_s(num_pending, context),
            "more_draft_s": (depth - 1) * self.draft_step_s(tree_width, context),
            "verify_s": self.verify_s(num_verified, context, chain=tree_width == 1),
            "overhead_s": self.overhead_s(num_verified, depth, tree_width),
        }

    def cycle_s(
        self,
        depth: int,
        num_verified: int,
        context: int,
        tree_width: int = 1,
        num_pending: int = 1,
        controller_calls: int = 0,
    ) -> float:
        """Expected time T(D, V, context) of one cycle: the first draft step over ``num_pending`` tokens,
        ``depth - 1`` frontier steps of width ``tree_width``, the verification, the overhead, and
        ``controller_calls`` controller calls (0 by default: charge the policy separately)."""
        parts = self.cycle_parts(depth, num_verified, context, tree_width, num_pending)
        return sum(parts.values()) + controller_calls * self.policy_call_s

    def sample_cycle_s(
        self,
        depth: int,
        num_verified: int,
        context: int,
        tree_width: int = 1,
        rng: np.random.Generator | None = None,
        num_pending: int = 1,
        controller_calls: int = 0,
    ) -> float:
        """``cycle_s`` with measured noise: each forward and the overhead is scaled by an independent
        lognormal factor of median 1 whose IQR/median is the measured spread of that cell."""
        if rng is None:
            raise ValueError("sample_cycle_s needs an explicit np.random.Generator (rng=...)")
        a = self._arrays
        parts = self.cycle_parts(depth, num_verified, context, tree_width, num_pending)
        sigma_verify = self._at("verify_sigma", num_verified, context, False)
        total = parts["verify_s"] * math.exp(sigma_verify * rng.standard_normal())
        total += parts["overhead_s"] * math.exp(spread_to_sigma(self.overhead_spread) * rng.standard_normal())
        if depth > 0:
            key = "draft_chunk" if "draft_chunk" in a else "draft_step"
            sigma_first = self._at(key + "_sigma", num_pending, context, False)
            total += parts["first_draft_s"] * math.exp(sigma_first * rng.standard_normal())
            if depth > 1:
                sigma_step = self._at("draft_step_sigma", tree_width, context, False)
                step = self.draft_step_s(tree_width, context)
                total += float(np.sum(step * np.exp(sigma_step * rng.standard_normal(depth - 1))))
        return total + controller_calls * self.policy_call_s

    def noise_scale(self, rng: np.random.Generator) -> float:
        """One lognormal factor with the median spread of all forward cells (a coarse whole-cycle noise)."""
        sigma = float(
            np.median(
                np.concatenate(
                    [self._arrays["verify_sigma"].ravel(), self._arrays["draft_step_sigma"].ravel()]
                )
            )
        )
        return math.exp(sigma * rng.standard_normal())

    def batched_forward_s(self, model: str, sequences: int, rows: int) -> float:
        """One batched forward of ``model`` ("target" or "draft") carrying ``sequences`` sequences and ``rows``
        rows in all (``rows / sequences`` each) at the table's context (``batched["context"]``): piecewise
        linear between the measured grid points, clamped below, extrapolated above (as every table here).
        ``ProfileError`` if the profile has no batch axis."""
        if model not in ("target", "draft"):
            raise ValueError(f"model must be 'target' or 'draft', got {model!r}")
        if not self.batched:
            raise ProfileError(
                "this profile has no batch axis: measure it with `python -m engine.costs.measure_costs --batch-axis`"
            )
        return self._at("batched_" + model, rows / max(sequences, 1), sequences)

    def batched_grid(self, model: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batch axis of ``model`` as arrays: (rows per sequence, sequences, seconds [rows per sequence,
        sequences])."""
        r_grid, s_grid = self._arrays["batched_" + model + "_grid"]
        return r_grid, s_grid, self._arrays["batched_" + model]

    def c_ratio(self, context: int) -> float:
        """The article's c: one draft step (W = 1) over one target step (V = 0) at ``context``."""
        return self.draft_step_s(1, context) / self.verify_s(0, context)

    # --------------------------------------------------------------------------------------- save/load
    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON, atomically (``engine.costs.profile_io.write_profile``)."""
        return write_profile(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        """Read a profile written by ``save``; raises ``FileNotFoundError`` or ``ProfileError``."""
        path = Path(path)
        kwargs = read_profile(path, (f.name for f in fields(cls)))
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as err:
            raise ProfileError(f"{path} is not a valid cost profile: {err}") from err

    # ----------------------------------------------------------------------------------------- display
    def format_table(self) -> str:
        """A compact plain-text report: times in ms with the spread in percent (``profile_report``)."""
        return format_profile(self)


def load_profile_arg(path: str | Path) -> CostProfile:
    """``CostProfile.load`` of a profile given on a command line: what is wrong with it names ``--profile``."""
    try:
        return CostProfile.load(path)
    except (DraftpilotError, OSError) as err:
        raise InputError(f"--profile: {err}") from None
