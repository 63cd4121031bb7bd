"""The cached inputs of training and evaluation: the model pair, its cost profile (measured once per
pair/device/weight format) and replay traces (recorded once per prompt and settings, resumable), all under one
cache directory so that later runs reuse them; ``replay_inputs``: those inputs for replaying a policy file on the
settings it was trained with (benchmarks/replay_policies.py, benchmarks/foresight.py).

    <cache_dir>/<pair>/<cpu|cuda>-<precision>[-native][-nV]/profile.json      (precision: ModelPair.precision)
    <cache_dir>/<pair>/<cpu|cuda>-<precision>[-native][-nV]/traces/<greedy|tT>-w<W>-d<D>-n<N>-s<seed>/<id>__s<k>.npz

"-native": the pair runs the native decoder (``engine.backends.lean``), whose speed and logits differ from the
torch-operation forward of the same weights, so its profiles and traces are kept apart. "-nV": the
compiled kernels' arithmetic version (``engine.backends.native.KERNEL_NUMERICS``, written from version 2 on), for
pairs with kquant layers: traces recorded by kernels that computed other bits are never replayed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.backends import lean
from engine.backends.files import atomic_write_json
from engine.backends.models import load_pair
from engine.backends.native import KERNEL_NUMERICS
from engine.backends.pair import ModelPair
from engine.costs.cost_profile import CostProfile, load_profile_arg
from engine.costs.measure_batch import measure_step_overhead
from engine.costs.measure_costs import measure_profile
from engine.costs.profile_config import ProfileConfig
from engine.lookup import describe_lookup
from engine.sampling import SamplingConfig
from envs.prompts import suite_split
from envs.record_traces import record_prompts
from envs.replay import ReplayTrace
from envs.trace import Trace


def load_models(
    pair: str,
    dtype: str = "auto",
    device: str = "auto",
    threads: int = 0,
    weights: str = "auto",
    draft_weights: str = "auto",
    draft_vocab: int = 0,
) -> ModelPair:
    """A named pair (qwen2.5-coder, tiny) or "TARGET::DRAFT" (paths or hub ids) in the given weight formats
    (``engine.backends.quant``); ``threads`` > 0 sets torch's intra-op threads first."""
    if threads:
        torch.set_num_threads(threads)
    return load_pair(
        pair,
        dtype=dtype,
        device=device,
        weights=weights,
        draft_weights=draft_weights,
        draft_vocab=draft_vocab,
    )


def pair_dir(pair: ModelPair, cache_dir: str | Path) -> Path:
    dev = "cuda" if pair.device.type == "cuda" else "cpu"
    name = pair.name.replace("/", "_").replace(":", "_")
    native = lean.NATIVE and any(
        lean.native_decoder(model) is not None for model in (pair.target, pair.draft)
    )
    uses_kernels = any(fmt.startswith("kquant") for fmt in (pair.weights, pair.draft_weights))
    numerics = f"-n{KERNEL_NUMERICS}" if uses_kernels and KERNEL_NUMERICS > 1 else ""
    return Path(cache_dir) / name / f"{dev}-{pair.precision}{'-native' if native else ''}{numerics}"


def ensure_profile(
    pair: ModelPair,
    cache_dir: str | Path,
    path: str | Path | None = None,
    widths: Sequence[int] = (1, 2, 4),
    progress: bool = True,
) -> CostProfile:
    """The profile at ``path`` if given, else the cached one for this pair/device/dtype, measured (and
    cached) the first time: the contexts traces visit, the full size ladder, 3 repetitions, and the batch
    axis (1-16 sequences of 1-8 rows: what the server replay and load-aware training charge)."""
    if path:
        return load_profile_arg(path)
    cached = pair_dir(pair, cache_dir) / "profile.json"
    if cached.is_file():
        return CostProfile.load(cached)
    widths = tuple(sorted(set(widths)))
    if pair.name == "tiny":
        grid = replace(
            ProfileConfig.quick(),
            widths=widths,
            batch_axis=True,
            batch_sequences=(1, 2, 4),
            batch_rows=(1, 2, 4),
        )
    else:
        grid = ProfileConfig(
            contexts=(128, 512, 1024, 2048),
            widths=widths,
            reps=3,
            prefill_reps=1,
            overhead_cycles=6,
            batch_axis=True,
            batch_sequences=(1, 2, 4, 8, 16),
            batch_context=512,
        )
    print(f"measuring the cost profile once ({cached}) ...", flush=True)
    profile = measure_profile(pair, grid, progress=progress)
    profile.save(cached)
    return profile


