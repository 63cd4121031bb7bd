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
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.backends.files import DirectoryLock
from engine.backends.kvcache import keep_entries, new_cache
from engine.backends.models import pair_name
from engine.backends.pair import ModelPair
from engine.cli import (
    CLI_ERRORS,
    ArgumentParser,
    ModelConfig,
    add_dataclass_args,
    check_output_dir,
    from_args,
    report_error,
)
from engine.control import StaticController
from engine.engine import MAX_SEED, SpeculativeEngine, forward_logits
from engine.errors import DraftpilotError, InputError, is_int
from engine.sampling import SamplingConfig, check_finite, score_logprobs
from engine.tree import DraftTree, expand_topk
from envs.trace import Trace, TraceError

DEFAULT_CHUNK = 64
"""Positions whose frontiers share each draft forward (at most chunk * tree_width queries). Larger chunks
batch better and share more nodes; memory grows with them (kept logits rows: about 12 per position on
real text at depth 8, width 4). 64 beat 16 and 32 on the 2-core CPU by 1.3-1.9x."""
TRAJECTORY_CONTROLLER = {"depth": 4, "verify": 4, "tree_width": 1}
"""Controller that generates the trajectory. It changes only the speed of recording: the engine draws one
target sample per emitted token, so for a given seed the trajectory is the same for every controller
(tests/envs/test_record_traces.py checks this, greedy and sampled)."""
MATCH_KEYS = ("pair", "dtype", "sampling", "tree_width", "max_depth", "max_new_tokens", "seed", "prompt_ids")
"""An existing trace is kept on resume only if these meta entries equal the requested ones."""
SETTING_KEYS = ("pair", "sampling", "tree_width", "max_depth", "max_new_tokens", "seed")
"""The ``MATCH_KEYS`` the command line knows before any model loads (dtype and prompt ids need the pair)."""
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_TRACE_DEPTH = 127
"""Depths are stored as int8 and parents as int16: max_depth <= 127, tree_width^2 * max_depth <= 32767."""


class RecordError(DraftpilotError, ValueError):
    """A prompt file or recording request that cannot be recorded as asked (bad prompts, settings that do not
    fit the trace format, an --out holding traces recorded with other settings)."""


def check_record_settings(
    *,
    max_depth: int,
    tree_width: int,
    max_new_tokens: int = 1,
    seed: int = 0,
    samples_per_prompt: int = 1,
    chunk: int = DEFAULT_CHUNK,
) -> None:
    """Every recording setting in range (``InputError`` naming it, with its command-line flag)."""
    for name, value, low in (
        ("max_depth", max_depth, 1),
        ("tree_width", tree_width, 1),
        ("max_new_tokens", max_new_tokens, 1),
        ("seed", seed, 0),
        ("samples_per_prompt", samples_per_prompt, 1),
        ("chunk", chunk, 1),
    ):
        if not is_int(value) or value < low:
            raise InputError(
                f"{name} (--{name.replace('_', '-')}) must be an integer >= {low}, got {value!r}"
            )
    if seed + samples_per_prompt - 1 > MAX_SEED:
        raise InputError(f"seed (--seed) + samples_per_prompt - 1 must stay below 2**64, got seed {seed}")
    if max_depth > MAX_TRACE_DEPTH or tree_width * tree_width * max_depth > 32767:
        raise InputError(
            f"--max-depth {max_depth}, --tree-width {tree_width} do not fit the trace format (max_depth "
            f"<= {MAX_TRACE_DEPTH} and tree_width^2 * max_depth <= 32767)"
        )


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


