"""Measuring a ``CostProfile`` (``engine.costs.cost_profile``): the engine's own forwards, timed on the device, and the
command line that writes the profile file.

    python -m engine.costs.measure_costs --pair tiny --quick --out runs/profile_tiny.json

Every timed call is exactly the forward the engine issues in a cycle (same ``forward``, masks, positions
and ``logits_to_keep``) on a KV cache holding the given context, cropped back (outside the clock) before
each call. Token ids are random: time does not depend on them. Warm-up rounds are excluded; clocks
synchronise the device; cells are timed round-robin in random order (see ``_Profiler``).

With ``--batch-axis`` (``ProfileConfig.batch_axis``) the profile also gets the batch axis: batched forwards
through ``engine.batch_forward.forward_rows`` (what ``engine.batch.BatchedEngine`` runs: one forward carrying
several sequences, each on its own cache) by sequences and rows per sequence at one context, timed in the
same rounds (``CostProfile.batched``; ``engine.costs.measure_batch``). Off by default: the replay environments
and training do not use it. What to measure is a ``ProfileConfig`` (``engine.costs.profile_config``).
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

from engine.backends.kvcache import keep_entries, new_cache
from engine.backends.pair import ModelPair
from engine.cli import CLI_ERRORS, ArgumentParser, ModelConfig, check_output_file, report_error
from engine.config_flags import add_dataclass_args, apply_preset, from_args
from engine.costs.cost_profile import CostProfile, median_spread
from engine.costs.measure_batch import BatchCell, batch_cells, batched_table
from engine.costs.measure_overhead import measure_overhead
from engine.costs.profile_config import ProfileConfig
from engine.engine import SpeculativeEngine
from engine.tree import ancestor_matrix, tree_attention_mask


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
                    self.engine.forward(model, prompts[j], 0, cache, keep=1)
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

    def _call(self, cell: _Cell | BatchCell) -> float:
        """Seconds of one call of ``cell`` (its caches cropped back to its start first, outside the clock)."""
        if isinstance(cell, BatchCell):
            return cell.call(self.clock, self.pair.device)
        keep_entries(cell.cache, cell.start, [])
        t0 = self.clock()
        self.engine.forward(
            cell.model,
            cell.ids,
            cell.start,
            cell.cache,
            keep=cell.keep,
            mask=cell.mask,
            positions=cell.positions,
        )
        return self.clock() - t0

    def run(self, cells: list[_Cell | BatchCell]) -> None:
        """Warm-up rounds (untimed), then ``reps`` timed rounds. Every call of a cell leaves its caches at
        least as long as the cell's start, so cropping to ``start`` before a call restores their state."""
        for rnd in range(self.config.warmup + self.config.reps):
            for i in self.rng.permutation(len(cells)):
                cell = cells[i]
                elapsed = self._call(cell)
                if rnd >= self.config.warmup:
                    cell.samples.append(elapsed)
                self.bar.update(1)


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
        timed_batches = batch_cells(pair, config, caches, prof.ids) if config.batch_axis else []
        prof.run(cells + timed_batches)
        over = measure_overhead(prof.engine, config, prof.ids, bar)
        bar.update(max(total - bar.n, 0))  # the overhead phase may need fewer or more requests than budgeted

    tables = {
        key: np.zeros((len(grid), len(ctxs), 2)) for key, grid in grids.items()
    }  # [grid, ctx, (median, spread)]
    for cell in cells:
        tables[cell.key][cell.row, cell.col] = median_spread(cell.samples)
    batched = batched_table(timed_batches, config.batch_ctx) if timed_batches else {}
    target_stats = [median_spread(t) for t in prefill_target]
    draft_stats = [median_spread(t) for t in prefill_draft]
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