def ensure_step_overhead(
    pair: ModelPair, profile: CostProfile, cache_dir: str | Path, progress: bool = True
) -> float:
    """Seconds a batched decoding step costs beyond ``profile``'s charge
    (``engine.costs.measure_batch.measure_step_overhead``), measured once per profile and cached beside the
    pair's profile (a profile measured again is measured again against)."""
    digest = hashlib.sha256(json.dumps(profile.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
    cached = pair_dir(pair, cache_dir) / "step_overhead.json"
    if cached.is_file():
        try:
            data = json.loads(cached.read_text(encoding="utf-8"))
            if data.get("profile_sha256") == digest:
                return float(data["step_overhead_s"])
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: measured again
    if progress:
        print(f"measuring the batched step's own cost once ({cached}) ...", flush=True)
    seconds = measure_step_overhead(pair, profile)
    cached.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cached, {"step_overhead_s": seconds, "profile_sha256": digest})
    return seconds


def ensure_traces(
    pair: ModelPair,
    prompts: list[dict],
    cache_dir: str | Path,
    *,
    temperature: float = 0.0,
    tree_width: int = 4,
    max_depth: int = 8,
    max_new_tokens: int = 64,
    seed: int = 0,
    samples_per_prompt: int = 1,
    progress: bool = True,
    tag: str = "traces",
) -> list[ReplayTrace]:
    """``ReplayTrace``s of ``prompts`` (``samples_per_prompt`` per prompt, prompt by prompt; sample s drawn
    with seed ``seed + s``; greedy trajectories have one sample), recorded the first time, then read from
    the cache."""
    if temperature == 0:
        seed = 0  # greedy trajectories do not depend on the seed: one cached trace set serves every seed
        samples_per_prompt = 1
    mode = "greedy" if temperature == 0 else f"t{temperature:g}"
    directory = (
        pair_dir(pair, cache_dir) / "traces" / f"{mode}-w{tree_width}-d{max_depth}-n{max_new_tokens}-s{seed}"
    )
    summary = record_prompts(
        pair,
        prompts,
        directory,
        SamplingConfig(temperature=temperature),
        max_depth=max_depth,
        tree_width=tree_width,
        max_new_tokens=max_new_tokens,
        seed=seed,
        samples_per_prompt=samples_per_prompt,
        progress=progress,
    )
    if summary.recorded:
        print(
            f"{tag}: recorded {summary.recorded} traces, {summary.positions} positions in {summary.wall_s:.0f} s "
            f"({summary.positions_per_min:.0f} positions/min); kept {summary.skipped} cached",
            flush=True,
        )
    return [ReplayTrace(Trace.load(p)) for p in summary.paths]


def replay_inputs(
    policy: Any,
    profile: CostProfile | None,
    cache_dir: str,
    split: str,
    per_language: int,
    tune_split: str,
    tune_per_language: int,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
):
    """(cost profile, measured traces, tune traces) to replay ``policy``'s (a loaded policy file,
    ``policies.learned.load_policy``: its ``meta``, ``tree_width``, ``max_depth``) kind of controller on: the models
    and trace settings it was trained with (``max_new_tokens`` / ``temperature`` override its own), traces
    from the shared cache (recorded on first use), ``profile`` or else the policy's training profile."""
    config = policy.meta["train_config"]
    pair = load_models(config["pair"], config["dtype"], config["device"], config["threads"])
    profile = profile or ensure_profile(pair, cache_dir, config.get("profile"))
    kw = {
        "temperature": config["temperature"] if temperature is None else temperature,
        "tree_width": policy.tree_width,
        "max_depth": policy.max_depth,
        "max_new_tokens": max_new_tokens or config["max_new_tokens"],
        "seed": config["seed"],
    }

    def traces(name: str, count: int):
        return ensure_traces(pair, suite_split(name, count), cache_dir, tag=name, **kw)

    return profile, traces(split, per_language), traces(tune_split, tune_per_language)


def trace_summary(measured: Sequence[ReplayTrace], split: str, profile: CostProfile, lookup: Any) -> str:
    """The header line of a replay table: traces, positions, the profile's device, the lookup."""
    return (
        f"{len(measured)} {split} traces ({sum(rt.trace.num_positions for rt in measured)} positions); "
        f"profile {profile.meta.get('device_name')} {profile.meta.get('dtype')} "
        f"{profile.meta.get('num_threads')} threads; lookup {describe_lookup(lookup)}"
    )
