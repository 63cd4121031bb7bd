"""Replay semantics against a plain reference, the oracle bound, and the gymnasium environments."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import envs  # noqa: F401 - registers the environment ids
from engine.control import StaticController
from engine.costs.speedup_model import SIZE_LADDER
from engine.lookup import LookupConfig
from engine.sampling import verify_tree
from engine.tree import DraftTree
from envs import environments
from envs.backends import ReplayBackend
from envs.environments import EnvConfig, WrongBackendError
from envs.oracle import OracleController, oracle_plan, oracle_throughput, static_grid
from envs.replay import ReplayTrace, replay_generate, throughput
from policies.analytic import AnalyticController
from policies.heuristic import ConfidenceController, HeuristicController
from tests_envs_helpers import make_synthetic_trace


def reference_accepted(rt: ReplayTrace, t: int, depth: int, num_verify: int) -> int:
    """Plain reference: rebuild the engine's DraftTree from the trace, select the top-V nodes of depth
    <= D with the engine's own DraftTree.select, and walk it with the engine's verify_tree, drawing the
    trajectory's tokens in order (as the live engine would in greedy mode)."""
    tokens, parents, depths, scores = rt.trace.nodes(t)
    keep = [i for i in range(len(tokens)) if depths[i] <= depth]
    tree = DraftTree()
    remap = {-1: -1}
    for i in keep:
        remap[i] = tree.add(int(tokens[i]), remap[int(parents[i])], float(scores[i]))
    selected = tree.select(num_verify)
    local = {node: j for j, node in enumerate(selected)}
    sel_parents = [local.get(tree.parents[n], -1) for n in selected]
    future = rt.trace.tokens[t + 1 :].tolist() + [-1] * (depth + 2)  # -1: past the end, matches nothing
    path, _ = verify_tree([tree.tokens[n] for n in selected], sel_parents, lambda row: future.pop(0))
    return len(path)


@pytest.mark.parametrize("width", [1, 2, 3])
def test_replay_accepted_matches_reference(width):
    rt = ReplayTrace(make_synthetic_trace(seed=width, length=40, width=width, max_depth=5))
    checked = nonzero = 0
    for t in range(len(rt.trace.tokens) - 1):
        for depth in range(1, 6):
            for size in (1, 2, 3, 4, 6, 8, 64):
                got = rt.accepted(t, depth, size)
                assert got == reference_accepted(rt, t, depth, size), (t, depth, size)
                checked += 1
                nonzero += got > 0
    assert checked > 1000 and nonzero > checked // 4


def test_replay_generate_commits_the_whole_trajectory(linear_profile):
    rt = ReplayTrace(make_synthetic_trace(seed=7, length=50, width=2))
    for ctrl in (StaticController(3, 4, tree_width=2), StaticController(6, 64, tree_width=2), None):
        recs = replay_generate(rt, ctrl, linear_profile)
        assert sum(r.emitted for r in recs) == len(rt.trace.tokens) - 1
        assert all(
            r.accepted <= r.num_verified <= r.num_drafted and r.emitted <= r.accepted + 1 for r in recs
        )
        assert all(r.total_s > 0 for r in recs)
    with pytest.raises(ValueError, match="tree_width"):
        replay_generate(rt, StaticController(3, 4, tree_width=1), linear_profile)


def test_budget_cap_as_in_engine(linear_profile):
    # the trajectory was cut by the budget: the last cycles must not draft past it
    rt = ReplayTrace(make_synthetic_trace(seed=3, length=30, width=1, max_depth=6, follow=1.0))
    recs = replay_generate(rt, StaticController(6, 6), linear_profile)
    position = 0
    for rec in recs:
        remaining = rt.max_new_tokens - (position + 1)
        assert rec.depth <= max(remaining - 1, 0)
        position += rec.emitted


def test_oracle_bounds_every_static_setting(linear_profile):
    traces = [ReplayTrace(make_synthetic_trace(seed, length=40, width=2, max_depth=5)) for seed in range(3)]
    grid = static_grid(traces, linear_profile, depths=range(1, 6))
    oracle = oracle_throughput(traces, linear_profile)
    assert oracle >= max(grid.values()) - 1e-9
    for ctrl in (AnalyticController(linear_profile, tree_width=2),):
        assert oracle >= throughput([replay_generate(rt, ctrl, linear_profile) for rt in traces]) - 1e-9
    for rt in traces:  # the plan is playable: the oracle controller realises exactly the DP's time
        plan = oracle_plan(rt, linear_profile)
        recs = replay_generate(rt, OracleController(rt, plan), linear_profile)
        assert sum(r.total_s for r in recs) == pytest.approx(plan.total_s, rel=1e-12)


