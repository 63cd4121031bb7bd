"""Train the depth and size policies with PPO (co-adaptive, as LTD) and export them to one policy file.

    python train.py                                  # main job: default pair, built-in suite, load-aware, ~15-30 min on 2 CPU cores
    python train.py --pair tiny --quick              # plumbing check in seconds
    python train.py --rounds 4 --size-steps 400000   # a bigger budget (default: 3 rounds, 200000 steps)
    python train.py --backend live --pair tiny       # train on the real engine with wall-clock reward
    python train.py --resume runs/<run>              # continue an interrupted run (phase granularity)
    python train.py --run-name main --retrain        # train again in a run directory that holds a policy

Pipeline: cost profile (measured once per pair/device/dtype, cached) -> traces of the train and validation
prompts (recorded once, cached, resumable) -> replay environments -> PPO: size policy (depth from the best
static setting), then depth (size from the size policy), alternating -> the joint controller with the best
validation throughput is exported to ``<run>/policy.pt`` (load it with ``policies.load_policy``, or
``python generate.py --policy <run>/policy.pt``). TensorBoard: ``tensorboard --logdir runs``.

Run directories: a run holds an exclusive lock on its directory while it works (a second run with the same
name fails at once). A run directory whose ``policy.pt`` was trained with this config (the config stored
inside the policy file, not ``config.json``) is reused; one trained with another config is refused unless
``--retrain``, which first removes the earlier run's outputs (policy, metrics, checkpoint, TensorBoard logs).
An interrupted run (a checkpoint, no policy) is continued with ``--resume RUN``, which takes every setting
from the run's ``config.json``: a flag given with it must agree with that config (``--progress`` excepted),
else it is refused naming the flag; start a new run to change settings. Checkpoints are trusted-only (see
``policies.ppo``): resume only runs you wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from engine import SamplingConfig, SpeculativeEngine
from engine.backends.files import DirectoryLock, atomic_write_json
from engine.cli import (
    CLI_ERRORS,
    ArgumentParser,
    ModelConfig,
    add_dataclass_args,
    apply_preset,
    from_args,
    given_flags,
    load_config,
    report_error,
    save_config,
)
from engine.costs.cost_profile import CostProfile
from engine.costs.features import DeviceAtLoad, device_features
from engine.errors import DraftpilotError, InputError
from engine.lookup import LookupConfig, describe_lookup, parse_lookup, resolve_lookup
from envs import workspace
from envs.backends import LiveBackend, ReplayBackend
from envs.environments import EnvConfig
from envs.oracle import oracle_throughput, static_grid
from envs.profiles import ProfileMix
from envs.prompts import LONG_SUITE, interleave_languages, load_suite
from envs.record_traces import MAX_TRACE_DEPTH
from envs.replay import replay_generate, throughput
from policies import AnalyticController, StaticController, load_training
from policies.learned import load_policy, save_policy
from policies.ppo import CoTrainer, PPOConfig, has_checkpoint, verify_checkpoint
from serving.export import EXPORTS, write_exports


@dataclass
class TrainConfig(ModelConfig):
    """One training run (saved as ``config.json`` in the run directory); the model fields (pair, formats,
    device, threads) come from ``engine.cli.ModelConfig``; the device also runs the policy networks."""

    prompts: str | None = None
    """Prompt suite JSONL ({"id", "language", "task", "split", "prompt"} per line); none: the built-in suite."""
    train_split: str = "train"
    """Split the policies are trained on."""
    val_split: str = "tune"
    """Split used for validation (best checkpoint) and the final comparison; never the test split."""
    languages: str = "it,en,zh,es"
    """Comma-separated languages of the suite to use."""
    train_prompts: int = 10
    """Train prompts per language (the suite's train split rotates tasks: 5 covers all five, the default 10
    each twice). Why 10: docs/architecture.md, "Why the defaults are what they are"."""
    val_prompts: int = 4
    """Validation prompts per language."""
    max_new_tokens: int = 128
    """Tokens generated per prompt (trajectory length of each trace)."""
    long_prompts: str | None = None
    """Long-request suite JSONL (same layout as --prompts); none: the built-in long suite (~1.3-2.2k-token
    contexts, long answers). Used by --long-train-prompts / --long-val-prompts."""
    long_train_prompts: int = 0
    """Long requests per language (the long suite's train split) added to the training traces, greedy, at
    --long-max-new-tokens each: the policy then sees long contexts and long generations, where the cost
    profile's context axis (attention over a 2k-token cache) changes what pays. 0: none."""
    long_val_prompts: int = 0
    """Long requests per language (the long suite's --val-split) added to the validation traces. 0: none."""
    long_max_new_tokens: int = 512
    """Tokens generated per long request (trajectory length of each long trace)."""
    lookup: str = "auto"
    """Train for an engine with context lookup drafting (engine.lookup): "off", "on" (3-4:2+8:4), MIN-MAX:K,
    MIN-MAX:K+L:J, or "auto": "on" with the replay backend, "off" with the live one (which has no lookup);
    stored resolved (MIN-MAX:K+L:J). Lookup cycles happen in the episodes, the static baselines and
    validation as in the engine (the policy decides the other cycles); deploy the policy on an engine with
    the same setting (evaluate.py's learned+lookup row, generate.py --lookup auto). The default: a policy
    trained with lookup is the faster one on the lookup engine (docs/architecture.md, "Context lookup").
    Load-aware training tunes the load limit (@N: lookup only while at most N requests decode; the policy
    file carries it) unless the setting names one."""
    temperature: float = 0.0
    """0: greedy traces; > 0: sampled trajectories (the policy is then trained for sampling)."""
    temperatures: str = ""
    """Comma list of sampling temperatures to train and validate across (e.g. 0,0.7,1): the traces of every
    temperature are mixed, and the policy observes the request's temperature, so one policy file serves
    them all; empty: --temperature alone. Replay backend only."""
    samples_per_prompt: int = 1
    """Sampled trajectories per prompt at each temperature > 0 (seeds seed, seed + 1, ...); greedy has one."""
    tree_width: int = 1
    """Draft tree width W of the traces and of the exported controller (1: chains; wider trees pay where
    verifying more rows costs little more than one)."""
    max_depth: int = 8
    """Deepest draft level recorded (the depth policy's cap)."""
    depth_zero: bool = True
    """The depth policy also decides depth 0 (no draft this cycle: an autoregressive step), so it can switch
    speculation off where it does not pay."""
    profile: str | None = None
    """Cost profile JSON; none: measured on first use and cached under cache_dir."""
    train_profiles: str = ""
    """Comma list of cost profile JSONs to train across (randomised device: each episode draws one, rescaled
    to --profile's one-token verify time; validation averages over them); the policy file still carries
    --profile's device features (load_policy(profile=...) conditions it on another device). Empty: --profile
    alone."""
    profile_perturbation: float | None = None
    """Randomised device: each episode also scales the draft cost, the verification slope and the overhead by
    independent log-uniform factors in [1/(1+p), 1+p] (0: the profiles as measured); none: 1.0 with the replay
    backend, 0 with the live one (stored resolved). The default keeps a policy fit for its device when the
    device's profile drifts between measurements, at no cost on the profile itself (docs/architecture.md,
    "Training")."""
    backend: str = "replay"
    """replay (exact traces + cost profile) or live (the real engine, wall-clock reward)."""
    load_aware: bool = True
    """Train for a server (replay backend): every episode decodes its request inside a server replay
    (envs.server) among other clients at a load level of --concurrencies, each cycle charged what it adds to
    the batched forwards; the policy observes the load and is validated and compared per load level. Needs
    the cost profile's batch axis (measured with it by default). Replay backend only (stored False with the
    live one)."""
    concurrencies: tuple[int, ...] = (1, 2, 4, 8)
    """Closed-loop load levels (concurrent clients) of the load-aware episodes, validation and reports."""
    max_requests: int = 8
    """Requests the replayed server decodes at once (serve.py --max-requests); more clients wait."""
    step_overhead_ms: float | None = None
    """Milliseconds a decoding step of the server costs beyond the profile's forwards and per-cycle overheads
    (the step's own Python: scheduling, load, events), added to every replayed step; none: measured on this
    machine once per cost profile (``envs.workspace.ensure_step_overhead``: a batched step of one request
    outside its forward, less the profile's per-cycle overhead) and stored in the run's metrics (docs/architecture.md, "Why the
    defaults are what they are")."""
    reward: str = "average"
    """average (emitted - rho * time, dense) or throughput (LTD's per-cycle emitted / time)."""
    rounds: int = 3
    """Co-adaptation rounds (each: size phase, then depth phase)."""
    size_steps: int = 200_000
    """Environment steps per size phase (one per cycle)."""
    depth_steps: int = 200_000
    """Environment steps per depth phase (one per draft step)."""
    eval_every: int = 10_000
    """Validate the joint controller every this many environment steps (and at each phase end)."""
    seed: int = 0
    """Seeds PPO and the environments (and the sampled trajectories when temperature > 0)."""
    cache_dir: str = "runs/cache"
    """Where profiles and traces are cached (reused by later runs with the same settings)."""
    run_dir: str = "runs"
    """Parent directory of the run."""
    run_name: str | None = None
    """Run directory name; none: <pair>-<reward>-s<seed>-<timestamp>."""
    progress: bool = True
    """Progress bars."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO hyperparameters (flags below, same names)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # stored resolved: what the run trained with ("auto": the defaults in replay, off live)
        default = LookupConfig() if self.backend == "replay" else None
        self.lookup = describe_lookup(resolve_lookup(str(self.lookup), otherwise=default))
        if self.profile_perturbation is None:
            self.profile_perturbation = 1.0 if self.backend == "replay" else 0.0
        if isinstance(self.ppo, dict):
            self.ppo = PPOConfig(**self.ppo)
        if self.backend not in ("replay", "live"):
            raise ValueError(f"backend must be replay or live, got {self.backend!r}")
        if self.reward not in ("average", "throughput"):
            raise ValueError(f"reward must be average or throughput, got {self.reward!r}")
        for name in (
            "rounds",
            "size_steps",
            "depth_steps",
            "train_prompts",
            "val_prompts",
            "max_new_tokens",
            "tree_width",
            "max_depth",
            "samples_per_prompt",
            "long_max_new_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("long_train_prompts", "long_val_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"{name} (--{name.replace('_', '-')}) must be >= 0, got {getattr(self, name)}"
                )
        if (self.long_train_prompts or self.long_val_prompts) and self.backend == "live":
            raise ValueError("--long-train-prompts and --long-val-prompts need --backend replay")
        self.concurrencies = tuple(int(n) for n in self.concurrencies)  # a list when read from JSON
        if self.backend == "live":
            self.load_aware = False  # one request at a time: no load to train for (stored resolved)
        if self.step_overhead_ms is not None and not (
            math.isfinite(self.step_overhead_ms) and 0 <= self.step_overhead_ms <= 1000
        ):
            raise ValueError(
                f"step_overhead_ms (--step-overhead-ms) must be in [0, 1000], got {self.step_overhead_ms}"
            )
        if not self.concurrencies or any(n < 1 for n in self.concurrencies) or self.max_requests < 1:
            raise ValueError(
                f"concurrencies (--concurrencies) must be integers >= 1 and max_requests >= 1, got "
                f"{self.concurrencies}, {self.max_requests}"
            )
        if parse_lookup(self.lookup) is not None and self.backend == "live":
            raise ValueError("--lookup needs --backend replay")
        if self.eval_every < 1:
            raise ValueError(f"eval_every (--eval-every) must be >= 1, got {self.eval_every}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed (--seed) must be in [0, 2**32), got {self.seed}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature (--temperature) must be a finite number >= 0, got {self.temperature}"
            )
        if not (math.isfinite(self.profile_perturbation) and 0 <= self.profile_perturbation <= 10):
            raise ValueError(
                f"profile_perturbation (--profile-perturbation) must be in [0, 10], got {self.profile_perturbation}"
            )
        if (self.train_profiles.strip() or self.profile_perturbation) and self.backend == "live":
            raise ValueError("--train-profiles and --profile-perturbation need --backend replay")
        temps = self.temperature_list()  # a bad list fails here, before anything loads
        if len(temps) > 1 and self.backend == "live":
            raise ValueError("--temperatures with several temperatures needs --backend replay")
        if self.max_depth > MAX_TRACE_DEPTH or self.tree_width**2 * self.max_depth > 32767:
            raise ValueError(
                f"--max-depth {self.max_depth}, --tree-width {self.tree_width} do not fit the trace format "
                f"(max_depth <= {MAX_TRACE_DEPTH} and tree_width^2 * max_depth <= 32767)"
            )

    def temperature_list(self) -> list[float]:
        """The temperatures trained across: ``temperatures`` parsed, or ``[temperature]``."""
        if not self.temperatures.strip():
            return [self.temperature]
        out = []
        for item in self.temperatures.split(","):
            try:
                value = float(item)
            except ValueError:
                value = float("nan")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"temperatures (--temperatures) must be a comma list of finite numbers >= 0, got "
                    f"{self.temperatures!r}"
                )
            if value not in out:
                out.append(value)
        return out


class RunDirectoryError(DraftpilotError, ValueError):
    """A run directory that cannot be used as asked: a policy trained with another config, an interrupted run
    started again without --resume or --retrain, resume flags that contradict the run's config."""


IGNORED_FIELDS = ("progress", "run_dir", "run_name")
"""Settings that do not change what a run trains: they may differ between a run and a later command."""
PATH_FIELDS = ("prompts", "long_prompts", "profile", "cache_dir", "run_dir")
"""Paths, stored absolute so that a run means the same from any working directory."""


def effective_config(config: TrainConfig) -> TrainConfig:
    """The config a run trains with and stores (``config.json`` and inside ``policy.pt``): paths absolute, and
    one environment for the live backend (one engine: one request at a time)."""
    paths = {
        name: str(Path(getattr(config, name)).resolve()) for name in PATH_FIELDS if getattr(config, name)
    }
    if config.train_profiles.strip():  # each path of the list absolute, like the other paths
        paths["train_profiles"] = ",".join(
            str(Path(p.strip()).resolve()) for p in config.train_profiles.split(",") if p.strip()
        )
    config = replace(config, **paths)
    if config.backend == "live":
        config = replace(config, ppo=replace(config.ppo, n_envs=1))
    return config


def _flat(config: dict) -> dict:
    """One level, PPO fields as ``ppo.<name>``; tuples as lists (what a config read back from JSON holds)."""
    out = {k: v for k, v in config.items() if k != "ppo"}
    out.update({f"ppo.{k}": v for k, v in (config.get("ppo") or {}).items()})
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _flag(key: str) -> str:
    return "--" + key.removeprefix("ppo.").replace("_", "-")


def config_differences(stored: dict, current: dict, keys: set[str] | None = None) -> list[str]:
    """``--flag: stored -> current`` for every setting (``IGNORED_FIELDS`` aside; only ``keys`` when given,
    PPO fields as ``ppo.<name>``) on which two configs (``asdict`` form) disagree; paths compare resolved."""
    a, b = _flat(stored), _flat(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in IGNORED_FIELDS or (keys is not None and key not in keys):
            continue
        x, y = a.get(key), b.get(key)
        if key in PATH_FIELDS and x and y:
            x, y = str(Path(x).resolve()), str(Path(y).resolve())
        if x != y:
            out.append(f"{_flag(key)}: {x!r} -> {y!r}")
    return out


QUICK = {
    "train_prompts": 1,
    "val_prompts": 1,
    "max_new_tokens": 24,
    "max_depth": 4,
    "rounds": 1,
    "size_steps": 512,
    "depth_steps": 1024,
    "eval_every": 512,
}
QUICK_PPO = {
    "n_envs": 2,
    "n_steps": 128,
    "batch_size": 64,
    "n_epochs": 2,
    "imitation_steps": 512,
    "imitation_epochs": 3,
}


# ----------------------------------------------------------------------------------------- data
def load_models(config: TrainConfig):
    return config.load()


def ensure_profile(config: TrainConfig, pair):
    profile = workspace.ensure_profile(
        pair, config.cache_dir, config.profile, widths=(1, 2, config.tree_width), progress=config.progress
    )
    if config.load_aware and config.backend == "replay" and not profile.batched:
        raise InputError(
            "--load-aware needs the cost profile's batch axis, which this profile lacks: measure it with "
            "`python -m engine.costs.measure_costs --batch-axis --out FILE` and pass --profile FILE (or delete "
            "the cached profile.json to measure it again), or train with --no-load-aware"
        )
    return profile


def ensure_traces(
    config: TrainConfig,
    pair,
    prompts: list[dict],
    tag: str,
    temperatures: list[float] | None = None,
    max_new_tokens: int | None = None,
):
    """The traces of ``prompts`` at every temperature of the config (or ``temperatures``; ``samples_per_prompt``
    per prompt at temperatures > 0), temperature by temperature, ``max_new_tokens`` (default: the config's)
    each."""
    traces = []
    for temperature in config.temperature_list() if temperatures is None else temperatures:
        traces += workspace.ensure_traces(
            pair,
            prompts,
            config.cache_dir,
            temperature=temperature,
            tree_width=config.tree_width,
            max_depth=config.max_depth,
            max_new_tokens=max_new_tokens or config.max_new_tokens,
            seed=config.seed,
            samples_per_prompt=config.samples_per_prompt,
            progress=config.progress,
            tag=f"{tag} (temperature {temperature:g})" if temperature else tag,
        )
    return traces


def _split_pair(
    path, langs: list[str], train: tuple[str, int], val: tuple[str, int], what: str
) -> tuple[list[dict], list[dict]]:
    """(train, validation) prompts of a suite, each ``(split, per language)`` (0: none), never overlapping."""
    picked = [
        interleave_languages(load_suite(path, split=split, languages=langs, limit_per_language=count))
        if count
        else []
        for split, count in (train, val)
    ]
    overlap = {p["id"] for p in picked[0]} & {p["id"] for p in picked[1]}
    if overlap:
        raise ValueError(f"{what} overlap: {sorted(overlap)}")
    return picked[0], picked[1]


def _languages(config: TrainConfig) -> list[str]:
    return [x.strip() for x in config.languages.split(",") if x.strip()]


def select_prompts(config: TrainConfig):
    return _split_pair(
        config.prompts,
        _languages(config),
        (config.train_split, config.train_prompts),
        (config.val_split, config.val_prompts),
        "train and validation prompts",
    )


def select_long_prompts(config: TrainConfig) -> tuple[list[dict], list[dict]]:
    """The long requests added to training and validation (empty lists when neither flag asks for any)."""
    if not (config.long_train_prompts or config.long_val_prompts):
        return [], []
    return _split_pair(
        config.long_prompts or LONG_SUITE,
        _languages(config),
        (config.train_split, config.long_train_prompts),
        (config.val_split, config.long_val_prompts),
        "long train and validation prompts",
    )


def ensure_long_traces(config: TrainConfig, pair, prompts: list[dict], tag: str):
    """Greedy traces of the long requests at --long-max-new-tokens."""
    if not prompts:
        return []
    return ensure_traces(
        config, pair, prompts, tag, temperatures=[0.0], max_new_tokens=config.long_max_new_tokens
    )


# ----------------------------------------------------------------------------------------- training
def replay_eval(traces, profile, lookup: LookupConfig | None = None):
    return lambda controller: throughput(
        [replay_generate(rt, controller, profile, lookup=lookup) for rt in traces]
    )


def profile_mix(config: TrainConfig, profile) -> ProfileMix | None:
    """The randomised-device mix (``envs.profiles``) of --train-profiles / --profile-perturbation, or None."""
    paths = [p.strip() for p in config.train_profiles.split(",") if p.strip()]
    if not paths and not config.profile_perturbation:
        return None
    members = []
    for path in paths:
        try:
            members.append(CostProfile.load(path))
        except (DraftpilotError, OSError) as err:
            raise InputError(f"--train-profiles: {err}") from None
    return ProfileMix(members or [profile], reference=profile, perturbation=config.profile_perturbation)


def validation(val_traces, profile, mix: ProfileMix | None, lookup: LookupConfig | None = None):
    """Validation throughput of a controller: on ``profile``, or the mean over the mix's measured profiles
    (each unperturbed, the controller conditioned on each one's device features)."""
    if mix is None:
        return replay_eval(val_traces, profile, lookup)

    def mean_over_mix(controller) -> float:
        own = controller.device_feats
        values = []
        try:
            for member in mix.members():
                controller.device_feats = device_features(member, controller.tree_width)
                values.append(replay_eval(val_traces, member, lookup)(controller))
        finally:
            controller.device_feats = own
        return float(np.mean(values))

    return mean_over_mix


def baselines(train_traces, val_traces, profile, config: TrainConfig) -> dict:
    """Static grid (train: the baseline depth; validation: the best static a user could tune there),
    analytic, autoregressive and the oracle on the validation traces (all with the config's context
    lookup: the oracle plans around its cycles, so it bounds every controller replayed with it)."""
    width, depth = config.tree_width, config.max_depth
    lookup = parse_lookup(config.lookup)
    grid_train = static_grid(train_traces, profile, lookup=lookup)
    best_train = max(grid_train, key=grid_train.get)
    grid_val = static_grid(val_traces, profile, lookup=lookup)
    best_val = max(grid_val, key=grid_val.get)
    val = replay_eval(val_traces, profile, lookup)
    return {
        "best_static_train": list(best_train),
        "static_train_on_val": val(StaticController(best_train[0], best_train[1], tree_width=width)),
        "best_static_val": list(best_val),
        "static_best_on_val": grid_val[best_val],
        "analytic_on_val": val(AnalyticController(profile, width, depth)),
        "autoregressive_on_val": val(None),
        "oracle_on_val": oracle_throughput(val_traces, profile, lookup=lookup),
    }


def starting_rho(base: dict, config: TrainConfig) -> float:
    """The average reward's starting rho (and its floor): the best validation throughput of the static
    baseline, the analytic controller and (when the policy may choose depth 0) autoregressive decoding. rho
    should be the best throughput known to be reachable: a lower one makes time look cheap and teaches
    drafting where it does not pay (docs/architecture.md, "Training")."""
    rho = max(base["static_train_on_val"], base.get("analytic_on_val", 0.0))
    if config.depth_zero:
        rho = max(rho, base["autoregressive_on_val"])
    return rho


BASELINES = (
    ("autoregressive", "autoregressive_on_val"),
    ("best static", "static_best_on_val"),
    ("analytic", "analytic_on_val"),
)
"""The controllers the exported policy is compared with on validation (label, metrics key); the oracle, a
bound no controller reaches, is reported beside them."""


def verdict(metrics: dict) -> dict:
    """Which controller won on validation and how the learned policy stands against each baseline:
    ``{"winner", "learned_over": {label: ratio}, "verdict": one line}``."""
    learned = metrics["learned_on_val"]
    ratios = {label: learned / metrics[key] for label, key in BASELINES}
    best_label, best_key = max(BASELINES, key=lambda b: metrics[b[1]])
    if learned >= metrics[best_key]:
        winner = "learned"
        line = (
            f"the learned policy is the fastest: {ratios['analytic']:.3f}x the analytic controller, "
            f"{ratios['best static']:.3f}x the best static setting"
        )
    else:
        winner = best_label
        line = (
            f"the {best_label} controller beats the learned policy ({ratios[best_label]:.3f}x): on this device "
            "and data the exported policy is not worth deploying over it (train longer, on more prompts, or "
            f"deploy the {best_label} controller)"
        )
    return {"winner": winner, "learned_over": ratios, "verdict": line}


def summary_text(metrics: dict) -> str:
    """The validation summary: every baseline with the learned policy's ratio over it, and the verdict."""
    learned = metrics["learned_on_val"]
    static = f" (D, V) = {tuple(metrics['best_static_val'])}"
    rows = [("learned (exported)", learned, "")]
    rows += [
        (label + (static if label == "best static" else ""), metrics[key], f"{learned / metrics[key]:.3f}x")
        for label, key in BASELINES
    ]
    rows.append(
        ("oracle (hindsight bound)", metrics["oracle_on_val"], f"{metrics['learned_over_oracle']:.3f}x")
    )
    width = max(len(r[0]) for r in rows)
    lines = [
        f"validation throughput (replay, {len(metrics['val_prompts'])} held-out prompts, tokens/s; "
        "learned / each):"
    ]
    lines += [f"  {label:<{width}}  {value:8.3f}  {ratio}".rstrip() for label, value, ratio in rows]
    lines.append(f"verdict: {metrics['verdict']}")
    if metrics.get("load"):
        lines += load_training.load_summary(metrics["load"])
    return "\n".join(lines)


def run_directory(config: TrainConfig) -> Path:
    """``run_dir/run_name``, or ``run_dir/<pair>-<reward>-s<seed>-<timestamp>`` without a name."""
    name = config.run_name
    if name and (Path(name).name != name or name in (".", "..")):
        raise RunDirectoryError(f"--run-name must be a plain directory name inside --run-dir, got {name!r}")
    return Path(config.run_dir) / (
        config.run_name
        or f"{config.pair.replace('/', '_').replace('::', '+')}-"
        f"{config.reward}-s{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    )


def train(config: TrainConfig, resume: Path | None = None, retrain: bool = False) -> dict:
    """Train (or reuse, or resume) one run; returns its metrics and ``policy`` (the policy file's path). The
    run directory is locked for the whole call (``DirectoryBusyError`` if another process holds it)."""
    config = effective_config(config)
    run = Path(resume) if resume is not None else run_directory(config)
    config.check()
    select_prompts(config)  # a bad prompt file fails before the run directory is touched
    with DirectoryLock(
        run, "run directory (--resume)" if resume is not None else "run directory (--run-dir/--run-name)"
    ):
        if resume is None:
            reused = _reuse(run, config, retrain)
            if reused is not None:
                return reused
            checkpoint = None
        else:  # checked now, before minutes of loading, and again when it is loaded
            checkpoint = run / "checkpoint" if verify_checkpoint(run / "checkpoint") is not None else None
        return _train(config, run, checkpoint, fresh=resume is None)


def _reuse(run: Path, config: TrainConfig, retrain: bool) -> dict | None:
    """A run directory before a fresh run: the metrics of a policy trained there with this config (reuse, the
    config compared is the one stored inside ``policy.pt``), else None; refuses a policy trained with another
    config or an interrupted run (without --retrain). Removes nothing: ``_clear_outputs`` does, once every
    input has been checked."""
    policy = run / "policy.pt"
    if not retrain and policy.is_file():
        try:
            meta = load_policy(policy).meta
        except DraftpilotError as err:
            raise RunDirectoryError(
                f"{policy} is not a usable policy ({err}); --retrain to train again"
            ) from err
        changed = config_differences(meta.get("train_config") or {}, asdict(config))
        if changed:
            raise RunDirectoryError(
                f"{run} holds a policy trained with another config ({'; '.join(changed)}): pick "
                "another --run-name or --retrain"
            )
        metrics = meta.get("metrics") or {}
        if not (run / "metrics.json").is_file():  # a run killed between the policy and its metrics
            atomic_write_json(run / "metrics.json", metrics)
        # the config the policy was trained with (a stale one may sit there)
        save_config(config, run / "config.json")
        print(f"reusing {run}: it was trained with this exact config (--retrain to train again)", flush=True)
        return {**metrics, "policy": str(policy)}
    if not retrain and has_checkpoint(run / "checkpoint"):
        raise RunDirectoryError(
            f"{run} holds an interrupted run (a checkpoint, no policy): continue it with --resume "
            f"{run}, or start it over with --retrain"
        )
    return None


def _clear_outputs(run: Path) -> None:
    """Remove every output of an earlier run, so that a kill can never leave an old policy looking like this
    run's."""
    for name in ("policy.pt", "metrics.json", *EXPORTS):
        (run / name).unlink(missing_ok=True)
    for name in ("checkpoint", "tb"):
        if (run / name).is_dir():
            shutil.rmtree(run / name)


def _train(config: TrainConfig, run: Path, checkpoint: Path | None, fresh: bool = True) -> dict:
    """Load the inputs (prompts, models, cost profile: every refusal happens here, before the run directory
    changes), then (a fresh run) clear an earlier run's outputs, write ``config.json`` and train."""
    from torch.utils.tensorboard import SummaryWriter

    started = time.perf_counter()
    train_prompts, val_prompts = select_prompts(config)  # a bad prompt file fails before any model loads
    long_train, long_val = select_long_prompts(config)
    pair = load_models(config)
    profile = ensure_profile(config, pair)
    mix = profile_mix(config, profile)
    if fresh:
        _clear_outputs(run)
    save_config(config, run / "config.json")
    train_traces = ensure_traces(config, pair, train_prompts, "train")
    val_traces = ensure_traces(config, pair, val_prompts, "validation")
    train_traces += ensure_long_traces(config, pair, long_train, "train (long)")
    val_traces += ensure_long_traces(config, pair, long_val, "validation (long)")
    data_s = time.perf_counter() - started

    lookup = parse_lookup(config.lookup)
    base = baselines(train_traces, val_traces, profile, config)
    depth_d, depth_v = base["best_static_train"]
    print(
        f"baselines on validation (replay, tokens/s): best static {tuple(base['best_static_val'])} "
        f"{base['static_best_on_val']:.3f}, static tuned on train {(depth_d, depth_v)} {base['static_train_on_val']:.3f}, "
        f"analytic {base['analytic_on_val']:.3f}, autoregressive {base['autoregressive_on_val']:.3f}, "
        f"oracle {base['oracle_on_val']:.3f}",
        flush=True,
    )

    def baseline():
        return StaticController(depth_d, depth_v, tree_width=config.tree_width)

    feats = device_features(profile, config.tree_width)
    setup, loads, evaluate = None, None, validation(val_traces, profile, mix, lookup)
    if config.load_aware:
        if config.step_overhead_ms is not None:
            step_overhead_s = config.step_overhead_ms / 1e3
        else:
            step_overhead_s = workspace.ensure_step_overhead(pair, profile, config.cache_dir, config.progress)
        print(
            f"a server step's own cost (replayed with every step): {step_overhead_s * 1e3:.1f} ms", flush=True
        )
        if lookup is not None and not lookup.max_requests:  # no limit given: tuned on the train traces
            lookup, ratios = load_training.tuned_lookup(
                train_traces, profile, lookup, config.concurrencies, config.max_requests, step_overhead_s
            )
            print(
                "context lookup under load (server replay, train traces; lookup-only over autoregressive): "
                + ", ".join(f"N={n} {r:.3f}" for n, r in ratios.items())
                + f" -> {describe_lookup(lookup)}"
                + (
                    f" (lookup only while at most {lookup.max_requests} requests decode)"
                    if lookup.max_requests
                    else ""
                ),
                flush=True,
            )
        setup = load_training.load_setup(
            train_traces, val_traces, profile, lookup, config.concurrencies, config.max_requests,
            step_overhead_s=step_overhead_s,
        )  # fmt: skip
        print(
            "static chain tuned per load level (server replay, train traces; depth: system tokens/s): "
            + ", ".join(f"N={n} {d}: {tps:.1f}" for n, (d, tps) in setup.table.items()),
            flush=True,
        )
        loads = DeviceAtLoad(profile, config.tree_width, alone=feats)
        evaluate = lambda controller: setup.score(lambda: controller)  # noqa: E731 - one shared controller
    if config.backend == "live":
        engine = SpeculativeEngine(pair, SamplingConfig(temperature=config.temperature))
        prompts = [pair.encode(p["prompt"]) for p in train_prompts]
        backend = LiveBackend(engine, prompts, config.tree_width, config.max_new_tokens, profile)
    elif setup is not None:
        backend = setup.backend(profile, mix, lookup, config.max_requests)
    else:
        backend = ReplayBackend(
            train_traces,
            profile,
            profiles=mix,
            lookup=lookup,
        )
    torch.set_num_threads(1)  # the policy networks are tiny; threads only add overhead
    policy_device = "cuda" if config.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    writer = SummaryWriter(str(run / "tb" / "validation"))
    writer.add_text("config", "```\n" + json.dumps(asdict(config), indent=1) + "\n```")
    env_config = EnvConfig(reward=config.reward, rho=starting_rho(base, config), depth_zero=config.depth_zero)
    trainer = CoTrainer(
        backend,
        config.ppo,
        env_config,
        baseline,
        evaluate,
        max_depth=config.max_depth,
        device_feats=feats,
        loads=loads,
        seed=config.seed,
        device=policy_device,
        tensorboard_dir=str(run / "tb"),
        eval_every=config.eval_every,
        writer=writer,
        progress=config.progress,
    )
    if checkpoint is not None:
        trainer.load(checkpoint)
        print(f"resumed {run} after {len(trainer.history)} phases", flush=True)
    phases = [("imitation", 0)] if config.ppo.imitation_steps else []
    phases += [(name, r) for r in range(config.rounds) for name in ("size", "depth")]
    for name, r in phases[len(trainer.history) :]:
        if name == "imitation":
            log = trainer.imitate(lambda p: AnalyticController(p, config.tree_width, config.max_depth))
            fits = ", ".join(f"{n} {v['agreement']:.1%}" for n, v in trainer.imitation.items())
            print(
                f"imitation of the analytic controller: {log.steps} decisions in {log.seconds:.0f} s "
                f"(agreement {fits}), validation {log.validation[-1][1]:.3f} tokens/s",
                flush=True,
            )
        else:
            log = trainer.run_phase(name, config.size_steps if name == "size" else config.depth_steps, r)
            last = log.validation[-1][1] if log.validation else float("nan")
            print(
                f"round {r + 1}/{config.rounds} {name}: {log.steps} steps in {log.seconds:.0f} s, "
                f"validation {last:.3f} tokens/s (best so far {trainer.best[0]:.3f})",
                flush=True,
            )
        trainer.save(run / "checkpoint")
    writer.close()

    best_tps, depth_actor, size_actor = trainer.best
    if depth_actor is None:  # validation never ran on a complete controller
        depth_actor, size_actor = trainer.actor("depth"), trainer.actor("size")
        best_tps = evaluate(trainer.joint())
    validated = {}
    if setup is not None:  # the score across load levels chose the policy; report batch one's figure too
        validated["learned_load_score"] = best_tps
        if mix is not None:  # batch one over the mix, as a run without the load reports it
            validated["learned_on_val_mix"] = validation(val_traces, profile, mix, lookup)(
                trainer.controller(depth_actor, size_actor)
            )
        best_tps = replay_eval(val_traces, profile, lookup)(trainer.controller(depth_actor, size_actor))
    elif mix is not None:  # validation averaged over the mix: report the deployment profile's figure too
        validated["learned_on_val_mix"] = best_tps
        best_tps = replay_eval(val_traces, profile, lookup)(trainer.controller(depth_actor, size_actor))
    metrics = {
        **base,
        **validated,
        "learned_on_val": best_tps,
        "learned_over_static": best_tps / base["static_best_on_val"],
        "learned_over_analytic": best_tps / base["analytic_on_val"],
        "learned_over_oracle": best_tps / base["oracle_on_val"],
        "learned_over_autoregressive": best_tps / base["autoregressive_on_val"],
        "imitation": trainer.imitation,
        "data_s": data_s,
        "train_s": sum(h.seconds for h in trainer.history),
        "total_s": time.perf_counter() - started,
        "val_prompts": [p["id"] for p in val_prompts],
        "train_prompts": [p["id"] for p in train_prompts],
        "phases": [asdict(h) for h in trainer.history],
    }
    if lookup is not None:
        metrics["lookup"] = describe_lookup(
            lookup
        )  # with the load limit tuned above (trained_lookup reads it)
    if setup is not None:
        metrics["step_overhead_ms"] = setup.train.step_overhead_s * 1e3
        learned = trainer.controller(depth_actor, size_actor)
        metrics["load"] = load_training.load_report(
            setup, profile, config.tree_width, config.max_depth, learned, "learned (exported)"
        )
    judged = verdict(metrics)
    metrics.update(winner=judged["winner"], verdict=judged["verdict"])
    if judged["winner"] != "learned":
        print(f"warning: {judged['verdict']}", flush=True)
    path = save_policy(
        run / "policy.pt",
        depth_actor,
        size_actor,
        size_ladder=trainer.env_config.size_ladder,
        tree_width=config.tree_width,
        max_depth=config.max_depth,
        device_feats=feats,
        pair=pair.name,
        profile=profile.to_dict(),
        train_config=asdict(config),
        metrics=metrics,
        depth_zero=config.depth_zero,
    )
    if setup is not None:
        ranges = {(a, b): k for a, b, k in metrics["load"]["table_ranges"]}
        tuned = load_training.table_ranges({n: d for n, (d, _) in setup.table.items()})
        metrics["load"]["exports"] = write_exports(ranges, run, tuned=tuned)
    atomic_write_json(run / "metrics.json", metrics)
    metrics["policy"] = str(path)
    return metrics


# ----------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python train.py", description=__doc__)
    add_dataclass_args(ap, TrainConfig)
    add_dataclass_args(ap, PPOConfig, group="PPO")
    ap.add_argument("--quick", action="store_true", help="tiny budget (plumbing check; explicit flags win)")
    ap.add_argument(
        "--resume",
        help="run directory to continue (its config.json is used: flags given with it must "
        "agree with it, --progress excepted)",
    )
    ap.add_argument(
        "--retrain",
        action="store_true",
        help="train again even if --run-name already holds a policy trained with this config",
    )
    return ap


def config_from_argv(argv: list[str] | None) -> tuple[TrainConfig, Path | None, bool]:
    """(config, run directory to resume or None, retrain). With ``--resume RUN`` the config is the run's
    ``config.json``; flags given with it must agree with it (``--progress`` is honoured), else
    ``RunDirectoryError`` names the ones that differ."""
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    preset = {**QUICK, **QUICK_PPO} if args.quick else {}
    if args.quick:
        apply_preset(ap, args, argv, preset)
    if args.resume:
        if args.retrain:
            raise RunDirectoryError(
                "--resume continues a run and --retrain starts one over: give one of them"
            )
        run = Path(args.resume)
        if not (run / "config.json").is_file():
            raise RunDirectoryError(f"--resume {run}: not a train.py run directory (no config.json)")
        stored = load_config(TrainConfig, run / "config.json")
        given = (given_flags(ap, argv) | set(preset)) - {"resume", "retrain", "quick", "progress"}
        if given:
            requested = from_args(TrainConfig, args, ppo=from_args(PPOConfig, args))
            ppo_names = {f.name for f in dataclasses.fields(PPOConfig)}
            keys = {f"ppo.{k}" if k in ppo_names else k for k in given}
            changed = config_differences(
                asdict(effective_config(stored)), asdict(effective_config(requested)), keys
            )
            changed += [
                f"{_flag(k)} (the run is the --resume directory)"
                for k in sorted(given)
                if k in ("run_dir", "run_name")
            ]
            if changed:
                raise RunDirectoryError(
                    f"--resume {run} continues the run with the settings of its config.json; "
                    f"these flags differ from it: {'; '.join(changed)}. Drop them, or start a new "
                    "run (another --run-name) to change them"
                )
        if "progress" in given_flags(ap, argv):
            stored = replace(stored, progress=args.progress)
        return stored, run, False
    ppo = from_args(PPOConfig, args)
    return from_args(TrainConfig, args, ppo=ppo), None, args.retrain


def main(argv: list[str] | None = None) -> int:
    try:
        config, resume, retrain = config_from_argv(argv)
        metrics = train(config, resume, retrain)
    except (*CLI_ERRORS, ValueError) as err:  # a config dataclass refuses a value with ValueError
        return report_error(err)
    print(f"\nexported policy: {metrics['policy']}")
    print(summary_text(metrics))
    print(
        f"time: data {metrics['data_s']:.0f} s, training {metrics['train_s']:.0f} s, total {metrics['total_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
