"""PPO wiring (stable-baselines3) for the depth and size policies: training code only, never imported on
the inference path (``policies.learned`` is what the engine loads).

``CoTrainer`` runs LTD's co-adaptive schedule: the size policy first (depth from a baseline controller),
then the depth policy (size from the trained size policy), alternating for ``rounds``. Each phase is an
SB3 ``PPO.learn`` on vectorised replay (or live) environments whose *other* decision is a
``LearnedController`` built from the other policy's current actor. A callback moves the average reward's
rho toward the policy's throughput after every rollout, logs charts to TensorBoard and validates the joint
controller (both current actors) on held-out traces, keeping the best by validation throughput. ``PPOConfig``, the
callback and the actor export are in ``training.ppo_config``, the checkpoint files' checks in
``training.ppo_checkpoint``.

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

import dataclasses
import functools
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.running_mean_std import RunningMeanStd
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from engine.backends.files import (
    atomic_path,
    atomic_write_json,
    sha256_file,
    user_hmac,
)
from engine.control import Controller
from engine.costs.cost_profile import CostProfile
from engine.costs.observation import DEPTH_OBS_DIM, SIZE_OBS_DIM
from envs.backends import Backend
from envs.environments import DepthEnv, EnvConfig, NoDecisionError, SizeEnv, reference_rho
from policies.learned_controller import Actor, LearnedController
from training import imitation
from training.ppo_checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    MANIFEST,
    CheckpointError,
    is_checkpoint_file,
    manifest_bytes,
    read_trainer_state,
    verify_checkpoint,
)
from training.ppo_config import CLIP_OBS, OBS_EPS, PhaseLog, PPOConfig, TrainCallback, actor_from_model
from training.vec_workers import PooledVecEnv, WorkerPool, default_workers

if TYPE_CHECKING:  # tensorboard is imported where a run writes its logs
    from torch.utils.tensorboard import SummaryWriter

IMITATION_LR = 1e-3
"""Adam's learning rate for the imitation fit, whatever PPO's (a supervised fit: fixed, not PPO's schedule;
fitted with PPO's 3e-4, the depth actor agreed with the teacher on 94.8% of its decisions instead of 96.5%
and validated 2% lower, docs/training.md "Imitation start")."""


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
        score_name: str = "tokens_per_s",
    ):
        self.backend, self.ppo, self.env_config = backend, ppo, env_config
        self.score_name = score_name
        """What ``evaluate`` returns, as TensorBoard names it (``eval/validation_<score_name>``): "tokens_per_s"
        (replay throughput) or "load_score" (load-aware runs: the mean over the load levels of system tokens/s
        over autoregressive decoding's, a ratio)."""
        self.baseline, self.evaluate = baseline, evaluate
        self.max_depth, self.device_feats = max_depth, np.asarray(device_feats, np.float32)
        self.loads = loads
        """``engine.costs.observation.DeviceAtLoad`` of the deployment profile (load-aware training), or None."""
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
        workers = ppo.workers or default_workers()
        self.workers = min(workers, ppo.n_envs) if getattr(backend, "kind", None) == "replay" else 1
        """Processes the phases' environments step in (``training.vec_workers``; 1: this one)."""
        self._pool: WorkerPool | None = None

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
            lookup_gate=self.env_config.lookup_gate,
        )

    # ----------------------------------------------------------------------------------------- phases
    def _make_venv(self, name: str, other_factory: Callable[[], Controller]) -> VecNormalize:
        env_cls = SizeEnv if name == "size" else DepthEnv
        config = dataclasses.replace(self.env_config, rho=self.rho, rho_update=0.0)
        # each environment gets its own controller for the other decision, made here (a worker gets it pickled)
        fns = [
            functools.partial(_make_env, env_cls, self.backend, other_factory(), config)
            for _ in range(self.ppo.n_envs)
        ]
        if self.workers > 1:
            venv = PooledVecEnv(self._worker_pool(), fns)
        else:
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
        callback = TrainCallback(self, name, other_name, log)
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
        episode's cost profile; ``training.imitation``), ``ppo.imitation_steps`` decisions each, then
        validate the imitated pair: the first export candidate. Logged as phase "imitation"."""
        start = time.perf_counter()
        log = PhaseLog("imitation", round_index, 0, 0.0)
        config = dataclasses.replace(self.env_config, rho=self.rho)
        calls = [
            (
                self.backend,
                name,
                make_teacher,
                config,
                self.ppo.imitation_steps,
                self.ppo.gamma_size if name == "size" else self.ppo.gamma_depth,
                self.seed + 7919 + (0 if name == "size" else 1),
            )
            for name in ("size", "depth")
        ]
        if self.workers > 1:  # the two policies' decisions collected at once, one per worker
            collected = self._worker_pool().map(imitation.collect, calls)
        else:
            collected = [imitation.collect(*call) for call in calls]
        for name, data, call in zip(("size", "depth"), collected, calls):
            venv = self._make_venv(name, self.baseline)
            model = self.models[name] = self._new_model(name, venv)
            fitted = imitation.fit(
                model,
                self.obs_rms[name],
                data,
                epochs=self.ppo.imitation_epochs,
                batch_size=self.ppo.batch_size,
                learning_rate=IMITATION_LR,
                seed=call[-1],
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
                self.writer.add_scalar(f"eval/validation_{self.score_name}", tps, self.total_steps)
            if tps > self.best[0]:
                self.best = (tps, depth, size)
        log.seconds = time.perf_counter() - start
        self.history.append(log)
        return log

    def size_phases_idle(self, tolerance: float = 1e-3) -> bool:
        """Whether the last size phase that trained (the history's) left the best validation score where it
        found it (within ``tolerance``, relative): then a later size phase is not worth its time (train.py
        skips it, ``TrainConfig.skip_idle_size``). False before any size phase trained."""
        best_before, idle = -np.inf, False
        for log in self.history:
            scores = [v for _, v in log.validation]
            if log.policy == "size" and log.steps > 0:
                idle = not scores or max(scores) <= best_before * (1 + tolerance)
            if scores:
                best_before = max(best_before, *scores)
        return idle

    def skip_phase(self, name: str, round_index: int) -> PhaseLog:
        """Record phase ``name`` of round ``round_index`` as skipped (no steps), so that a resumed run counts it."""
        log = PhaseLog(name, round_index, 0, 0.0)
        self.history.append(log)
        return log

    def _worker_pool(self) -> WorkerPool:
        """The run's worker processes, started on first use."""
        if self._pool is None:
            self._pool = WorkerPool(self.workers)
        return self._pool

    def close(self) -> None:
        """Stops the environment workers (if any); the trainer can still save, export and validate."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

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
        manifest["hmac"] = user_hmac(manifest_bytes(manifest))  # only this user's runs can sign it
        atomic_write_json(directory / MANIFEST, manifest)
        current = {entry["file"] for entry in files.values()}
        for path in directory.iterdir():
            if path.name not in current and (is_checkpoint_file(path.name) or path.name == "trainer.pt.tmp"):
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


def _make_env(env_cls, backend: Backend, other: Controller, config: EnvConfig):
    """One training environment (a module-level function, so that a worker process can be sent it)."""
    return env_cls(backend, other, config)
