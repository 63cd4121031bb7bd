"""PPO wiring (stable-baselines3) for the depth and size policies: training code only, never imported on
the inference path (``policies.learned`` is what the engine loads).

``CoTrainer`` runs LTD's co-adaptive schedule: the size policy first (depth from a baseline controller),
then the depth policy (size from the trained size policy), alternating for ``rounds``. Each phase is an
SB3 ``PPO.learn`` on vectorised replay (or live) environments whose *other* decision is a
``LearnedController`` built from the other policy's current actor. A callback moves the average reward's
rho toward the policy's throughput after every rollout, logs charts to TensorBoard and validates the joint
controller (both current actors) on held-out traces, keeping the best by validation throughput.

Checkpoints (``CoTrainer.save`` / ``load``, a directory, ``<run>/checkpoint`` in ``train.py``) are for
resuming *your own* interrupted run and are trusted-only: the SB3 models are SB3's zip format, whose
loader unpickles (cloudpickle) and can run code. The trainer's own state is plain tensors and numbers read
with ``torch.load(weights_only=True)``, and ``manifest.json`` (plain JSON, written last and atomically)
records the sha256 of every file and is signed with an HMAC under a per-user secret key
(``engine.backends.files.user_hmac``: ``<cache>/secret/signing.key``, owner-only, made on first use); ``load``
refuses a directory without a manifest, with a manifest this user's key did not sign, or with any file that
does not match it, before unpickling anything. A truncated, swapped or edited file is refused, and so is a
planted checkpoint whose manifest was rewritten to match, unless its author can read your key.
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.running_mean_std import RunningMeanStd
from stable_baselines3.common.torch_layers import FlattenExtractor
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from engine.backends.files import (
    atomic_path,
    atomic_write_json,
    load_plain,
    sha256_file,
    user_hmac,
    user_key_path,
)
from engine.control import Controller
from engine.costs.cost_profile import CostProfile
from engine.costs.features import DEPTH_OBS_DIM, SIZE_OBS_DIM
from engine.errors import DraftpilotError
from envs.backends import Backend
from envs.environments import DepthEnv, EnvConfig, NoDecisionError, SizeEnv, reference_rho
from policies import imitation
from policies.learned import Actor, LearnedController

if TYPE_CHECKING:  # tensorboard is imported where a run writes its logs
    from torch.utils.tensorboard import SummaryWriter

ACTIVATION_NAMES = {torch.nn.Tanh: "tanh", torch.nn.ReLU: "relu"}
CLIP_OBS, OBS_EPS = 10.0, 1e-8
CHECKPOINT_FORMAT, CHECKPOINT_VERSION = "draftpilot-checkpoint", 1
IMITATION_LR = 1e-3
"""Adam's learning rate for the imitation fit, whatever PPO's (a supervised fit: fixed, not PPO's schedule;
fitted with PPO's 3e-4, the depth actor agreed with the teacher on 94.8% of its decisions instead of 96.5%
and validated 2% lower, docs/architecture.md "Imitation start")."""
MANIFEST = "manifest.json"
CHECKPOINT_ENTRIES = ("trainer.pt", "size.zip", "depth.zip")
"""The files of a checkpoint by role; on disk each is ``<stem>.<phases>-<random><ext>`` (a new name per save,
so a kill between two files leaves the previous manifest and the files it names untouched)."""


class CheckpointError(DraftpilotError, ValueError):
    """A training checkpoint that is not loaded: no manifest, a file that does not match it, or trainer state
    that is not plain tensors and numbers."""


@dataclass
class PPOConfig:
    """PPO hyperparameters, one set shared by both policies except gamma."""

    n_envs: int = 8
    """Vectorised environments per policy (replay envs share one backend)."""
    n_steps: int = 256
    """Steps per environment per rollout (rollout = n_envs * n_steps transitions)."""
    batch_size: int = 256
    """Minibatch size."""
    n_epochs: int = 5
    """Passes over each rollout."""
    learning_rate: float = 1e-3
    """Initial Adam learning rate (decays linearly to 10% over each phase when lr_decay)."""
    lr_decay: bool = True
    """Decay the learning rate linearly within each phase."""
    ent_coef: float = 0.001
    """Entropy bonus."""
    clip_range: float = 0.2
    """PPO clipping."""
    gae_lambda: float = 0.95
    """GAE lambda."""
    gamma_size: float = 0.5
    """Discount per cycle for the size policy (a size choice barely changes later cycles: short horizon)."""
    gamma_depth: float = 0.99
    """Discount per draft step for the depth policy (a cycle's reward arrives after its last draft step:
    discounting inside the cycle would bias the policy toward stopping)."""
    net_arch: str = "64,64"
    """Hidden layer widths of actor and critic (separate networks)."""
    activation: str = "tanh"
    """tanh or relu."""
    rho_smoothing: float = 0.5
    """After each rollout rho moves this fraction toward the rollout's throughput (average reward)."""
    imitation_steps: int = 24_000
    """Before PPO, both actors (and critics) are fitted to a teacher controller's decisions (the analytic
    controller in ``train.py``), this many decisions of each policy collected on the training episodes:
    PPO then starts from the teacher's behaviour and learns where it is wrong, and the imitated pair is
    the first export candidate. 0: PPO from scratch (the depth policy's first phase then runs against the
    baseline controller)."""
    imitation_epochs: int = 30
    """Passes over the imitation data (cross-entropy for the actor, squared error on the teacher's
    discounted returns for the critic)."""

    def __post_init__(self) -> None:
        for name in ("n_envs", "n_steps", "batch_size", "n_epochs", "imitation_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.imitation_steps < 0:
            raise ValueError(f"imitation_steps (--imitation-steps) must be >= 0, got {self.imitation_steps}")
        if self.activation not in ("tanh", "relu"):
            raise ValueError(f"activation must be tanh or relu, got {self.activation!r}")
        try:
            arch = [int(x) for x in self.net_arch.split(",") if x.strip()]
        except ValueError:
            arch = [0]
        if not arch or min(arch) < 1:
            raise ValueError(f"net_arch must be comma-separated layer widths >= 1, got {self.net_arch!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        for name, low, high, low_open in (
            ("gamma_size", 0.0, 1.0, True),
            ("gamma_depth", 0.0, 1.0, True),
            ("gae_lambda", 0.0, 1.0, False),
            ("clip_range", 0.0, float("inf"), True),
            ("ent_coef", 0.0, float("inf"), False),
            ("rho_smoothing", 0.0, 1.0, False),
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and (low < value if low_open else low <= value) and value <= high):
                bound = (
                    f"{'(' if low_open else '['}{low:g}, {high:g}]" if high < float("inf") else f"> {low:g}"
                )
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be in {bound}, got {value}")


@dataclass
class PhaseLog:
    policy: str
    round: int
    steps: int
    seconds: float
    validation: list[tuple[int, float]] = field(default_factory=list)


def actor_from_model(
    model: PPO, obs_rms: RunningMeanStd | None = None, clip_obs: float = CLIP_OBS, epsilon: float = OBS_EPS
) -> Actor:
    """The deterministic actor of an SB3 PPO model and its observation normaliser (``VecNormalize.obs_rms``,
    None: identity) as a torch-only ``Actor``."""
    policy = model.policy
    if not isinstance(policy.features_extractor, FlattenExtractor):
        raise TypeError("only MLP policies on flat observations can be exported")
    layers = [m for m in policy.mlp_extractor.policy_net if isinstance(m, torch.nn.Linear)] + [
        policy.action_net
    ]
    obs_dim = policy.observation_space.shape[0]
    if obs_rms is not None:
        mean, var, clip, eps = obs_rms.mean, obs_rms.var, clip_obs, epsilon
    else:
        mean, var, clip, eps = np.zeros(obs_dim), np.ones(obs_dim), np.inf, 0.0
    spec = {
        "weights": [m.weight.detach().cpu().clone() for m in layers],
        "biases": [m.bias.detach().cpu().clone() for m in layers],
        "activation": ACTIVATION_NAMES[policy.activation_fn],
        "obs_mean": torch.as_tensor(mean, dtype=torch.float32),
        "obs_var": torch.as_tensor(var, dtype=torch.float32),
        "clip_obs": float(clip),
        "epsilon": float(eps),
    }
    return Actor(spec, obs_dim, int(policy.action_space.n))


class CoTrainer:
    """Co-adaptive PPO training of the two policies on one backend (replay or live)."""

    def __init__(
        self,
        backend: Backend,
        ppo: PPOConfig,
        env_config: EnvConfig,
        baseline: Callable[[], Controller],
        evaluate: Callable[[Controller], float] | None,
        *,
        max_depth: int,
        device_feats: np.ndarray,
        loads=None,
        seed: int = 0,
        device: str = "cpu",
        tensorboard_dir: str | None = None,
        eval_every: int = 10_000,
        writer: SummaryWriter | None = None,
        progress: bool = False,
    ):
        self.backend, self.ppo, self.env_config = backend, ppo, env_config
        self.baseline, self.evaluate = baseline, evaluate
        self.max_depth, self.device_feats = max_depth, np.asarray(device_feats, np.float32)
        self.loads = loads
        """``engine.costs.features.DeviceAtLoad`` of the deployment profile (load-aware training), or None."""
        self.seed, self.device, self.tb_dir = seed, device, tensorboard_dir
        self.eval_every, self.writer, self.progress = eval_every, writer, progress
        self.models: dict[str, PPO] = {}
        self.obs_rms: dict = {}
        """name -> running observation statistics (VecNormalize's), kept across rounds and checkpoints."""
        self.rho = float(env_config.rho) if env_config.rho else reference_rho(backend)
        self.rho_floor = self.rho
        """The baseline's throughput: rho never drops below it (see ``_on_rollout_end``)."""
        self.total_steps = 0
        self.best: tuple[float, Actor | None, Actor | None] = (-np.inf, None, None)
        self.history: list[PhaseLog] = []
        self.imitation: dict[str, dict[str, float]] = {}
        """name -> how well the imitation fitted the teacher (``imitation.fit``: agreement, losses)."""

    # ------------------------------------------------------------------------------------- controllers
    def actor(self, name: str) -> Actor | None:
        if name not in self.models:
            return None
        return actor_from_model(self.models[name], self.obs_rms[name])

    def controller(self, depth: Actor | None, size: Actor | None) -> LearnedController:
        """Both decisions from the given actors, a fresh baseline for any that is missing."""
        return LearnedController(
            depth,
            size,
            size_ladder=self.env_config.size_ladder,
            tree_width=self.backend.width,
            max_depth=self.max_depth,
            device_feats=self.device_feats,
            fallback=None if depth is not None and size is not None else self.baseline(),
            depth_zero=self.env_config.depth_zero,
            loads=self.loads,
        )

    # ----------------------------------------------------------------------------------------- phases
    def _make_venv(self, name: str, other_factory: Callable[[], Controller]) -> VecNormalize:
        env_cls = SizeEnv if name == "size" else DepthEnv
        config = EnvConfig(
            reward=self.env_config.reward,
            rho=self.rho,
            rho_update=0.0,
            size_ladder=self.env_config.size_ladder,
            depth_zero=self.env_config.depth_zero,
        )
        fns = [lambda: env_cls(self.backend, other_factory(), config) for _ in range(self.ppo.n_envs)]
        venv = DummyVecEnv(fns)
        venv.seed(self.seed + (0 if name == "size" else 1000) + 10 * len(self.history))
        norm = VecNormalize(venv, norm_obs=True, norm_reward=False, clip_obs=CLIP_OBS, epsilon=OBS_EPS)
        if name in self.obs_rms:  # keep the running observation statistics across rounds
            norm.obs_rms = self.obs_rms[name]
        self.obs_rms[name] = norm.obs_rms
        return norm

    def _new_model(self, name: str, venv: VecNormalize) -> PPO:
        ppo = self.ppo
        arch = [int(x) for x in ppo.net_arch.split(",") if x.strip()]
        activation = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU}[ppo.activation]
        lr = ppo.learning_rate
        schedule = (lambda progress: lr * (0.1 + 0.9 * progress)) if ppo.lr_decay else lr
        return PPO(
            "MlpPolicy",
            venv,
            learning_rate=schedule,
            n_steps=ppo.n_steps,
            batch_size=ppo.batch_size,
            n_epochs=ppo.n_epochs,
            gamma=ppo.gamma_size if name == "size" else ppo.gamma_depth,
            gae_lambda=ppo.gae_lambda,
            clip_range=ppo.clip_range,
            ent_coef=ppo.ent_coef,
            policy_kwargs={"net_arch": {"pi": arch, "vf": arch}, "activation_fn": activation},
            tensorboard_log=self.tb_dir,
            seed=self.seed + (0 if name == "size" else 1),
            device=self.device,
            verbose=0,
        )

    def run_phase(self, name: str, steps: int, round_index: int) -> PhaseLog:
        """Train policy ``name`` ("size" or "depth") for ``steps`` env steps against the other's current actor."""
        other_name = "depth" if name == "size" else "size"
        other = self.actor(other_name)

        def other_factory() -> Controller:
            if other is None:
                return self.baseline()
            return self.controller(other, None) if other_name == "depth" else self.controller(None, other)

        venv = self._make_venv(name, other_factory)
        try:
            venv.reset()
        except NoDecisionError:
            # the other policy leaves nothing to decide (a depth policy that never drafts asks no size
            # question): this phase trains nothing, the current actor is kept
            print(
                f"round {round_index + 1} {name}: skipped, the {other_name} policy leaves no {name} decision "
                "in any episode",
                flush=True,
            )
            log = PhaseLog(name, round_index, 0, 0.0)
            self.history.append(log)
            return log
        if name in self.models:
            model = self.models[name]
            model.set_env(venv)
        else:
            model = self.models[name] = self._new_model(name, venv)
        log = PhaseLog(name, round_index, steps, 0.0)
        callback = _TrainCallback(self, name, other_name, log)
        start = time.perf_counter()
        try:
            model.learn(
                total_timesteps=steps,
                callback=callback,
                tb_log_name=name,
                reset_num_timesteps=False,
                progress_bar=self.progress,
            )
        except NoDecisionError:
            # an environment's next reset found no decision in any episode (the episodes draw their load, and
            # the other policy may leave this one nothing to decide at the loads drawn): the phase ends here,
            # as the one whose first reset finds none is skipped above
            print(f"round {round_index + 1} {name}: ended early, no {name} decision left to make", flush=True)
        log.seconds = time.perf_counter() - start
        callback.validate()  # the end of every phase is a candidate too
        self.history.append(log)
        return log

    def imitate(self, make_teacher: Callable[[CostProfile], Controller], round_index: int = 0) -> PhaseLog:
        """Fit both policies (actor and critic) to the teacher (``make_teacher(profile)``: a controller for one
        episode's cost profile; ``policies.imitation``), ``ppo.imitation_steps`` decisions each, then
        validate the imitated pair: the first export candidate. Logged as phase "imitation"."""
        start = time.perf_counter()
        log = PhaseLog("imitation", round_index, 0, 0.0)
        for name in ("size", "depth"):
            venv = self._make_venv(name, self.baseline)
            model = self.models[name] = self._new_model(name, venv)
            gamma = self.ppo.gamma_size if name == "size" else self.ppo.gamma_depth
            config = EnvConfig(
                reward=self.env_config.reward,
                rho=self.rho,
                size_ladder=self.env_config.size_ladder,
                depth_zero=self.env_config.depth_zero,
            )
            seed = self.seed + 7919 + (0 if name == "size" else 1)
            data = imitation.collect(
                self.backend, name, make_teacher, config, self.ppo.imitation_steps, gamma, seed
            )
            fitted = imitation.fit(
                model,
                self.obs_rms[name],
                data,
                epochs=self.ppo.imitation_epochs,
                batch_size=self.ppo.batch_size,
                learning_rate=IMITATION_LR,
                seed=seed,
                clip=CLIP_OBS,
                epsilon=OBS_EPS,
            )
            log.steps += len(data.actions)
            self.imitation[name] = fitted
            if self.writer is not None:
                self.writer.add_scalar(f"imitation/{name}_agreement", fitted["agreement"], 0)
        if self.evaluate is not None:
            depth, size = self.actor("depth"), self.actor("size")
            tps = float(self.evaluate(self.controller(depth, size)))
            log.validation.append((self.total_steps, tps))
            if self.writer is not None:
                self.writer.add_scalar("eval/validation_tokens_per_s", tps, self.total_steps)
            if tps > self.best[0]:
                self.best = (tps, depth, size)
        log.seconds = time.perf_counter() - start
        self.history.append(log)
        return log

    def joint(self) -> LearnedController:
        return self.controller(self.actor("depth"), self.actor("size"))

    # ------------------------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path) -> None:
        """Models, observation statistics and trainer state (written at every phase boundary), then the
        manifest naming them with their sha256 (last, atomically: it is what makes the new files current).
        Files of earlier saves are removed after it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tag = f"{len(self.history)}-{secrets.token_hex(4)}"
        written: dict[str, Path] = {}
        for name, model in self.models.items():
            with atomic_path(directory / f"{name}.{tag}.zip") as tmp:
                model.save(tmp)
            written[f"{name}.zip"] = directory / f"{name}.{tag}.zip"
        best_tps, best_depth, best_size = self.best
        state = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "rho": float(self.rho),
            "total_steps": int(self.total_steps),
            "best_tps": float(best_tps),
            "best_depth": best_depth.to_spec() if best_depth else None,
            "best_size": best_size.to_spec() if best_size else None,
            "obs_rms": {
                n: {
                    "mean": torch.as_tensor(np.asarray(r.mean, np.float64)),
                    "var": torch.as_tensor(np.asarray(r.var, np.float64)),
                    "count": float(r.count),
                }
                for n, r in self.obs_rms.items()
            },
            "history": [
                {
                    "policy": h.policy,
                    "round": int(h.round),
                    "steps": int(h.steps),
                    "seconds": float(h.seconds),
                    "validation": [[int(s), float(v)] for s, v in h.validation],
                }
                for h in self.history
            ],
        }
        with atomic_path(directory / f"trainer.{tag}.pt") as tmp:
            torch.save(state, tmp)
        written["trainer.pt"] = directory / f"trainer.{tag}.pt"
        files = {role: {"file": path.name, "sha256": sha256_file(path)} for role, path in written.items()}
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "phases": len(self.history),
            "files": files,
        }
        manifest["hmac"] = user_hmac(_manifest_bytes(manifest))  # only this user's runs can sign it
        atomic_write_json(directory / MANIFEST, manifest)
        current = {entry["file"] for entry in files.values()}
        for path in directory.iterdir():
            if path.name not in current and (_is_checkpoint_file(path.name) or path.name == "trainer.pt.tmp"):
                path.unlink(missing_ok=True)

    def load(self, directory: str | Path) -> None:
        """Continue from ``save``: the next phase starts where the checkpoint's last phase ended. Every file is
        checked against the manifest first (``verify_checkpoint``); the trainer state is read with
        ``weights_only=True``; the SB3 zips are then unpickled by ``PPO.load`` (trusted-only: see the module
        docstring). Raises ``CheckpointError``."""
        directory = Path(directory)
        files = verify_checkpoint(directory)
        if files is None:
            raise CheckpointError(f"no checkpoint in {directory} (no {MANIFEST})")
        state = read_trainer_state(files["trainer.pt"])
        for name in ("size", "depth"):
            if f"{name}.zip" in files:
                self.models[name] = PPO.load(files[f"{name}.zip"], device=self.device)
        for name, stats in state["obs_rms"].items():
            rms = RunningMeanStd(shape=tuple(stats["mean"].shape))
            rms.mean, rms.var = (
                stats["mean"].numpy().astype(np.float64),
                stats["var"].numpy().astype(np.float64),
            )
            rms.count = float(stats["count"])
            self.obs_rms[name] = rms
        self.rho, self.total_steps = float(state["rho"]), int(state["total_steps"])
        obs_dims = {"depth": DEPTH_OBS_DIM, "size": SIZE_OBS_DIM}
        ladder = len(self.env_config.size_ladder)
        actors = [
            Actor(state[k], obs_dims[n], 2 if n == "depth" else ladder) if state[k] else None
            for k, n in (("best_depth", "depth"), ("best_size", "size"))
        ]
        self.best = (float(state["best_tps"]), *actors)
        self.history = [
            PhaseLog(
                h["policy"],
                int(h["round"]),
                int(h["steps"]),
                float(h["seconds"]),
                [(int(s), float(v)) for s, v in h["validation"]],
            )
            for h in state["history"]
        ]


def _is_checkpoint_file(name: str) -> bool:
    """A file ``save`` writes (any generation), or one an older version wrote (``trainer.pt``, ``size.zip``, ...)."""
    if name in CHECKPOINT_ENTRIES:
        return True
    stem, _, ext = name.rpartition(".")
    return any(
        stem.startswith(role.rpartition(".")[0] + ".") and ext == role.rpartition(".")[2]
        for role in CHECKPOINT_ENTRIES
    )


def has_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` holds anything of a checkpoint (a manifest or checkpoint files; temporary files
    of an interrupted write do not count)."""
    directory = Path(directory)
    return directory.is_dir() and any(
        p.name == MANIFEST or _is_checkpoint_file(p.name) for p in directory.iterdir()
    )


