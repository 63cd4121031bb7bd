"""The batch axis of a cost profile measurement (``ProfileConfig.batch_axis``): batched forwards through
``engine.batch_forward.forward_rows`` (what ``engine.batch.BatchedEngine`` runs: one forward carrying several
sequences, each on its own cache) by sequences and rows per sequence at one context, timed in the same
rounds as the other cells of ``engine.costs.measure_costs`` and stored as ``CostProfile.batched``; and
``measure_step_overhead``, what a batched engine's step costs beyond its forwards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.backends.kvcache import keep_entries, new_cache
from engine.backends.pair import ModelPair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest
from engine.batch_forward import Rows, forward_rows
from engine.costs.cost_profile import CostProfile, median_spread
from engine.costs.profile_config import ProfileConfig
from engine.engine import SpeculativeEngine
from engine.tree import tree_attention_mask


@dataclass
class BatchCell:
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

    def call(self, clock: Callable[[], float], device: torch.device) -> float:
        """Seconds of one call (its caches cropped back to its start first, outside the clock)."""
        for cache in self.caches:
            keep_entries(cache, self.start, [])
        items = [Rows(ids, self.positions, cache, self.mask) for ids, cache in zip(self.ids, self.caches)]
        t0 = clock()
        forward_rows(self.model, items, device)
        return clock() - t0


def copy_cache(model: torch.nn.Module, cache: Any) -> Any:
    """A new cache of ``model`` holding the same entries as ``cache`` (its own buffers)."""
    copy = new_cache(model)
    for mine, theirs in zip(copy.layers, cache.layers):
        mine.update(theirs.keys.clone(), theirs.values.clone())
    return copy


def batch_cells(
    pair: ModelPair, config: ProfileConfig, caches: list[tuple], ids: Callable[[int], list[int]]
) -> list[BatchCell]:
    """Batched forwards at the batch context, each sequence on its own copy of that context's caches
    (``caches``: the (target, draft) caches per context, made before any cell runs: they hold exactly the
    context; ``ids(n)``: n random token ids). Target: every sequence verifies its root and a chain of
    rows - 1 nodes (causal, as the engine runs chains); draft: every sequence runs a frontier of ``rows``
    nodes at one depth (the "step" cells' mask for rows > 1)."""
    ctx = config.batch_ctx
    target_cache, draft_cache = caches[config.contexts.index(ctx)]
    most = config.batch_sequences[-1]
    targets = [copy_cache(pair.target, target_cache) for _ in range(most)]
    drafts = [copy_cache(pair.draft, draft_cache) for _ in range(most)]
    cells = []
    for s in config.batch_sequences:
        for r in config.batch_rows:
            chain = list(range(ctx - 1, ctx - 1 + r))
            cells.append(
                BatchCell(
                    "target", s, r, pair.target, targets[:s], [ids(r) for _ in range(s)], ctx - 1, chain
                )
            )
            mask = tree_attention_mask(ctx, np.eye(r, dtype=bool), pair.dtype, pair.device) if r > 1 else None
            cells.append(
                BatchCell(
                    "draft", s, r, pair.draft, drafts[:s], [ids(r) for _ in range(s)], ctx, [ctx] * r, mask
                )
            )
    return cells


def batched_table(cells: list[BatchCell], context: int) -> dict[str, Any]:
    """``CostProfile.batched`` from the timed cells: per model, [sequences, rows in all, median seconds] in
    the cells' order (sequences-major, rows ascending) and the IQR/median of each."""
    batched: dict[str, Any] = {
        "context": context,
        "target": [],
        "draft": [],
        "target_spread": [],
        "draft_spread": [],
    }
    for cell in cells:
        median, spread = median_spread(cell.samples)
        batched[cell.key].append([cell.sequences, cell.sequences * cell.rows, median])
        batched[cell.key + "_spread"].append(spread)
    return batched


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
