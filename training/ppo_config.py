"""PPO's hyperparameters and the pieces of one training phase (training only; stable-baselines3): ``PPOConfig``
(the PPO flags of ``train.py``), ``PhaseLog``, the SB3 callback that moves rho, logs charts and validates the joint
controller (``TrainCallback``), and a trained SB3 model as a torch-only ``Actor`` (``actor_from_model``).
``training.ppo.CoTrainer`` runs the phases."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.running_mean_std import RunningMeanStd
from stable_baselines3.common.torch_layers import FlattenExtractor

from policies.learned_controller import Actor

ACTIVATION_NAMES = {torch.nn.Tanh: "tanh", torch.nn.ReLU: "relu"}
CLIP_OBS, OBS_EPS = 10.0, 1e-8


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
    workers: int = 0
    """Processes that step the replay environments (``training.vec_workers``): 0, one per core; 1, in this
    process. The same episodes, observations and rewards whatever the number (it changes only the speed; a
    live backend always steps in-process)."""

    def __post_init__(self) -> None:
        for name in ("n_envs", "n_steps", "batch_size", "n_epochs", "imitation_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.workers < 0:
            raise ValueError(f"workers (--workers) must be >= 0, got {self.workers}")
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


class TrainCallback(BaseCallback):
    """rho update, charts, action histograms and validation (SB3 callback: ``_on_step`` and rollout end)."""

    def __init__(self, trainer, name: str, other_name: str, log: PhaseLog):
        """``trainer``: the ``training.ppo.CoTrainer`` whose phase ``name`` runs (``other_name``: the other policy)."""
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
        tag = f"eval/validation_{trainer.score_name}"
        self.logger.record(tag, tps)
        if trainer.writer is not None:
            trainer.writer.add_scalar(tag, tps, trainer.total_steps)
            trainer.writer.add_scalar(f"{tag}_{self.name}_phase", tps, trainer.total_steps)
        self.log.validation.append((trainer.total_steps, tps))
        # only complete controllers (both policies learned) are export candidates
        if depth is not None and size is not None and tps > trainer.best[0]:
            trainer.best = (tps, depth, size)
        return tps
