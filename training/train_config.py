"""A training run's config and its run directory (training only): ``TrainConfig`` (the flags of ``train.py``),
the ``--quick`` preset, the comparison of a stored config with a requested one (``config_differences``), and the
run directory's reuse and clearing before a fresh run."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.backends.files import atomic_write_json
from engine.cli import ModelConfig
from engine.config_flags import save_config
from engine.errors import DraftpilotError
from engine.lookup import LookupConfig, describe_lookup, parse_lookup, resolve_lookup
from envs.prompts import is_prompt_set
from envs.recording import MAX_TRACE_DEPTH
from policies.learned import load_policy
from training.ppo_checkpoint import has_checkpoint
from training.ppo_config import PPOConfig


@dataclass
class TrainConfig(ModelConfig):
    """One training run (saved as ``config.json`` in the run directory); the model fields (pair, formats,
    device, threads) come from ``engine.cli.ModelConfig``; the device also runs the policy networks."""

    prompts: str | None = None
    """Prompt suite JSONL ({"id", "language", "task", "split", "prompt"} per line) or a built-in set's name:
    suite, long, grounded (input-grounded requests: code edits, tests for given code, questions, summaries and
    translations of a given text) or mixed (grounded and suite prompts one to one; envs.prompts); none: the
    default workload, mixed (stored as "mixed"), or for the tiny pair, whose byte tokenizer and 1,024-token
    context cannot hold the grounded prompts, the built-in suite."""
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
    the same setting (evaluate.py's learned+lookup row, generate.py --lookup auto). Why this default:
    docs/architecture.md, "Why the defaults are what they are".
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
    lookup_gate: bool = True
    """With context lookup on: the depth policy also decides, request by request and cycle by cycle, whether to
    verify the lookup's proposal (``engine.control.Controller.use_lookup``; it sees the proposal's length and
    the request's lookup and draft acceptance so far), so the lookup's load limit stays a baseline's rule only.
    Off: lookup runs unasked under the engine's load limit, as before."""
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
    backend, 0 with the live one (stored resolved): a policy fit for its device when the device's profile
    drifts between measurements. Why this default: docs/architecture.md, "Why the defaults are what they are"."""
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
    size_steps: int = 50_000
    """Environment steps per size phase (one per drafting cycle). Why 50k, not the depth phase's 200k:
    docs/training.md, "Training budget"."""
    skip_idle_size: bool = True
    """Skip the later size phases once a size phase ended without raising the best validation score (a size
    step costs many replayed cycles where the depth policy drafts rarely, and the exported policy is the best
    by that score): docs/training.md, "Training budget"."""
    depth_steps: int = 200_000
    """Environment steps per depth phase (one per draft step)."""
    eval_every: int = 20_000
    """Validate the joint controller every this many environment steps (and at each phase end). A validation is
    a server replay of every validation trace at every load level, in the main process while the environment
    workers wait (1-3 s on the real pair's traces): docs/training.md, "Training budget"."""
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


IGNORED_FIELDS = ("progress", "run_dir", "run_name", "ppo.workers")
"""Settings that do not change what a run trains: they may differ between a run and a later command."""
PATH_FIELDS = ("prompts", "long_prompts", "profile", "cache_dir", "run_dir")
"""Paths, stored absolute so that a run means the same from any working directory."""


def effective_config(config: TrainConfig) -> TrainConfig:
    """The config a run trains with and stores (``config.json`` and inside ``policy.pt``): paths absolute, the
    default workload named (``prompts``), and one environment for the live backend (one engine: one request at
    a time)."""
    paths = {
        name: str(Path(getattr(config, name)).resolve())
        for name in PATH_FIELDS
        if getattr(config, name) and not is_prompt_set(getattr(config, name))  # a set's name stays a name
    }
    if config.train_profiles.strip():  # each path of the list absolute, like the other paths
        paths["train_profiles"] = ",".join(
            str(Path(p.strip()).resolve()) for p in config.train_profiles.split(",") if p.strip()
        )
    config = replace(config, **paths)
    if config.prompts is None and config.pair != "tiny":  # the default workload, named in the stored config
        config = replace(config, prompts="mixed")
    if config.backend == "live":
        config = replace(config, ppo=replace(config.ppo, n_envs=1))
    return config


def _flat(config: dict) -> dict:
    """One level, PPO fields as ``ppo.<name>``; tuples as lists (what a config read back from JSON holds)."""
    out = {k: v for k, v in config.items() if k != "ppo"}
    out.update({f"ppo.{k}": v for k, v in (config.get("ppo") or {}).items()})
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def config_flag(key: str) -> str:
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
        if key in PATH_FIELDS and x and y and not (is_prompt_set(x) or is_prompt_set(y)):
            x, y = str(Path(x).resolve()), str(Path(y).resolve())
        if x != y:
            out.append(f"{config_flag(key)}: {x!r} -> {y!r}")
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


def reuse_run(run: Path, config: TrainConfig, retrain: bool) -> dict | None:
    """A run directory before a fresh run: the metrics of a policy trained there with this config (reuse, the
    config compared is the one stored inside ``policy.pt``), else None; refuses a policy trained with another
    config or an interrupted run (without --retrain). Removes nothing: ``clear_outputs`` does, once every
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
