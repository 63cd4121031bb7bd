"""Training environments stepped in worker processes (training.vec_workers): the same episodes, observations,
rewards and episode ends as in one process, errors raised again in the parent, env methods reaching every
environment."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from stable_baselines3.common.vec_env import DummyVecEnv

from engine.control import StaticController
from envs.environments import DepthEnv, EnvConfig, NoDecisionError, SizeEnv
from envs.profiles import ProfileMix
from envs.replay import ReplayTrace
from envs.server import ServerReplayBackend
from tests_envs_helpers import make_synthetic_trace
from tests_helpers import batched_profile
from training.ppo import _make_env
from training.vec_workers import PooledVecEnv, WorkerPool

N_ENVS = 4


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2) as workers:
        yield workers


@pytest.fixture(scope="module")
def backend():
    traces = [ReplayTrace(make_synthetic_trace(seed, length=40, width=1, max_depth=4)) for seed in range(4)]
    profile = batched_profile(row_s=0.03)
    return ServerReplayBackend(
        traces,
        profile,
        lambda n: lambda: StaticController(1, 1),
        concurrencies=(1, 2, 4),
        profiles=ProfileMix([profile], reference=profile, perturbation=1.0),  # a profile drawn per episode
    )


def _fns(backend, env_cls=DepthEnv, other=None):
    other = other or StaticController(2, 2)
    config = EnvConfig(rho=20.0, depth_zero=True)
    return [functools.partial(_make_env, env_cls, backend, other, config) for _ in range(N_ENVS)]


def _rollout(venv, seed: int, steps: int = 120):
    venv.seed(seed)
    out = [venv.reset().copy()]
    actions = np.random.default_rng(0)
    for _ in range(steps):
        obs, rewards, dones, infos = venv.step(actions.integers(0, 2, size=N_ENVS))
        ends = [info.get("episode_tokens") for info in infos]
        out += [obs.copy(), rewards.copy(), dones.copy(), ends]
    venv.close()
    return out


def _same(a, b) -> bool:
    return all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b, strict=True)
    )


def test_workers_step_the_same_episodes_as_one_process(pool, backend):
    alone = _rollout(DummyVecEnv(_fns(backend)), seed=5)
    pooled = _rollout(PooledVecEnv(pool, _fns(backend)), seed=5)
    assert sum(d.sum() for d in alone[3::4]) >= N_ENVS  # episodes ended (and auto-reset) along the way
    assert _same(alone, pooled)
    other_seed = _rollout(PooledVecEnv(pool, _fns(backend)), seed=6)  # negative control: seeds matter
    assert not _same(alone, other_seed)


def test_env_methods_reach_every_environment_and_errors_come_back(pool, backend):
    venv = PooledVecEnv(pool, _fns(backend))
    venv.env_method("set_rho", 33.0)
    assert venv.get_attr("rho") == [33.0] * N_ENVS
    venv.set_attr("rho", 7.0, indices=[1, 3])
    assert venv.get_attr("rho") == [33.0, 7.0, 33.0, 7.0]
    venv.close()
    # a size environment whose depth controller never drafts has nothing to decide: the worker's error is the
    # parent's, as it is in one process
    never = PooledVecEnv(pool, _fns(backend, SizeEnv, StaticController(0, 0)))
    with pytest.raises(NoDecisionError):
        never.reset()
    with pytest.raises(NoDecisionError):
        DummyVecEnv(_fns(backend, SizeEnv, StaticController(0, 0))).reset()
    never.close()
    venv = PooledVecEnv(pool, _fns(backend))  # the pool still serves
    assert venv.reset().shape[0] == N_ENVS
    venv.close()
