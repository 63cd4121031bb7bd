"""Randomised cost profiles (``envs.profiles``): what a perturbation changes, the rescaling to the reference,
and environments that give every episode its own profile and device features."""

from __future__ import annotations

import numpy as np
import pytest

from engine.control import StaticController
from engine.costs.observation import (
    NUM_DEVICE_FEATURES,
    NUM_LOAD_FEATURES,
    NUM_REQUEST_FEATURES,
    device_features,
)
from envs.backends import ReplayBackend
from envs.environments import DepthEnv, EnvConfig
from envs.profiles import REFERENCE_CONTEXT, PerturbedProfile, ProfileMix
from envs.replay import ReplayTrace
from tests_envs_helpers import LinearProfile, make_synthetic_trace


def test_a_perturbation_scales_exactly_the_part_it_names():
    base = LinearProfile()
    same = PerturbedProfile(base)
    for k in (0, 1, 4, 16):
        assert same.verify_s(k, 300) == pytest.approx(base.verify_s(k, 300))
        assert same.overhead_s(k, 2, 1) == pytest.approx(base.overhead_s(k, 2, 1))
    assert same.draft_step_s(2, 300) == pytest.approx(base.draft_step_s(2, 300))
    steep = PerturbedProfile(base, slope=2.0)
    assert steep.verify_s(0, 300) == pytest.approx(base.verify_s(0, 300))  # an autoregressive step: unchanged
    assert steep.verify_s(8, 300) - steep.verify_s(0, 300) == pytest.approx(
        2 * (base.verify_s(8, 300) - base.verify_s(0, 300))
    )
    dear = PerturbedProfile(base, draft=3.0, overhead=0.5, scale=2.0)
    assert dear.draft_chunk_s(3, 300) == pytest.approx(6 * base.draft_chunk_s(3, 300))
    assert dear.draft_chunk_curve(5, 300) == pytest.approx(
        [6 * base.draft_chunk_s(q, 300) for q in range(1, 6)]
    )
    assert dear.overhead_s(4) == pytest.approx(base.overhead_s(4))  # 2 * 0.5
    assert dear.verify_s(4, 300) == pytest.approx(2 * base.verify_s(4, 300))


def test_the_mix_rescales_to_the_reference_and_perturbs_within_bounds():
    reference = LinearProfile(c=0.040)
    mix = ProfileMix([LinearProfile(c=0.2, d=0.01), LinearProfile(c=0.01)], reference, perturbation=0.5)
    for member in mix.members():
        assert member.verify_s(1, REFERENCE_CONTEXT) == pytest.approx(
            reference.verify_s(1, REFERENCE_CONTEXT)
        )
    rng = np.random.default_rng(0)
    draws = [mix.sample(rng) for _ in range(200)]
    factors = np.asarray([[d.draft, d.slope, d.overhead] for d in draws])
    assert factors.min() >= 1 / 1.5 - 1e-12 and factors.max() <= 1.5 + 1e-12
    assert factors.std(axis=0).min() > 0.1  # each factor really varies
    assert {id(d.base) for d in draws} == {id(p) for p in mix.profiles}  # both profiles drawn
    feats = {tuple(np.round(device_features(d, 1), 4)) for d in draws}
    assert len(feats) > 100  # the policy sees a spread of devices
    assert ProfileMix([reference], reference).sample(rng).draft == 1.0  # no perturbation: as measured
    with pytest.raises(ValueError, match="perturbation"):
        ProfileMix([reference], reference, perturbation=-1)


def test_an_environment_over_a_mix_gives_every_episode_its_profile_and_features():
    traces = [ReplayTrace(make_synthetic_trace(s, width=1)) for s in range(3)]
    reference = LinearProfile()
    mix = ProfileMix([reference, LinearProfile(a=0.04, d=0.02)], reference, perturbation=1.0)

    class SeesDevice(StaticController):
        device_feats = np.zeros(NUM_DEVICE_FEATURES, np.float32)

    other = SeesDevice(2, 2, tree_width=1)
    env = DepthEnv(ReplayBackend(traces, reference, profiles=mix), other, EnvConfig(rho=10.0))
    seen = []
    for seed in range(6):
        obs, _ = env.reset(seed=seed)
        assert env.profile is not reference
        np.testing.assert_array_equal(env.device, device_features(env.profile, 1))
        np.testing.assert_array_equal(other.device_feats, env.device)  # the other decision sees it too
        tail = NUM_LOAD_FEATURES + NUM_REQUEST_FEATURES  # the load and the request's features close it
        device = obs[-(NUM_DEVICE_FEATURES + tail) : -tail]
        np.testing.assert_allclose(device, np.clip(env.device, 0, 64), rtol=1e-6)
        seen.append(tuple(env.device))
        done = False
        while not done:  # the episode is charged with its own profile
            obs, reward, done, _, info = env.step(1)
            if "cycle_s" in info and info["depth"] > 0:
                assert info["cycle_s"] > 0
    assert len(set(seen)) == 6
    plain = DepthEnv(ReplayBackend(traces, reference), other, EnvConfig(rho=10.0))
    plain.reset(seed=0)
    assert plain.profile is reference  # no mix: the backend's profile, as before