# ------------------------------------------------------------------------------------------------ trees
@torch.inference_mode()
def draft_trees(
    pair: ModelPair,
    prompt_ids: Sequence[int],
    tokens: Sequence[int],
    sampling: SamplingConfig,
    max_depth: int,
    tree_width: int,
    chunk: int = DEFAULT_CHUNK,
    progress: Callable[[int], None] | None = None,
) -> list[DraftTree]:
    """The draft tree at every position t of ``tokens`` (root ``tokens[t]``, committed prefix
    ``prompt_ids + tokens[:t+1]``), drafted to ``max_depth`` with width ``tree_width``.

    Chunks of positions [c0, c1) go in order; the cache holds the prefix ``seq[:n0 + c1]`` the chunk's
    last position needs (the others mask the rest), then the chunk's nodes, cropped off afterwards.
    Within a chunk a node is identified by its *canonical* form: a node of position t whose path starts
    with the trajectory's own next tokens is the node of a later position (same context, same position
    id), so it is forwarded once and shared (on two real prompts at depth 8, width 4, only 36% and 47% of
    the forwards remain). ``progress(n)`` is called after each chunk of n positions.
    """
    check_record_settings(max_depth=max_depth, tree_width=tree_width, chunk=chunk)
    model, device = pair.draft, pair.device
    seq = [int(t) for t in prompt_ids] + [int(t) for t in tokens]
    n0, trees = len(prompt_ids), []
    cache = new_cache(model)
    forward_logits(model, seq[:n0], range(n0), cache, device, keep=1)  # the prompt; tokens[0] comes next
    for c0 in range(0, len(tokens), chunk):
        c1 = min(c0 + chunk, len(tokens))
        # roots: row i predicts the children of tokens[c0 + i]; the forward extends the cache to the prefix
        logits = forward_logits(
            model, seq[n0 + c0 : n0 + c1], range(n0 + c0, n0 + c1), cache, device
        )  # [C, V]
        check_finite(logits, "draft")
        rows = {(t, ()): logits[t - c0] for t in range(c0, c1)}  # canonical node -> its logits row
        slots: dict[tuple, int] = {}  # canonical node -> its cache entry after the prefix
        chunk_trees = [DraftTree() for _ in range(c0, c1)]
        frontiers = [[-1] for _ in chunk_trees]  # -1: the root
        for _ in range(max_depth):
            keys = [
                [_canonical(seq, n0, c1, c0 + i, tree, node) for node in frontier]
                for i, (tree, frontier) in enumerate(zip(chunk_trees, frontiers))
            ]
            missing = list(dict.fromkeys(k for ks in keys for k in ks if k not in rows))
            if missing:
                rows.update(_forward_nodes(model, missing, slots, n0, n0 + c1, cache, pair.dtype, device))
            for i, (tree, parents) in enumerate(zip(chunk_trees, frontiers)):
                parent_logits = torch.stack([rows[k] for k in keys[i]])  # [P, V]: the engine's call shape
                scores = [tree.scores[n] if n >= 0 else 0.0 for n in parents]
                logprobs = score_logprobs(parent_logits, sampling)
                frontiers[i] = expand_topk(tree, parents, scores, logprobs, tree_width)
        keep_entries(cache, n0 + c1, [])  # drop the chunk's nodes
        trees.extend(chunk_trees)
        if progress is not None:
            progress(c1 - c0)
    return trees


def _canonical(seq: list[int], n0: int, end: int, t: int, tree: DraftTree, node: int) -> tuple:
    """(t', path') for the node of position t: strip path tokens equal to the trajectory's next tokens
    (the node of position t with path (tokens[t+1], *rest) is the node of t+1 with path rest); t' < end."""
    path = tuple(tree.tokens[n] for n in tree.path_to(node)) if node >= 0 else ()
    while path and t + 1 < end and path[0] == seq[n0 + t + 1]:
        path, t = path[1:], t + 1
    return t, path


def _forward_nodes(model, nodes, slots, n0, prefix, cache, dtype, device) -> dict:
    """One draft forward over canonical ``nodes`` (t, path), appended to the cache after the ``prefix``
    entries and the earlier nodes; returns their logits rows. Node (t, path) sees the committed entries
    < n0 + t + 1 and, among the nodes, its own path prefixes (all forwarded at earlier depths) and itself."""
    tail = len(slots)
    slots.update({node: tail + j for j, node in enumerate(nodes)})
    allowed = np.zeros((len(nodes), prefix + tail + len(nodes)), dtype=bool)  # [Q, prefix + tail + Q]
    ctx = np.asarray([n0 + t + 1 for t, _ in nodes])
    allowed[:, :prefix] = np.arange(prefix)[None, :] < ctx[:, None]
    rows, cols = [], []
    for j, (t, path) in enumerate(nodes):
        for k in range(1, len(path) + 1):
            rows.append(j)
            cols.append(prefix + slots[(t, path[:k])])
    allowed[rows, cols] = True
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(
        torch.from_numpy(~allowed), torch.finfo(dtype).min
    )
    positions = [n0 + t + len(path) for t, path in nodes]
    logits = forward_logits(
        model, [path[-1] for _, path in nodes], positions, cache, device, mask=mask[None, None].to(device)
    )  # [Q, V]
    check_finite(logits, "draft")
    return dict(zip(nodes, logits))


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
) -> Trace:
    """Generate one trajectory (engine, ``seed``) and record the tree at each of its positions."""
    check_record_settings(
        max_depth=max_depth, tree_width=tree_width, max_new_tokens=max_new_tokens, seed=seed, chunk=chunk
    )
    t0 = time.perf_counter()
    result = SpeculativeEngine(pair, sampling).generate(
        list(prompt_ids), max_new_tokens, controller=StaticController(**TRAJECTORY_CONTROLLER), seed=seed
    )
    t1 = time.perf_counter()
    trees = draft_trees(pair, prompt_ids, result.tokens, sampling, max_depth, tree_width, chunk, progress)
    t2 = time.perf_counter()
    meta = trace_meta(pair, prompt_ids, sampling, max_depth, tree_width, max_new_tokens, seed)
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