def verify_checkpoint(directory: str | Path) -> dict[str, Path] | None:
    """The checkpoint's files by role (``trainer.pt``, ``size.zip``, ``depth.zip``) after checking each one's
    sha256 against ``manifest.json``; None when ``directory`` holds no checkpoint at all. Raises
    ``CheckpointError`` (naming the file) for a missing or unreadable manifest or a file that does not match
    it. Reads no file but the manifest as anything other than bytes."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        if has_checkpoint(directory):
            raise CheckpointError(
                f"{directory} has no {MANIFEST}, so its files cannot be checked and are not loaded "
                "(a checkpoint this code did not write, or an older version's); delete the "
                "directory to train from the start"
            )
        return None
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        ok = data.get("format") == CHECKPOINT_FORMAT and isinstance(data.get("files"), dict)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{manifest} is not a readable checkpoint manifest ({err})") from err
    if not ok or data.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{manifest} is not a draftpilot checkpoint manifest (version {CHECKPOINT_VERSION})"
        )
    signature = data.get("hmac")
    if not isinstance(signature, str) or not hmac.compare_digest(signature, user_hmac(_manifest_bytes(data))):
        raise CheckpointError(
            f"{manifest} is not signed with this user's key ({user_key_path()}): written by another user or "
            "machine, or edited; its files are not unpickled"
        )
    files: dict[str, Path] = {}
    for role, entry in data["files"].items():
        name = entry.get("file") if isinstance(entry, dict) else None
        if (
            role not in CHECKPOINT_ENTRIES
            or not isinstance(name, str)
            or Path(name).name != name
            or name.startswith(".")
            or not _is_checkpoint_file(name)
        ):
            raise CheckpointError(
                f"{manifest}: entry {role!r} -> {name!r} is not a checkpoint file of this directory"
            )
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: {manifest} lists it")
        if sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(
                f"{path} does not match its sha256 in {manifest}: modified or not written by this "
                "run; refusing to load it"
            )
        files[role] = path
    if "trainer.pt" not in files:
        raise CheckpointError(f"{manifest} lists no trainer state")
    return files


def _manifest_bytes(manifest: dict) -> bytes:
    """The signed part of a manifest (everything but its signature), canonically encoded."""
    return json.dumps({k: v for k, v in manifest.items() if k != "hmac"}, sort_keys=True).encode()


def read_trainer_state(path: str | Path) -> dict:
    """The trainer state ``CoTrainer.save`` wrote, read with ``weights_only=True`` (tensors and plain types
    only: anything else is refused unexecuted)."""
    path = Path(path)
    try:
        state = load_plain(path)
    except ValueError as err:
        raise CheckpointError(f"{path} is not a plain trainer state, refusing to load it: {err}") from err
    keys = ("rho", "total_steps", "best_tps", "best_depth", "best_size", "obs_rms", "history")
    if (
        not isinstance(state, dict)
        or state.get("format") != CHECKPOINT_FORMAT
        or state.get("version") != CHECKPOINT_VERSION
        or any(k not in state for k in keys)
    ):
        raise CheckpointError(f"{path} is not a draftpilot trainer state (version {CHECKPOINT_VERSION})")
    return state


class _TrainCallback(BaseCallback):
    """rho update, charts, action histograms and validation (SB3 callback: ``_on_step`` and rollout end)."""

    def __init__(self, trainer: CoTrainer, name: str, other_name: str, log: PhaseLog):
        super().__init__()
        self.trainer, self.name, self.other_name, self.log = trainer, name, other_name, log
        self.since_eval = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self.ep_tokens, self.ep_seconds, self.accepted, self.actions = 0, 0.0, [], []

    def _on_step(self) -> bool:
        self.trainer.total_steps += self.training_env.num_envs
        self.since_eval += self.training_env.num_envs
        self.actions.extend(np.asarray(self.locals["actions"]).ravel().tolist())
        for info, done in zip(self.locals["infos"], self.locals["dones"]):
            if "accepted" in info:
                self.accepted.append(info["accepted"])
            if done and "episode_tokens" in info:
                self.ep_tokens += info["episode_tokens"]
                self.ep_seconds += info["episode_s"]
        if self.trainer.evaluate is not None and self.since_eval >= self.trainer.eval_every:
            self.since_eval = 0
            self.validate()
        return True

    def _on_rollout_end(self) -> None:
        trainer = self.trainer
        if self.ep_seconds > 0:
            tps = self.ep_tokens / self.ep_seconds
            self.logger.record("charts/episode_tokens_per_s", tps)
            # rho estimates the best achievable throughput (the average reward's fixed point). The rollout's
            # own throughput comes from the exploring stochastic policy and is well below that; a low rho
            # makes time look cheap and teaches over-long drafts and over-large verifications, so rho never
            # drops below what the baseline controller already achieves.
            target = max(tps, trainer.rho_floor)
            trainer.rho += trainer.ppo.rho_smoothing * (target - trainer.rho)
            self.training_env.env_method("set_rho", trainer.rho)
        self.logger.record("charts/rho", trainer.rho)
        if self.accepted:
            self.logger.record("charts/mean_accepted", float(np.mean(self.accepted)))
        if self.actions:
            self.logger.record(
                f"actions/{self.name}",
                torch.as_tensor(self.actions, dtype=torch.float32),
                exclude=("stdout", "log", "json", "csv"),
            )
            self.logger.record(f"actions/{self.name}_mean", float(np.mean(self.actions)))
        rewards = self.model.rollout_buffer.rewards
        self.logger.record("charts/mean_reward", float(np.mean(rewards)))
        self._reset_window()

    def validate(self) -> float | None:
        trainer = self.trainer
        if trainer.evaluate is None:
            return None
        current = trainer.actor(self.name)
        other = trainer.actor(self.other_name)
        depth, size = (other, current) if self.name == "size" else (current, other)
        tps = float(trainer.evaluate(trainer.controller(depth, size)))
        self.logger.record("eval/validation_tokens_per_s", tps)
        if trainer.writer is not None:
            trainer.writer.add_scalar("eval/validation_tokens_per_s", tps, trainer.total_steps)
            trainer.writer.add_scalar(
                f"eval/validation_tokens_per_s_{self.name}_phase", tps, trainer.total_steps
            )
        self.log.validation.append((trainer.total_steps, tps))
        # only complete controllers (both policies learned) are export candidates
        if depth is not None and size is not None and tps > trainer.best[0]:
            trainer.best = (tps, depth, size)
        return tps
