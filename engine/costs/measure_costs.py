"""Measuring a ``CostProfile`` (``engine.costs.cost_profile``): the engine's own forwards, timed on the device, and the
command line that writes the profile file.

    python -m engine.costs.measure_costs --pair tiny --quick --out runs/profile_tiny.json

Every timed call is exactly the forward the engine issues in a cycle (same ``_forward``, masks, positions
and ``logits_to_keep``) on a KV cache holding the given context, cropped back (outside the clock) before
each call. Token ids are random: time does not depend on them. Warm-up rounds are excluded; clocks
synchronise the device; cells are timed round-robin in random order (see ``_Profiler``).

With ``--batch-axis`` (``ProfileConfig.batch_axis``) the profile also gets the batch axis: batched forwards
through ``engine.batch_forward.forward_rows`` (what ``engine.batch.BatchedEngine`` runs: one forward carrying
several sequences, each on its own cache) by sequences and rows per sequence at one context, timed in the
same rounds (``CostProfile.batched``). Off by default: the replay environments and training do not use it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.backends.attention import MAX_ROWWISE_ROWS, MAX_VERIFY_NODES
from engine.backends.kvcache import keep_entries, new_cache
from engine.backends.pair import ModelPair
from engine.batch_forward import Rows, forward_rows
from engine.cli import (
    CLI_ERRORS,
    ArgumentParser,
    ModelConfig,
    add_dataclass_args,
    apply_preset,
    check_output_file,
    from_args,
    report_error,
)
from engine.control import StaticController
from engine.costs.cost_profile import CostProfile
from engine.engine import SpeculativeEngine
from engine.errors import InputError, is_int
from engine.tree import MAX_TREE_NODES, ancestor_matrix, tree_attention_mask

LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class ProfileConfig:
    """What to measure (grids) and how often."""

    contexts: tuple[int, ...] = (128, 512, 1024, 2048)
    """Context lengths (committed tokens); also the prefill lengths."""
    widths: tuple[int, ...] = (1, 2, 4, 8)
    """Frontier widths of the later draft steps."""
    chunks: tuple[int, ...] = (1, 2, 3, 5, 9)
    """Pending-token counts of the first draft step (usually 1 or 2; more after autoregressive steps)."""
    sizes: tuple[int, ...] = LADDER
    """Verified-node counts (the size ladder)."""
    reps: int = 5
    """Timed rounds (every cell is called once per round, in a fresh random order)."""
    warmup: int = 1
    """Untimed rounds before the timed ones."""
    prefill_reps: int = 2
    """Timed prefills per length (each also builds the cache the cells of that context use)."""
    overhead_cycles: int = 8
    """Engine cycles measured per overhead configuration."""
    overhead_prompt_len: int = 32
    """Prompt length of the overhead runs (short: overhead hardly depends on context, prefill is slow)."""
    seed: int = 0
    """Seeds the random token ids and the order in which the cells are timed."""
    batch_axis: bool = False
    """Also time batched forwards (``engine.batch_forward.forward_rows``: several sequences, each on its own
    cache, in one forward) by sequences and rows per sequence at ``batch_context``: the profile's ``batched``
    table. Off by default (the replay environments and training do not use it)."""
    batch_sequences: tuple[int, ...] = (1, 2, 4, 8)
    """Sequences of the batched forwards (with ``batch_axis``)."""
    batch_rows: tuple[int, ...] = (1, 2, 4, 8)
    """Rows per sequence of the batched forwards (with ``batch_axis``): the target verifies a root and a chain
    of rows - 1 nodes; the draft runs a frontier of that many nodes at one depth (a draft step)."""
    batch_context: int = 0
    """Context (committed tokens of every sequence) of the batched forwards: one of ``contexts``; 0: the
    median one, ``contexts[(len(contexts) - 1) // 2]``."""

    def __post_init__(self) -> None:
        """Ranges that hold for every pair (``check_fits`` adds the pair's context and vocabulary)."""
        for name, low, high in (
            ("contexts", 1, None),
            ("widths", 1, MAX_TREE_NODES),
            ("chunks", 1, None),
            ("sizes", 0, MAX_VERIFY_NODES),
            ("batch_sequences", 1, None),
            ("batch_rows", 1, MAX_ROWWISE_ROWS),
        ):
            grid = getattr(self, name)
            if (
                not isinstance(grid, (tuple, list))
                or not grid
                or not all(is_int(v) for v in grid)
                or list(grid) != sorted(set(grid))
                or grid[0] < low
                or (high is not None and grid[-1] > high)
            ):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{name} ({flag}) must be distinct ascending integers {bound}, got {grid!r}")
        for name, low in (
            ("reps", 1),
            ("warmup", 0),
            ("prefill_reps", 1),
            ("overhead_cycles", 1),
            ("overhead_prompt_len", 1),
            ("seed", 0),
        ):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{name} ({flag}) must be an integer >= {low}, got {value!r}")
        if not isinstance(self.batch_axis, bool):
            raise InputError(f"batch_axis (--batch-axis) must be True or False, got {self.batch_axis!r}")
        if not is_int(self.batch_context) or (self.batch_context and self.batch_context not in self.contexts):
            raise InputError(
                f"batch_context (--batch-context) must be 0 or one of the contexts {self.contexts}, got "
                f"{self.batch_context!r}"
            )
        if self.contexts[0] <= self.chunks[-1]:
            raise InputError(
                f"contexts (--contexts) must all exceed the largest chunk ({self.chunks[-1]}): the "
                f"first draft step runs the chunk on top of the context, got {self.contexts}"
            )

    def check_fits(self, max_context: int, vocab_size: int, where: str = "this pair") -> None:
        """The grids fit a pair with this context limit and vocabulary (``InputError`` otherwise)."""
        rows = max(self.sizes[-1] + 1, self.widths[-1], self.chunks[-1])
        if self.batch_axis:
            rows = max(rows, self.batch_rows[-1])
        if self.contexts[-1] + rows > max_context:
            raise InputError(
                f"contexts (--contexts) must lie in ({self.chunks[-1]}, {max_context - rows}] for "
                f"{where} (context limit {max_context}) and this grid, got {self.contexts}"
            )
        if self.widths[-1] > vocab_size:
            raise InputError(
                f"widths (--widths) must not exceed the vocabulary of {where} ({vocab_size} tokens), "
                f"got {self.widths}"
            )
        if self.overhead_prompt_len >= max_context:
            raise InputError(
                f"overhead_prompt_len (--overhead-prompt-len) must be below the context limit of "
                f"{where} ({max_context}), got {self.overhead_prompt_len}"
            )

    @property
    def batch_ctx(self) -> int:
        """The context of the batched forwards (``batch_context``, 0 resolved)."""
        return self.batch_context or self.contexts[(len(self.contexts) - 1) // 2]

    @classmethod
    def quick(cls) -> ProfileConfig:
        """Seconds on the tiny pair; a plumbing check elsewhere."""
        return cls(
            contexts=(64, 256),
            widths=(1, 2),
            chunks=(1, 2),
            sizes=(0, 1, 4, 16),
            reps=2,
            warmup=1,
            prefill_reps=1,
            overhead_cycles=3,
            overhead_prompt_len=16,
        )


def _stats(samples: list[float]) -> tuple[float, float]:
    """(median, IQR / median)."""
    arr = np.asarray(samples, dtype=np.float64)
    med = float(np.median(arr))
    iqr = float(np.percentile(arr, 75) - np.percentile(arr, 25))
    return med, (iqr / med if med > 0 else 0.0)


@dataclass
class _Cell:
    """One timed forward: the model, the cache and exactly the arguments the engine passes."""

    key: str
    """"step", "chunk" or "verify"."""
    row: int
    """Index in the grid of its table."""
    col: int
    """Index of its context."""
    model: Any
    cache: Any
    ids: list[int]
    start: int
    keep: int = 0
    mask: torch.Tensor | None = None
    positions: list[int] | None = None
    samples: list[float] = field(default_factory=list)


@dataclass
class _BatchCell:
    """One timed batched forward: ``sequences`` sequences of ``rows`` rows each, each on its own cache (the
    arguments ``engine.batch`` passes ``forward_rows``)."""

    key: str
    """"target" (a chain verification per sequence) or "draft" (a frontier step per sequence)."""
    sequences: int
    rows: int
    """Rows per sequence."""
    model: Any
    caches: list[Any]
    ids: list[list[int]]
    start: int
    positions: list[int]
    mask: torch.Tensor | None = None
    samples: list[float] = field(default_factory=list)


def _copy_cache(model: torch.nn.Module, cache: Any) -> Any:
    """A new cache of ``model`` holding the same entries as ``cache`` (its own buffers)."""
    copy = new_cache(model)
    for mine, theirs in zip(copy.layers, cache.layers):
        mine.update(theirs.keys.clone(), theirs.values.clone())
    return copy


class _Profiler:
    """Round-robin timing: every round calls every cell once, in a fresh random order, so drift in the
    machine's load (shared machines) lands on all cells alike and shows up in their spread, instead of
    biasing whichever cells ran during a busy minute."""

    def __init__(self, pair: ModelPair, config: ProfileConfig, bar: tqdm):
        self.pair, self.config, self.bar = pair, config, bar
        self.engine = SpeculativeEngine(pair)
        self.clock = self.engine.clock
        self.rng = np.random.default_rng(config.seed)

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(0, self.pair.vocab_size, size=n).tolist()

    def prefills(self) -> tuple[list[list[float]], list[list[float]], list[tuple]]:
        """Timed prefills (the engine's: keep=1) per context, target and draft; the last round's caches
        are kept (they hold exactly ``ctx`` tokens) for the forward cells."""
        target_s = [[] for _ in self.config.contexts]
        draft_s = [[] for _ in self.config.contexts]
        caches: list[tuple] = []
        prompts = [self.ids(ctx) for ctx in self.config.contexts]
        for _ in range(self.config.prefill_reps):
            caches = []
            for j in self.rng.permutation(len(prompts)):
                pair_caches = []
                for model, times in ((self.pair.target, target_s), (self.pair.draft, draft_s)):
                    cache = new_cache(model)
                    t0 = self.clock()
                    self.engine._forward(model, prompts[j], 0, cache, keep=1)
                    times[j].append(self.clock() - t0)
                    pair_caches.append(cache)
                    self.bar.update(1)
                caches.append((j, *pair_caches))
        caches.sort(key=lambda c: c[0])
        return target_s, draft_s, [c[1:] for c in caches]

    def cells(self, caches: list[tuple]) -> list[_Cell]:
        pair, dtype, dev, cells = self.pair, self.pair.dtype, self.pair.device, []
        for col, (ctx, (target_cache, draft_cache)) in enumerate(zip(self.config.contexts, caches)):
            # later draft steps: W frontier nodes at one depth over the committed prefix (the engine's mask
            # for W > 1; the few earlier tree nodes the engine's cache also holds are left out)
            for row, w in enumerate(self.config.widths):
                mask = tree_attention_mask(ctx, np.eye(w, dtype=bool), dtype, dev) if w > 1 else None
                cells.append(
                    _Cell("step", row, col, pair.draft, draft_cache, self.ids(w), ctx, 0, mask, [ctx] * w)
                )
            # first draft step: the cache holds ctx - P tokens, the P pending ones run causally (keep=1)
            for row, p in enumerate(self.config.chunks):
                cells.append(_Cell("chunk", row, col, pair.draft, draft_cache, self.ids(p), ctx - p, keep=1))
            # verification: the cache holds ctx - 1 tokens; the root + V nodes of a binary tree, with the
            # tree mask the engine builds for any non-chain (V <= 1 is a chain: causal, no mask)
            for row, v in enumerate(self.config.sizes):
                anc = ancestor_matrix([-1] + [(j - 1) // 2 for j in range(1, v + 1)])
                positions = [ctx - 1 + int(anc[j].sum()) - 1 for j in range(v + 1)]  # by depth in the tree
                mask = tree_attention_mask(ctx - 1, anc, dtype, dev) if v >= 2 else None
                cells.append(
                    _Cell(
                        "verify",
                        row,
                        col,
                        pair.target,
                        target_cache,
                        self.ids(v + 1),
                        ctx - 1,
                        0,
                        mask,
                        positions,
                    )
                )
                # the same count as a chain: causal, no mask (the engine's path for chains)
                cells.append(
                    _Cell(
                        "verify_chain",
                        row,
                        col,
                        pair.target,
                        target_cache,
                        self.ids(v + 1),
                        ctx - 1,
                        0,
                        None,
                        list(range(ctx - 1, ctx + v)),
                    )
                )
        return cells

    def batch_cells(self, caches: list[tuple]) -> list[_BatchCell]:
        """Batched forwards at the batch context, each sequence on its own copy of that context's caches
        (made before any cell runs: they hold exactly the context). Target: every sequence verifies its root
        and a chain of rows - 1 nodes (causal, as the engine runs chains); draft: every sequence runs a
        frontier of ``rows`` nodes at one depth (the "step" cells' mask for rows > 1)."""
        config, pair = self.config, self.pair
        ctx = config.batch_ctx
        target_cache, draft_cache = caches[config.contexts.index(ctx)]
        most = config.batch_sequences[-1]
        targets = [_copy_cache(pair.target, target_cache) for _ in range(most)]
        drafts = [_copy_cache(pair.draft, draft_cache) for _ in range(most)]
        cells = []
        for s in config.batch_sequences:
            for r in config.batch_rows:
                cells.append(
                    _BatchCell(
                        "target",
                        s,
                        r,
                        pair.target,
                        targets[:s],
                        [self.ids(r) for _ in range(s)],
                        ctx - 1,
                        list(range(ctx - 1, ctx - 1 + r)),
                    )
                )
                mask = (
                    tree_attention_mask(ctx, np.eye(r, dtype=bool), pair.dtype, pair.device)
                    if r > 1
                    else None
                )
                cells.append(
                    _BatchCell(
                        "draft",
                        s,
                        r,
                        pair.draft,
                        drafts[:s],
                        [self.ids(r) for _ in range(s)],
                        ctx,
                        [ctx] * r,
                        mask,
                    )
                )
        return cells

    def _call(self, cell: _Cell | _BatchCell) -> float:
        """Seconds of one call of ``cell`` (its caches cropped back to its start first, outside the clock)."""
        if isinstance(cell, _BatchCell):
            for cache in cell.caches:
                keep_entries(cache, cell.start, [])
            items = [Rows(ids, cell.positions, cache, cell.mask) for ids, cache in zip(cell.ids, cell.caches)]
            t0 = self.clock()
            forward_rows(cell.model, items, self.pair.device)
            return self.clock() - t0
        keep_entries(cell.cache, cell.start, [])
        t0 = self.clock()
        self.engine._forward(
            cell.model,
            cell.ids,
            cell.start,
            cell.cache,
            keep=cell.keep,
            mask=cell.mask,
            positions=cell.positions,
        )
        return self.clock() - t0

    def run(self, cells: list[_Cell | _BatchCell]) -> None:
        """Warm-up rounds (untimed), then ``reps`` timed rounds. Every call of a cell leaves its caches at
        least as long as the cell's start, so cropping to ``start`` before a call restores their state."""
        for rnd in range(self.config.warmup + self.config.reps):
            for i in self.rng.permutation(len(cells)):
                cell = cells[i]
                elapsed = self._call(cell)
                if rnd >= self.config.warmup:
                    cell.samples.append(elapsed)
                self.bar.update(1)

    def overhead_configs(self) -> list[tuple[int, int, int]]:
        """(depth, verify, width): V and depth varied apart so their shares can be told apart."""
        wide = max(self.config.widths)
        configs = [(1, 0, 1), (1, 1, 1), (4, 1, 1), (4, 4, 1), (2, 4, wide), (3, 16, wide)]
        return list(dict.fromkeys(configs))

    def overhead(self) -> dict:
        """Per-cycle overhead from real cycles: total - forwards - controller, fitted as
        base + per_node * V + per_draft_row * (depth - 1) * W. Requests are round-robin over the
        configurations, like the forward cells."""
        configs, need = self.overhead_configs(), self.config.overhead_cycles
        samples: dict[tuple, list[float]] = {c: [] for c in configs}
        ar: list[float] = []  # autoregressive steps (no controller): total - forward
        rows, ctrl_calls = [], []
        prompt = self.ids(self.config.overhead_prompt_len)
        self.engine.generate(
            prompt, max_new_tokens=3, controller=StaticController(2, 2, tree_width=1)
        )  # warm-up
        for attempt in range(4):  # EOS can end a request early: top up with other prompts
            ids = prompt if attempt == 0 else self.ids(len(prompt))
            if len(ar) < need:
                res = self.engine.generate(ids, max_new_tokens=need + 2, controller=None)
                ar += [r.total_s - r.forward_s for r in res.cycles[1:]]
                self.bar.update(1)
            for depth, verify, width in configs:
                if len(samples[(depth, verify, width)]) >= need:
                    continue
                res = self.engine.generate(
                    ids,
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
                self.bar.update(1)
        per_config = []
        for (depth, verify, width), got in samples.items():
            med, spread = _stats(got) if got else (float("nan"), 0.0)
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
        coef, spread = _fit_overhead(np.asarray(rows, dtype=np.float64).reshape(-1, 3))
        return {
            "coef": coef,
            "spread": spread,
            "ar": _stats(ar)[0] if ar else 0.0,
            "policy_call_s": float(np.median(ctrl_calls)) if ctrl_calls else 0.0,
            "configs": per_config,
        }


def _fit_overhead(rows: np.ndarray) -> tuple[np.ndarray, float]:
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
    return coef, (_stats(ratio.tolist())[1] if ratio.size else 0.0)


@torch.inference_mode()
def measure_step_overhead(
    pair: ModelPair, profile: CostProfile, context: int = 512, steps: int = 24, reps: int = 3
) -> float:
    """Seconds a batched engine's decoding step costs beyond what ``profile`` charges for it: the median, over
    ``reps`` runs of ``steps`` ``BatchedEngine.step`` calls of one autoregressive request at ``context``
    tokens, of the step's time outside its target forward (``CycleRecord.forward_s``, timed in the same step,
    so a busy machine slows both sides alike), less the profile's per-cycle overhead of an autoregressive step
    (which the replay charges already); 0 when the step costs no more. The server replay adds it to every
    step (``envs.server.ServerReplay.step_overhead_s``): the step's own Python (scheduling, load, events)."""
    from engine.batch import BatchConfig, BatchedEngine, BatchRequest

    context = max(8, min(int(context), pair.max_context - steps - 2))
    gen = torch.Generator().manual_seed(0)
    prompt = [int(t) for t in torch.randint(0, pair.vocab_size, (context,), generator=gen)]
    outside: list[float] = []
    clock = SpeculativeEngine(pair).clock
    for _ in range(reps):
        batch = BatchedEngine(pair, BatchConfig(max_requests=1, max_prefill_tokens=context))
        batch.add(BatchRequest(prompt, max_new_tokens=steps + 2, ignore_eos=True))
        while batch.pending:
            batch.step()
        batch.step()  # a first decoding step (warm)
        for _ in range(steps):
            t0 = clock()
            (event,) = batch.step()
            outside.append(clock() - t0 - event.record.forward_s)
    return max(float(np.median(outside)) - profile.ar_overhead_s, 0.0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_profile(
    pair: ModelPair, config: ProfileConfig | None = None, random_weights: bool = False, progress: bool = True
) -> CostProfile:
    """Measure the cost profile of ``pair`` on its device and dtype."""
    import transformers

    config = config or ProfileConfig()
    config.check_fits(pair.max_context, pair.vocab_size, where=f"pair {pair.name}")
    meta = {
        "pair": pair.name,
        "dtype": pair.precision,
        "device": str(pair.device),
        "device_name": device_name(pair.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "num_threads": torch.get_num_threads(),
        "random_weights": bool(random_weights),
        # integer formats of random weights follow the published files' block types (engine.backends.random_pair)
        "random_weights_layout": "published" if random_weights else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "loadavg_start": list(os.getloadavg()),
        "config": asdict(config),
    }
    ctxs, grids = (
        config.contexts,
        {"step": config.widths, "chunk": config.chunks, "verify": config.sizes, "verify_chain": config.sizes},
    )
    num_cells = len(ctxs) * sum(len(g) for g in grids.values())
    if config.batch_axis:
        num_cells += 2 * len(config.batch_sequences) * len(config.batch_rows)
    total = 2 * len(ctxs) * config.prefill_reps + num_cells * (config.warmup + config.reps) + 7
    with torch.inference_mode(), tqdm(total=total, desc="profile", disable=not progress) as bar:
        prof = _Profiler(pair, config, bar)
        prefill_target, prefill_draft, caches = prof.prefills()
        cells = prof.cells(caches)
        batch_cells = prof.batch_cells(caches) if config.batch_axis else []
        prof.run(cells + batch_cells)
        over = prof.overhead()
        bar.update(max(total - bar.n, 0))  # the overhead phase may need fewer or more requests than budgeted

    tables = {
        key: np.zeros((len(grid), len(ctxs), 2)) for key, grid in grids.items()
    }  # [grid, ctx, (median, spread)]
    for cell in cells:
        tables[cell.key][cell.row, cell.col] = _stats(cell.samples)
    batched: dict[str, Any] = {}
    if batch_cells:
        batched = {
            "context": config.batch_ctx,
            "target": [],
            "draft": [],
            "target_spread": [],
            "draft_spread": [],
        }
        for cell in batch_cells:  # sequences-major, rows ascending
            median, spread = _stats(cell.samples)
            batched[cell.key].append([cell.sequences, cell.sequences * cell.rows, median])
            batched[cell.key + "_spread"].append(spread)
    target_stats = [_stats(t) for t in prefill_target]
    draft_stats = [_stats(t) for t in prefill_draft]
    meta["loadavg_end"] = list(os.getloadavg())
    return CostProfile(
        contexts=list(ctxs),
        widths=list(config.widths),
        draft_step_table=tables["step"][..., 0].tolist(),
        sizes=list(config.sizes),
        verify_table=tables["verify"][..., 0].tolist(),
        verify_chain_table=tables["verify_chain"][..., 0].tolist(),
        verify_chain_spread=tables["verify_chain"][..., 1].tolist(),
        chunks=list(config.chunks),
        draft_chunk_table=tables["chunk"][..., 0].tolist(),
        prefill_lengths=list(ctxs),
        prefill_target_s=[m for m, _ in target_stats],
        prefill_draft_s=[m for m, _ in draft_stats],
        overhead_base_s=float(over["coef"][0]),
        overhead_per_node_s=float(over["coef"][1]),
        overhead_per_draft_row_s=float(over["coef"][2]),
        ar_overhead_s=float(over["ar"]),
        policy_call_s=over["policy_call_s"],
        draft_step_spread=tables["step"][..., 1].tolist(),
        verify_spread=tables["verify"][..., 1].tolist(),
        draft_chunk_spread=tables["chunk"][..., 1].tolist(),
        overhead_spread=float(over["spread"]),
        batched=batched,
        meta=meta,
        details={
            "prefill_target_spread": [s for _, s in target_stats],
            "prefill_draft_spread": [s for _, s in draft_stats],
            "overhead_configs": over["configs"],
        },
    )


# ------------------------------------------------------------------------------------------------ CLI
@dataclass
class MeasureCostsConfig(ModelConfig):
    """What ``python -m engine.costs.measure_costs`` measures (the pair: ``ModelConfig``; the grids and repetitions:
    ``ProfileConfig``) and where it writes the profile."""

    out: str = field(kw_only=True)
    """Where to write the JSON profile."""
    random_weights: bool = False
    """The pair's architecture with random weights, no download (timing only)."""


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m engine.costs.measure_costs", description=__doc__)
    add_dataclass_args(ap, MeasureCostsConfig)
    add_dataclass_args(ap, ProfileConfig, "grids and repetitions")
    ap.add_argument("--quick", action="store_true", help="small grids, 2 reps (explicit flags win)")
    return ap


def measure_profile_cli(config: MeasureCostsConfig, grid: ProfileConfig) -> CostProfile:
    pair = config.load(random_weights=config.random_weights)
    return measure_profile(pair, grid, random_weights=config.random_weights)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (0, or 2 after one ``error: ...`` line). Every argument and
    the output path are checked before any model loads."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.quick:
            apply_preset(parser, args, argv, asdict(ProfileConfig.quick()))
        config = from_args(MeasureCostsConfig, args)
        grid = from_args(ProfileConfig, args)  # ranges of every grid and count
        limits = config.check()
        if limits is not None:  # a TARGET::DRAFT pair is checked once loaded (measure_profile)
            grid.check_fits(limits.max_context, limits.vocab_size, where=f"--pair {config.pair}")
        out = check_output_file(config.out)
        profile = measure_profile_cli(config, grid)
        profile.save(out)
    except CLI_ERRORS as err:
        return report_error(err)
    print(profile.format_table())
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