@pytest.mark.parametrize("width", [1, 2])
def test_oracle_bounds_every_controller_with_context_lookup(linear_profile, width):
    """With the engine's context lookup, lookup cycles are forced moves for every controller; the oracle
    plans around them and still bounds autoregressive decoding, every static setting and the analytic
    controller replayed with the same lookup (a small vocabulary makes the lookup propose often)."""
    lookup = LookupConfig(min_ngram=2, max_ngram=3, max_tokens=3)
    traces = [
        ReplayTrace(make_synthetic_trace(seed, length=60, width=width, max_depth=5, vocab=6))
        for seed in range(3)
    ]
    lookup_cycles = sum(r.lookup for rt in traces for r in replay_generate(rt, None, lookup=lookup))
    assert lookup_cycles >= 10
    oracle = oracle_throughput(traces, linear_profile, lookup=lookup)
    rows = list(static_grid(traces, linear_profile, depths=range(1, 6), lookup=lookup).values())
    for ctrl in (None, AnalyticController(linear_profile, tree_width=width)):
        rows.append(throughput([replay_generate(rt, ctrl, linear_profile, lookup=lookup) for rt in traces]))
    assert oracle >= max(rows) - 1e-9
    for rt in traces:  # the plan is playable around the lookup cycles it is not shown
        plan = oracle_plan(rt, linear_profile, lookup=lookup)
        recs = replay_generate(rt, OracleController(rt, plan), linear_profile, lookup=lookup)
        assert any(r.lookup for r in recs) and any(r.depth > 0 for r in recs)
        assert sum(r.total_s for r in recs) == pytest.approx(plan.total_s, rel=1e-12)
    # negative control: the plan made without the lookup does not realise its time once the lookup is on
    plans = [oracle_plan(rt, linear_profile) for rt in traces]
    played = [
        sum(r.total_s for r in replay_generate(rt, OracleController(rt, plan), linear_profile, lookup=lookup))
        for rt, plan in zip(traces, plans)
    ]
    assert any(abs(t - plan.total_s) > 1e-6 * plan.total_s for t, plan in zip(played, plans))


def _backend(linear_profile, width=2):
    return ReplayBackend(
        [ReplayTrace(make_synthetic_trace(s, length=40, width=width)) for s in range(3)], linear_profile
    )


