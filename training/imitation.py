"""Imitation before PPO (training only, like ``training.ppo``): fit the depth and size actors to a teacher
controller's decisions, so PPO starts from known-good behaviour instead of a random policy.

Why: on an AMD EPYC profile, PPO from a random start with the best static setting as the first phase's other
decision stayed at the static setting's behaviour for all six phases (validation within 0.2% of it) while
the analytic controller, shipped in the same repository, ran 4% faster (docs/training.md, "Imitation
start"). A policy fitted to the analytic controller first starts at that level; PPO then only has to find
where the cost model is wrong, and the imitated pair is itself an export candidate.

The data come from the training environments themselves (``envs.environments.DepthEnv`` / ``SizeEnv`` on the
training backend), with the teacher answering both the environment's question and the other decision, so
the observations, the randomised device of each episode (its cost profile and device features) and the
rewards are exactly what PPO will see. The teacher is built per episode for that episode's cost profile
(``FollowingTeacher``). The critic is fitted too, on the teacher's discounted returns, so PPO's first
advantages are measured against the teacher's value rather than a random network's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.running_mean_std import RunningMeanStd

from engine.control import Controller, DraftState, decision, verify_size
from engine.costs.cost_profile import CostProfile
from engine.results import CycleRecord
from envs.backends import Backend
from envs.environments import DepthEnv, EnvConfig, SizeEnv


class FollowingTeacher(Controller):
    """A teacher controller made for the cost profile of the episode its environment is in: a new one
    (``make(profile)``) whenever the environment draws another profile (randomised devices), else the same
    one, reset at every episode as any controller is."""

    decides_depth_zero = True
    decides_lookup = (
        True  # asked only where the environment's episodes gate lookup (``EnvConfig.lookup_gate``)
    )

    def __init__(self, make: Callable[[CostProfile], Controller], tree_width: int):
        self.make, self.tree_width = make, int(tree_width)
        self.env: DepthEnv | SizeEnv | None = None
        self._profile: object = None
        self._inner: Controller | None = None

    def _teacher(self) -> Controller:
        profile = self.env.profile if self.env is not None else None
        if self._inner is None or profile is not self._profile:
            self._inner, self._profile = self.make(profile), profile
            if self._inner.tree_width != self.tree_width:
                raise ValueError(f"teacher tree_width {self._inner.tree_width} != {self.tree_width}")
        return self._inner

    def reset(self) -> None:
        self._teacher().reset()

    def should_continue(self, state: DraftState) -> bool:
        teacher = self._teacher()
        if state.depth == 0 and not teacher.decides_depth_zero:
            return True
        return decision(teacher.should_continue(state), teacher)

    def num_to_verify(self, state: DraftState) -> int:
        teacher = self._teacher()
        return verify_size(teacher.num_to_verify(state), teacher)

    def use_lookup(self, state: DraftState) -> bool:
        teacher = self._teacher()
        return decision(teacher.use_lookup(state), teacher, "use_lookup")

    def observe(self, record: CycleRecord) -> None:
        self._teacher().observe(record)


@dataclass
class ImitationData:
    """One policy's teacher decisions: raw observations [N, obs_dim], actions [N], discounted returns [N]."""

    obs: np.ndarray
    actions: np.ndarray
    returns: np.ndarray


def ladder_index(size: int, ladder: tuple[int, ...]) -> int:
    """The size action that verifies ``size`` nodes: the first ladder entry >= size (the environment caps a
    ladder size by the nodes drafted, and the teacher's sizes are ladder sizes or that count)."""
    return int(min(np.searchsorted(np.asarray(ladder), size), len(ladder) - 1))


def collect(
    backend: Backend,
    name: str,
    make_teacher: Callable[[CostProfile], Controller],
    config: EnvConfig,
    steps: int,
    gamma: float,
    seed: int,
) -> ImitationData:
    """At least ``steps`` decisions of policy ``name`` ("depth" or "size") taken by the teacher on the
    backend's episodes (whole episodes: the last one runs to its end, so every return is complete)."""
    teacher = FollowingTeacher(make_teacher, backend.width)
    env = (SizeEnv if name == "size" else DepthEnv)(backend, teacher, config)
    teacher.env = env
    obs_list, actions, rewards, ends = [], [], [], []
    obs, _ = env.reset(seed=seed)
    while True:
        state = env.decision_state
        if env.decision_kind == "use_lookup":
            action = int(teacher.use_lookup(state))
        elif name == "depth":
            action = int(teacher.should_continue(state))
        else:
            action = ladder_index(teacher.num_to_verify(state), config.size_ladder)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        obs_list.append(obs)
        actions.append(action)
        rewards.append(reward)
        ends.append(terminated or truncated)
        if terminated or truncated:
            if len(actions) >= steps:
                break
            next_obs, _ = env.reset()
        obs = next_obs
    env.close()
    returns = np.zeros(len(rewards))
    running = 0.0
    for i in range(len(rewards) - 1, -1, -1):
        running = rewards[i] + (0.0 if ends[i] else gamma * running)
        returns[i] = running
    return ImitationData(np.asarray(obs_list, np.float32), np.asarray(actions, np.int64), returns)


def normalise(obs: np.ndarray, rms: RunningMeanStd, clip: float, epsilon: float) -> np.ndarray:
    """VecNormalize's observation transform."""
    return np.clip((obs - rms.mean) / np.sqrt(rms.var + epsilon), -clip, clip).astype(np.float32)


def fit(
    model: PPO,
    rms: RunningMeanStd,
    data: ImitationData,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    clip: float,
    epsilon: float,
) -> dict[str, float]:
    """Fit ``model``'s actor (cross-entropy) and critic (squared error on the returns) to the teacher's data;
    the observation statistics ``rms`` (the ones VecNormalize will keep updating during PPO) are first
    updated with the data. Returns the actor's agreement with the teacher on the data and the final losses."""
    rms.update(data.obs.astype(np.float64))
    device = model.policy.device
    x = torch.as_tensor(normalise(data.obs, rms, clip, epsilon), device=device)
    a = torch.as_tensor(data.actions, device=device)
    ret = torch.as_tensor(data.returns, dtype=torch.float32, device=device)
    policy = model.policy
    policy.set_training_mode(True)
    optimiser = torch.optim.Adam(policy.parameters(), lr=learning_rate)
    gen = torch.Generator().manual_seed(seed)
    n = len(a)
    actor_loss = critic_loss = float("nan")
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen).to(device)
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            values, log_prob, _ = policy.evaluate_actions(x[idx], a[idx])
            actor = -log_prob.mean()
            critic = torch.nn.functional.mse_loss(values.flatten(), ret[idx])
            optimiser.zero_grad()
            (actor + 0.5 * critic).backward()
            optimiser.step()
            actor_loss, critic_loss = actor.item(), critic.item()
    policy.set_training_mode(False)
    with torch.no_grad():
        predicted = policy.get_distribution(x).distribution.probs.argmax(-1)
    return {
        "agreement": float((predicted == a).float().mean()),
        "actor_loss": actor_loss,
        "critic_loss": critic_loss,
        "decisions": float(n),
    }