def read_prompts(path: str | Path) -> list[dict]:
    """Prompts from JSONL: ``{"id": ..., "prompt": ..., optional "language", "task"}`` per line (errors name
    ``--prompts``, the flag of every command line that reads such a file)."""
    prompts = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or err
        raise RecordError(f"prompt file {path} (--prompts) cannot be read: {reason}") from err
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise RecordError(f"--prompts {path}:{lineno}: not JSON ({err})") from err
        if not isinstance(item, dict) or "id" not in item or not isinstance(item.get("prompt"), str):
            raise RecordError(f"--prompts {path}:{lineno}: each line needs an 'id' and a string 'prompt'")
        prompts.append(item)
    return _check_prompts(prompts, f"--prompts {path}")


def _check_prompts(prompts: list[dict], where: str) -> list[dict]:
    """Every prompt has a string 'prompt' and an id (a string or an integer) usable in a file name, once."""
    seen = set()
    for item in prompts:
        if not isinstance(item, dict):
            raise RecordError(
                f"{where}: each prompt must be a dict with 'id' and 'prompt', got {type(item).__name__}"
            )
        raw = item.get("id")
        if not (isinstance(raw, str) or is_int(raw)):
            raise RecordError(f"{where}: prompt id must be a string or an integer, got {raw!r}")
        pid = str(raw)
        if not _ID_RE.fullmatch(pid) or pid in seen or not isinstance(item.get("prompt"), str):
            raise RecordError(
                f"{where}: prompt id {pid!r} is duplicate, not usable in a file name "
                "([A-Za-z0-9._-]) or has no string 'prompt'"
            )
        seen.add(pid)
    if not prompts:
        raise RecordError(f"{where}: no prompts")
    return prompts


def trace_path(out_dir: str | Path, prompt_id: object, sample: int) -> Path:
    """Where the trace of one prompt and sample lives: ``DIR/<id>__s<sample>.npz``."""
    return Path(out_dir) / f"{prompt_id}__s{sample}.npz"


def mismatched_traces(
    out_dir: str | Path,
    wants: Iterable[tuple[Path, dict]],
    keys: Sequence[str] = MATCH_KEYS,
) -> list[tuple[Path, list[str]]]:
    """(path, differing keys) of every readable trace among ``wants`` ((path, wanted meta)) whose meta differs
    from the wanted one in ``keys``; missing and unreadable files are not listed (recording them loses nothing)."""
    found = []
    for path, want in wants:
        if not path.is_file():
            continue
        try:
            meta = Trace.load(path).meta
        except TraceError:
            continue
        differ = [key for key in keys if meta.get(key) != want[key]]
        if differ:
            found.append((path, differ))
    return found


def _refuse(found: list[tuple[Path, list[str]]], out_dir: Path) -> None:
    if found:
        path, differ = found[0]
        raise RecordError(
            f"--out {out_dir} already holds {len(found)} trace(s) recorded with other settings "
            f"(e.g. {path.name}: {', '.join(differ)} differ) that this run would record over; use "
            "another --out, or --overwrite (replace_mismatched=True) to record them again"
        )


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
        read_prompts(prompts)
        if isinstance(prompts, (str, Path))
        else _check_prompts(list(prompts), "prompts")
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
        _refuse(
            mismatched_traces(out, [(path, want) for _, samples in plan for *_, path, want in samples]), out
        )
    summary = RecordSummary(paths=[])
    start = time.perf_counter()
    with tqdm(desc="recording", unit="pos", disable=not progress, dynamic_ncols=True) as bar:
        for index, (item, samples) in enumerate(plan):
            extra = {k: item[k] for k in ("language", "task") if k in item}
            for ids, s, path, want in samples:
                summary.paths.append(path)
                if _matches(path, want):
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
                )
                trace.save(path)
                summary.recorded += 1
                summary.positions += trace.num_positions
                summary.trajectory_s += trace.meta["timing"]["trajectory_s"]
                summary.trees_s += trace.meta["timing"]["trees_s"]
    summary.wall_s = time.perf_counter() - start
    return summary


def _matches(path: Path, want: dict) -> bool:
    if not path.is_file():
        return False
    try:
        meta = Trace.load(path).meta
    except TraceError:
        return False  # corrupt or old format: record it again
    return all(meta.get(key) == want[key] for key in MATCH_KEYS)


def load_traces(directory: str | Path) -> list[Trace]:
    """Every trace in ``directory`` (sorted by file name); ``TraceError`` if there are none or one is bad."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TraceError(f"trace directory not found: {directory}")
    paths = sorted(
        p for p in directory.glob("*.npz") if not p.name.endswith(".tmp.npz")
    )  # .tmp: crashed save
    if not paths:
        raise TraceError(
            f"no trace files (*.npz) in {directory}: record some with python -m envs.record_traces"
        )
    return [Trace.load(p) for p in paths]


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
            _refuse(mismatched_traces(out, wants, SETTING_KEYS), out)
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
