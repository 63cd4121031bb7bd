"""Record traces (``envs.trace``): a target-law trajectory per prompt and sample, and at every position the
draft tree the engine would build there up to (max_depth, tree_width).

    python -m envs.record_traces --pair tiny --prompts prompts.jsonl --out traces/tiny
    python -m envs.record_traces --prompts prompts.jsonl --out traces/qwen --max-depth 8 --tree-width 4

Recording into an --out that already holds traces resumes it: traces with the same settings are kept, and
traces recorded with other settings are refused (one ``error:`` line, before any model loads where the
settings tell) unless ``--overwrite`` says to record them again.

The trajectory comes from ``SpeculativeEngine.generate`` itself (its output law is the target's; greedy
gives the greedy text). The trees are batched: a node at depth d of position t only depends on the
committed prefix ``prompt + tokens[:t+1]`` and its own ancestors, so the frontiers of many positions go
through ONE draft forward per depth over a shared prefix cache, with an additive mask that gives each
node its own prefix and ancestors, and nodes that several positions share are forwarded once. Children
are chosen by the engine's own ``score_logprobs`` and ``expand_topk``, called per position with the same
row shapes, so the nodes, their order and scores are the engine's (docs/design.md section 3; up to float
rounding: batched forwards round differently, which can swap near-ties in float32).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.backends.files import DirectoryLock
from engine.backends.models import pair_name
from engine.backends.pair import ModelPair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest
from engine.cli import CLI_ERRORS, ArgumentParser, ModelConfig, check_output_dir, report_error
from engine.config_flags import add_dataclass_args, from_args
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.errors import InputError
from engine.results import GenerationResult
from engine.sampling import SamplingConfig
from envs.draft_trees import draft_trees
from envs.recording import (
    DEFAULT_CHUNK,
    SETTING_KEYS,
    check_prompts,
    check_record_settings,
    mismatched_traces,
    read_prompts,
    refuse_mismatched,
    trace_matches,
    trace_path,
)
from envs.trace import Trace

TRAJECTORY_CONTROLLER = {"depth": 4, "verify": 4, "tree_width": 1}
"""Controller that generates a trajectory recorded alone (``record_trace``). It changes only the speed of
recording: the engine draws one target sample per emitted token, so for a given seed the trajectory is the same
for every controller (tests/envs/test_record_traces.py checks this, greedy and sampled)."""
TRAJECTORY_BATCH = 8
"""``record_prompts`` decodes the trajectories of this many traces at once, autoregressively, in the batched
engine (``engine.batch``: a request's tokens are those of the same request decoded alone, greedy or sampled
with its seed; tests/engine/test_batch.py), then records each one's trees: 8 rows a target step cost a CPU
about twice one row, so the trajectories take a fraction of their time alone."""


@dataclass
class RecordSummary:
    """What ``record_prompts`` did (timings cover recorded traces only, skipped ones cost nothing)."""

    paths: list[Path]
    """Every trace file of the request, recorded or kept."""
    recorded: int = 0
    skipped: int = 0
    positions: int = 0
    """Positions (trees) recorded."""
    trajectory_s: float = 0.0
    trees_s: float = 0.0
    wall_s: float = 0.0

    @property
    def positions_per_min(self) -> float:
        return 60.0 * self.positions / self.wall_s if self.wall_s > 0 else float("nan")


# ----------------------------------------------------------------------------------------------- traces
def trace_meta(
    pair: ModelPair,
    prompt_ids: Sequence[int],
    sampling: SamplingConfig,
    max_depth: int,
    tree_width: int,
    max_new_tokens: int,
    seed: int,
) -> dict:
    """The meta entries that identify a trace (``MATCH_KEYS``) plus the engine settings behind it."""
    return {
        "pair": pair.name,
        "dtype": pair.precision,
        "sampling": dataclasses.asdict(sampling),
        "tree_width": tree_width,
        "max_depth": max_depth,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "prompt_ids": [int(t) for t in prompt_ids],
        "draft_mode": "deterministic",
        "eos_token_ids": sorted(pair.eos_token_ids),
        "max_context": pair.max_context,
        "trajectory_controller": TRAJECTORY_CONTROLLER,
    }


def record_trace(
    pair: ModelPair,
    prompt_ids: Sequence[int],
    prompt_id: str,
    sampling: SamplingConfig,
    max_depth: int = 8,
    tree_width: int = 4,
    max_new_tokens: int = 128,
    seed: int = 0,
    *,
    sample: int = 0,
    chunk: int = DEFAULT_CHUNK,
    extra_meta: dict | None = None,
    progress: Callable[[int], None] | None = None,
    trajectory: tuple[GenerationResult, float] | None = None,
) -> Trace:
    """Generate one trajectory (engine, ``seed``) and record the tree at each of its positions.
    ``trajectory``: (the request's result, seconds) when it was already decoded (``batched_trajectories``)."""
    check_record_settings(
        max_depth=max_depth, tree_width=tree_width, max_new_tokens=max_new_tokens, seed=seed, chunk=chunk
    )
    t0 = time.perf_counter()
    if trajectory is None:
        result = SpeculativeEngine(pair, sampling).generate(
            list(prompt_ids), max_new_tokens, controller=StaticController(**TRAJECTORY_CONTROLLER), seed=seed
        )
        t1 = time.perf_counter()
    else:
        result, seconds = trajectory
        t0 = (t1 := time.perf_counter()) - seconds
    trees = draft_trees(pair, prompt_ids, result.tokens, sampling, max_depth, tree_width, chunk, progress)
    t2 = time.perf_counter()
    meta = trace_meta(pair, prompt_ids, sampling, max_depth, tree_width, max_new_tokens, seed)
    if trajectory is not None:  # decoded among others (``batched_trajectories``): the same tokens
        meta["trajectory_controller"] = {"depth": 0, "batched": TRAJECTORY_BATCH}
    meta.update(
        extra_meta or {},
        sample=sample,
        finish_reason=result.finish_reason,
        timing={"trajectory_s": t1 - t0, "trees_s": t2 - t1},
    )
    trace = Trace(
        prompt_id=str(prompt_id),
        prompt_len=len(prompt_ids),
        tokens=np.asarray(result.tokens, dtype=np.int32),
        node_offsets=np.cumsum([0] + [len(tree) for tree in trees], dtype=np.int64),
        node_tokens=np.asarray([t for tree in trees for t in tree.tokens], dtype=np.int32),
        node_parents=np.asarray([p for tree in trees for p in tree.parents], dtype=np.int16),
        node_depths=np.asarray([d for tree in trees for d in tree.depths], dtype=np.int8),
        node_scores=np.asarray([s for tree in trees for s in tree.scores], dtype=np.float32),
        meta=meta,
    )
    trace.validate(f"trace {prompt_id}")
    return trace


def batched_trajectories(
    pair: ModelPair,
    requests: Sequence[tuple[Sequence[int], int]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    batch: int = TRAJECTORY_BATCH,
) -> list[tuple[GenerationResult, float]]:
    """The trajectories of ``requests`` ((prompt ids, seed) each) decoded ``batch`` at a time in the batched
    engine, autoregressively, prompts prefilled whole: (result, its share of the decoding seconds) each, in
    order. Each result's tokens are ``SpeculativeEngine.generate``'s for that prompt and seed."""
    out: list[tuple[GenerationResult, float]] = []
    for start in range(0, len(requests), batch):
        group = requests[start : start + batch]
        longest = max(len(ids) for ids, _ in group)
        engine = BatchedEngine(
            pair,
            BatchConfig(
                max_requests=len(group),
                max_rows=max(64, len(group)),
                max_prefill_tokens=max(longest, 16),
                idle_prefill_tokens=max(longest, 16),
            ),
        )
        t0 = time.perf_counter()
        rids = [
            engine.add(BatchRequest(list(ids), max_new_tokens, None, seed=seed, sampling=sampling))
            for ids, seed in group
        ]
        while engine.active or engine.pending:
            engine.step()
        share = (time.perf_counter() - t0) / len(group)
        out += [(engine.result(rid), share) for rid in rids]
    return out


def record_prompts(
    pair: ModelPair,
    prompts: str | Path | Iterable[dict],
    out_dir: str | Path,
    sampling: SamplingConfig,
    *,
    max_depth: int = 8,
    tree_width: int = 4,
    max_new_tokens: int = 128,
    seed: int = 0,
    samples_per_prompt: int = 1,
    chat: bool = True,
    chunk: int = DEFAULT_CHUNK,
    progress: bool = True,
    replace_mismatched: bool = True,
) -> RecordSummary:
    """Record ``DIR/<id>__s<s>.npz`` for every prompt and sample s (seed ``seed + s``); traces already there
    with the same ``MATCH_KEYS`` are kept; unreadable ones are recorded again, and so are traces recorded with
    other settings when ``replace_mismatched`` (a cache's behaviour), else they are refused with a
    ``RecordError`` before anything is recorded (the command line without --overwrite). Without
    ``replace_mismatched`` the directory is also locked for the whole recording (a second recorder into it
    fails at once with ``DirectoryBusyError``); a cache directory is not locked: its writers record the
    same settings, every trace file is written atomically, so concurrent runs sharing a cache never mix."""
    check_record_settings(
        max_depth=max_depth,
        tree_width=tree_width,
        max_new_tokens=max_new_tokens,
        seed=seed,
        samples_per_prompt=samples_per_prompt,
        chunk=chunk,
    )
    items = (
        read_prompts(prompts) if isinstance(prompts, (str, Path)) else check_prompts(list(prompts), "prompts")
    )
    out = Path(out_dir)
    with DirectoryLock(out, "--out") if not replace_mismatched else contextlib.nullcontext():
        return _record_into(
            pair,
            items,
            out,
            sampling,
            max_depth,
            tree_width,
            max_new_tokens,
            seed,
            samples_per_prompt,
            chat,
            chunk,
            progress,
            replace_mismatched,
        )


def _record_into(
    pair: ModelPair,
    items: list[dict],
    out: Path,
    sampling: SamplingConfig,
    max_depth: int,
    tree_width: int,
    max_new_tokens: int,
    seed: int,
    samples_per_prompt: int,
    chat: bool,
    chunk: int,
    progress: bool,
    replace_mismatched: bool,
) -> RecordSummary:
    out.mkdir(parents=True, exist_ok=True)
    plan = []  # per prompt: (item, [(prompt ids, sample, path, wanted meta) per sample])
    for item in items:
        ids = pair.encode(item["prompt"], chat=chat)
        plan.append(
            (
                item,
                [
                    (
                        ids,
                        s,
                        trace_path(out, item["id"], s),
                        trace_meta(pair, ids, sampling, max_depth, tree_width, max_new_tokens, seed + s),
                    )
                    for s in range(samples_per_prompt)
                ],
            )
        )
    if not replace_mismatched:
        refuse_mismatched(
            mismatched_traces(out, [(path, want) for _, samples in plan for *_, path, want in samples]), out
        )
    summary = RecordSummary(paths=[])
    start = time.perf_counter()
    # which traces to record is decided once (each cached file read once)
    missing = {path for _, samples in plan for *_, path, want in samples if not trace_matches(path, want)}
    todo = [(ids, seed + s) for _, samples in plan for ids, s, path, _ in samples if path in missing]
    decoded = iter(batched_trajectories(pair, todo, sampling, max_new_tokens)) if len(todo) > 1 else None
    with tqdm(desc="recording", unit="pos", disable=not progress, dynamic_ncols=True) as bar:
        for index, (item, samples) in enumerate(plan):
            extra = {k: item[k] for k in ("language", "task") if k in item}
            for ids, s, path, _ in samples:
                summary.paths.append(path)
                if path not in missing:
                    summary.skipped += 1
                    continue
                bar.set_postfix_str(f"prompt {index + 1}/{len(items)} {item['id']} s{s}")
                trace = record_trace(
                    pair,
                    ids,
                    str(item["id"]),
                    sampling,
                    max_depth,
                    tree_width,
                    max_new_tokens,
                    seed + s,
                    sample=s,
                    chunk=chunk,
                    extra_meta=extra,
                    progress=bar.update,
                    trajectory=next(decoded) if decoded is not None else None,
                )
                trace.save(path)
                summary.recorded += 1
                summary.positions += trace.num_positions
                summary.trajectory_s += trace.meta["timing"]["trajectory_s"]
                summary.trees_s += trace.meta["timing"]["trees_s"]
    summary.wall_s = time.perf_counter() - start
    return summary


# ---------------------------------------------------------------------------------------------- command line
@dataclass
class RecordConfig(ModelConfig):
    """What ``python -m envs.record_traces`` records (the pair: ``ModelConfig``) and where."""

    prompts: str = field(kw_only=True)
    """JSONL, one {"id", "prompt", "language"?, "task"?} per line."""
    out: str = field(kw_only=True)
    """Directory for <id>__s<sample>.npz (resumes if it holds some)."""
    temperature: float = 0.0
    """0: greedy trajectories; > 0: sampled at this temperature."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: no limit)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p (1: no limit)."""
    samples_per_prompt: int = 1
    """Trajectories per prompt (seeds seed + s)."""
    max_depth: int = 8
    """Depth of the recorded trees."""
    tree_width: int = 4
    """Children per node and frontier width."""
    max_new_tokens: int = 128
    """Tokens generated per trajectory."""
    seed: int = 0
    """Seed of the first trajectory of every prompt."""
    raw: bool = False
    """Encode the prompts as they are (default: each prompt is one user turn in the chat template)."""
    chunk: int = DEFAULT_CHUNK
    """Positions per batched draft forward."""
    progress: bool = True
    """Progress bar."""
    overwrite: bool = False
    """Record again the traces in --out that were recorded with other settings (default: refuse)."""


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m envs.record_traces", description=__doc__)
    add_dataclass_args(ap, RecordConfig)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # every argument, the prompts and --out are checked before the models load
        config = from_args(RecordConfig, args)
        sampling = SamplingConfig(config.temperature, config.top_k, config.top_p)
        check_record_settings(
            max_depth=config.max_depth,
            tree_width=config.tree_width,
            max_new_tokens=config.max_new_tokens,
            seed=config.seed,
            samples_per_prompt=config.samples_per_prompt,
            chunk=config.chunk,
        )
        limits = config.check()
        if limits is not None and config.tree_width > limits.vocab_size:
            raise InputError(
                f"--tree-width {config.tree_width} exceeds the vocabulary ({limits.vocab_size} tokens)"
            )
        prompts = read_prompts(config.prompts)
        out = check_output_dir(config.out)
        if not config.overwrite:  # the settings known without the models; dtype and prompt ids after loading
            known = {
                "pair": pair_name(config.pair),
                "sampling": dataclasses.asdict(sampling),
                "tree_width": config.tree_width,
                "max_depth": config.max_depth,
                "max_new_tokens": config.max_new_tokens,
            }
            wants = [
                (trace_path(out, item["id"], s), {**known, "seed": config.seed + s})
                for item in prompts
                for s in range(config.samples_per_prompt)
            ]
            refuse_mismatched(mismatched_traces(out, wants, SETTING_KEYS), out)
        pair = config.load()
        summary = record_prompts(
            pair,
            prompts,
            out,
            sampling,
            max_depth=config.max_depth,
            tree_width=config.tree_width,
            max_new_tokens=config.max_new_tokens,
            seed=config.seed,
            samples_per_prompt=config.samples_per_prompt,
            chat=not config.raw,
            chunk=config.chunk,
            progress=config.progress,
            replace_mismatched=config.overwrite,
        )
    except CLI_ERRORS as err:
        return report_error(err)
    print(
        f"pair={pair.name} weights={pair.precision} device={pair.device} "
        f"threads={torch.get_num_threads()} sampling={sampling} max_depth={config.max_depth} "
        f"tree_width={config.tree_width} out={config.out}"
    )
    print(
        f"traces recorded={summary.recorded} kept={summary.skipped} positions={summary.positions} "
        f"wall={summary.wall_s:.1f}s (trajectory {summary.trajectory_s:.1f}s, trees {summary.trees_s:.1f}s) "
        f"positions/min={summary.positions_per_min:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
