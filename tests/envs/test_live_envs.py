"""The live backend: the same environments driving the real engine (tiny pair) through the bridge."""

from __future__ import annotations

import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import envs  # noqa: F401 - registers the environment ids
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from envs.backends import LiveBackend
from envs.environments import EnvConfig, WrongBackendError
from tests_envs_helpers import LinearProfile


@pytest.fixture(scope="module")
def live_backend_factory(tiny_pair):
    engine = SpeculativeEngine(tiny_pair)
    prompts = [tiny_pair.encode(p, chat=False) for p in ("def main():", "The quick brown fox", "Hello")]

    def make(timing="wall", width=2):
        return LiveBackend(
            engine, prompts, tree_width=width, max_new_tokens=24, profile=LinearProfile(), timing=timing
        )

    return make


@pytest.mark.parametrize(
    "env_id,kw",
    [("draftpilot/LiveDepth-v0", "size_controller"), ("draftpilot/LiveSize-v0", "depth_controller")],
)
def test_live_env_checkers_pass_without_warnings(live_backend_factory, env_id, kw):
    # profile timing makes rewards deterministic, which gymnasium's determinism check requires
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(
            env_id,
            backend=live_backend_factory("profile"),
            config=EnvConfig(rho=10.0),
            **{kw: StaticController(4, 6, tree_width=2)},
        )
        check_env(env.unwrapped)
        sb3_check_env(env.unwrapped)
        env.close()
    assert [str(w.message) for w in caught] == []


def test_live_episode_matches_engine_run(live_backend_factory, tiny_pair):
    """Driving the size decision with a fixed action through the env reproduces a plain engine run with
    the equivalent static controller: same cycles, same tokens (greedy)."""
    backend = live_backend_factory("wall", width=1)
    env = gym.make(
        "draftpilot/LiveSize-v0",
        backend=backend,
        depth_controller=StaticController(3, 3),
        config=EnvConfig(rho=10.0),
    ).unwrapped
    env.reset(seed=0, options={"episode": 1})
    cycles, term = [], False
    while not term:
        _, reward, term, _, info = env.step(2)  # ladder index 2 = verify 3
        if "accepted" in info:
            cycles.append((info["depth"], info["num_verified"], info["accepted"], info["emitted"]))
    assert info["episode_s"] > 0
    direct = SpeculativeEngine(tiny_pair).generate(backend.prompts[1], 24, controller=StaticController(3, 3))
    assert env.last_result.tokens == direct.tokens
    assert cycles[-1] == tuple((c.depth, c.num_verified, c.accepted, c.emitted) for c in direct.cycles)[-1]
    assert [c[2] for c in cycles] == [c.accepted for c in direct.cycles if c.depth > 0]


def test_abandoned_live_episode_releases_the_engine(live_backend_factory):
    env = gym.make(
        "draftpilot/LiveDepth-v0",
        backend=live_backend_factory("wall"),
        size_controller=StaticController(4, 6, tree_width=2),
        config=EnvConfig(rho=10.0),
    ).unwrapped
    env.reset(seed=0)
    env.step(1)
    loop = env._loop
    env.reset(seed=1)  # mid-episode: the previous request's thread must be unwound, not leaked
    assert not loop._thread.is_alive()
    env.step(0)
    loop = env._loop
    env.close()
    assert not loop._thread.is_alive()


def test_a_replay_id_refuses_the_live_backend(live_backend_factory):
    with pytest.raises(WrongBackendError, match=r"ReplaySize-v0 runs on a replay backend, got a LiveBackend"):
        gym.make(
            "draftpilot/ReplaySize-v0",
            backend=live_backend_factory("profile"),
            depth_controller=StaticController(4, 6, tree_width=2),
            config=EnvConfig(rho=10.0),
        )


def test_live_throughput_is_every_token_after_the_first_over_the_decode_time(live_backend_factory):
    """``LiveBackend.throughput_of`` (``envs.replay.throughput`` of the engine's cycles) equals the tokens
    after the first over the summed cycle times of the same requests."""
    backend = live_backend_factory("wall")
    results = []
    generate = backend.engine.generate

    def recording(*args, **kwargs):
        results.append(generate(*args, **kwargs))
        return results[-1]

    backend.engine.generate = recording
    try:
        got = backend.throughput_of(StaticController(3, 4, tree_width=2))
    finally:
        del backend.engine.generate
    tokens = sum(len(r.tokens) - 1 for r in results)
    seconds = sum(c.total_s for r in results for c in r.cycles)
    assert len(results) == len(backend.prompts) and got == pytest.approx(tokens / seconds, rel=1e-12)