@pytest.mark.parametrize(
    "env_id,kw",
    [("draftpilot/ReplayDepth-v0", "size_controller"), ("draftpilot/ReplaySize-v0", "depth_controller")],
)
@pytest.mark.parametrize("reward", ["average", "throughput"])
def test_env_checkers_pass_without_warnings(linear_profile, env_id, kw, reward):
    other = StaticController(4, 8, tree_width=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(
            env_id, backend=_backend(linear_profile), config=EnvConfig(reward=reward), **{kw: other}
        )
        check_env(env.unwrapped)
        sb3_check_env(env.unwrapped)
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize(
    "env_id, entry_point, kind",
    [
        ("draftpilot/ReplayDepth-v0", "envs.environments:DepthEnv", "replay"),
        ("draftpilot/ReplaySize-v0", "envs.environments:SizeEnv", "replay"),
        ("draftpilot/LiveDepth-v0", "envs.environments:DepthEnv", "live"),
        ("draftpilot/LiveSize-v0", "envs.environments:SizeEnv", "live"),
    ],
)
def test_every_id_names_its_backend(env_id, entry_point, kind):
    spec = gym.spec(env_id)
    assert (spec.entry_point, spec.kwargs) == (entry_point, {"backend_kind": kind})


@pytest.mark.parametrize(
    "env_id, kw",
    [("draftpilot/LiveDepth-v0", "size_controller"), ("draftpilot/LiveSize-v0", "depth_controller")],
)
def test_a_live_id_refuses_the_replay_backend(linear_profile, env_id, kw):
    replay_id = env_id.replace("Live", "Replay")
    with pytest.raises(
        WrongBackendError, match=rf"{env_id} runs on a live backend, got a ReplayBackend.*make {replay_id}"
    ):
        gym.make(env_id, backend=_backend(linear_profile), **{kw: StaticController(4, 8, tree_width=2)})
    # the same backend, built directly without an id, is accepted
    env_class = getattr(environments, gym.spec(env_id).entry_point.split(":")[1])
    assert env_class(_backend(linear_profile), StaticController(4, 8, tree_width=2)).width == 2


def _rollout(env, seed, actions):
    obs, _ = env.reset(seed=seed)
    out = [obs]
    for a in actions:
        obs, reward, term, _, info = env.step(a)
        out.append((obs, reward, term))
        if term:
            break
    return out


def test_seeded_reset_is_reproducible(linear_profile):
    env = gym.make(
        "draftpilot/ReplaySize-v0",
        backend=_backend(linear_profile, width=1),
        depth_controller=HeuristicController(3, 6),
    )
    env2 = gym.make(
        "draftpilot/ReplaySize-v0",
        backend=_backend(linear_profile, width=1),
        depth_controller=HeuristicController(3, 6),
    )
    actions = np.random.default_rng(0).integers(len(SIZE_LADDER), size=30).tolist()
    a, b = _rollout(env.unwrapped, 5, actions), _rollout(env2.unwrapped, 5, actions)
    assert np.array_equal(a[0], b[0])
    for x, y in zip(a[1:], b[1:]):
        assert np.array_equal(x[0], y[0]) and x[1] == y[1] and x[2] == y[2]


def test_average_reward_sums_to_tokens_minus_rho_time(linear_profile):
    env = gym.make(
        "draftpilot/ReplayDepth-v0",
        backend=_backend(linear_profile),
        size_controller=StaticController(6, 8, tree_width=2),
        config=EnvConfig(rho=20.0),
    ).unwrapped
    env.reset(seed=1)
    total, rng, term = 0.0, np.random.default_rng(1), False
    while not term:
        _, reward, term, _, info = env.step(int(rng.integers(2)))
        total += reward
    expected = info["episode_tokens"] - 20.0 * info["episode_s"]
    assert total == pytest.approx(expected, abs=1e-9)
    assert info["episode_tokens"] == len(env.backend.traces[env.episode_index].trace.tokens) - 1


def test_bad_inputs(linear_profile):
    with pytest.raises(ValueError, match="no traces"):
        ReplayBackend([], linear_profile)
    with pytest.raises(ValueError, match="tree width"):
        ReplayBackend(
            [ReplayTrace(make_synthetic_trace(0, width=1)), ReplayTrace(make_synthetic_trace(1, width=2))],
            linear_profile,
        )
    with pytest.raises(ValueError, match="tree_width"):
        gym.make(
            "draftpilot/ReplayDepth-v0", backend=_backend(linear_profile), size_controller=StaticController(4)
        )
    with pytest.raises(ValueError, match="reward"):
        EnvConfig(reward="tokens")
    env = gym.make(
        "draftpilot/ReplaySize-v0",
        backend=_backend(linear_profile),
        depth_controller=StaticController(4, 8, tree_width=2),
    ).unwrapped
    with pytest.raises(RuntimeError, match="reset"):
        env.step(0)


def test_depth_zero_decisions_in_the_depth_env(linear_profile):
    """With ``depth_zero`` the depth agent is asked before the first draft step; "stop" there is a
    depth-0 (autoregressive) cycle. Always stopping at depth 0 decodes the trace autoregressively, and
    the average reward still sums to tokens - rho * time."""
    env = gym.make(
        "draftpilot/ReplayDepth-v0",
        backend=_backend(linear_profile),
        size_controller=StaticController(6, 8, tree_width=2),
        config=EnvConfig(rho=20.0, depth_zero=True),
    ).unwrapped
    obs, _ = env.reset(seed=3)
    assert env._state.depth == 0 and obs.shape == env.observation_space.shape
    total, term, depths = 0.0, False, []
    while not term:
        _, reward, term, _, info = env.step(0)
        total += reward
        if "depth" in info:
            depths.append(info["depth"])
    assert set(depths) == {0}
    assert info["episode_tokens"] == len(env.backend.traces[env.episode_index].trace.tokens) - 1
    assert total == pytest.approx(info["episode_tokens"] - 20.0 * info["episode_s"], abs=1e-9)
    check_env(env)


def test_depth_zero_in_the_size_env_asks_only_controllers_that_decide_it(linear_profile):
    """The size env forwards depth-0 questions to its depth controller only if that controller decides
    depth 0 (StaticController(0) then never drafts: no size decision is ever asked); others always draft."""
    backend = _backend(linear_profile)
    env = gym.make(
        "draftpilot/ReplaySize-v0",
        backend=backend,
        depth_controller=StaticController(0, tree_width=2),
        config=EnvConfig(depth_zero=True),
    ).unwrapped
    with pytest.raises(ValueError, match="no episode of this backend has a size decision"):
        env.reset(seed=0)  # every episode runs to its end without drafting, so without a size decision
    confidence = ConfidenceController(0.0, max_depth=3, tree_width=2)  # never decides depth 0
    assert not confidence.decides_depth_zero
    env = gym.make(
        "draftpilot/ReplaySize-v0",
        backend=backend,
        depth_controller=confidence,
        config=EnvConfig(depth_zero=True),
    ).unwrapped
    env.reset(seed=0)
    assert env._state.depth == 3
