"""Context lookup decided per request and per cycle (``Controller.decides_lookup``): the request's own signals in
the observation, the depth environment asking its agent, the replay's questions, and the policy file's flag."""

from __future__ import annotations

import numpy as np
import pytest

from engine.control import DraftState, StaticController
from engine.costs.observation import (
    DEPTH_OBS_DIM,
    MAX_PROPOSAL,
    NUM_REQUEST_FEATURES,
    depth_observation,
    request_features,
)
from engine.lookup import LookupConfig
from engine.results import CycleRecord
from envs.backends import ReplayBackend
from envs.environments import DepthEnv, EnvConfig
from envs.replay import ReplayTrace, replay_generate, throughput
from tests_envs_helpers import make_synthetic_trace
from tests_helpers import lookup_chooser

LOOKUP = LookupConfig(min_ngram=2, max_ngram=3, max_tokens=3)


@pytest.fixture
def traces():
    """Synthetic traces of a small vocabulary: the lookup proposes often (and misses often)."""
    return [ReplayTrace(make_synthetic_trace(s, length=60, width=1, max_depth=5, vocab=6)) for s in range(3)]


def test_request_features_are_the_requests_own_acceptance_and_the_proposal():
    history = [
        CycleRecord(100, 0, 4, 4, 4, 5, lookup=True),
        CycleRecord(105, 0, 2, 2, 0, 1, lookup=True),
        CycleRecord(106, 3, 3, 3, 1, 2),
        CycleRecord(108, 0, 0, 0, 0, 1),
    ]
    state = DraftState.before_drafting(110, 8, history, lookup_proposed=4)
    feats = request_features(state)
    assert len(feats) == NUM_REQUEST_FEATURES
    assert feats == pytest.approx([4 / MAX_PROPOSAL, 4 / 6, 1 / 3, 2 / 16])
    assert not request_features(DraftState.before_drafting(10, 8, [])).any()
    # the proposal's length moves the depth observation (the agent can tell a lookup question)
    plain = depth_observation(DraftState.before_drafting(110, 8, history), np.ones(6, np.float32))
    asked = depth_observation(state, np.ones(6, np.float32))
    assert plain.shape == asked.shape == (DEPTH_OBS_DIM,) and (plain != asked).sum() == 1


def test_declining_every_proposal_is_decoding_without_lookup_and_taking_every_one_is_the_engines_rule(traces):
    """A controller that declines every proposal replays as the same controller without lookup; one that takes
    every proposal as the engine's lookup with no controller asked; between them, taking every other one is a
    third trajectory of cycles. Every replayed request emits the trace's tokens."""
    for rt in traces:
        never = replay_generate(rt, lookup_chooser(2, lambda n: False), lookup=LOOKUP)
        plain = replay_generate(rt, StaticController(2), lookup=None)
        assert [(r.depth, r.accepted, r.emitted) for r in never] == [
            (r.depth, r.accepted, r.emitted) for r in plain
        ]
        always = replay_generate(rt, lookup_chooser(2, lambda n: True), lookup=LOOKUP)
        engine = replay_generate(rt, StaticController(2), lookup=LOOKUP)
        assert [(r.lookup, r.depth, r.emitted) for r in always] == [
            (r.lookup, r.depth, r.emitted) for r in engine
        ]
        half = replay_generate(rt, lookup_chooser(2), lookup=LOOKUP)
        assert any(r.lookup for r in half)
        for recs in (never, always, half):
            assert sum(r.emitted for r in recs) == sum(r.emitted for r in plain)


def test_the_depth_agent_is_asked_about_lookup_with_the_proposal_in_its_observation(traces, linear_profile):
    backend = ReplayBackend(traces, linear_profile, lookup=LOOKUP)
    env = DepthEnv(backend, StaticController(2, 2), EnvConfig(depth_zero=True, lookup_gate=True))
    env.reset(seed=0)
    kinds, taken = [], 0
    for _ in range(400):
        kind, state = env.decision_kind, env.decision_state
        kinds.append(kind)
        if kind == "use_lookup":
            assert state.depth == 0 and state.lookup_proposed > 0
        action = int(kind != "use_lookup" or kinds.count("use_lookup") % 2 == 0)
        taken += kind == "use_lookup" and action == 1
        _, _, terminated, _, _ = env.step(action)
        if terminated:
            env.reset()
    assert kinds.count("use_lookup") >= 20 and kinds.count("depth") >= 20 and taken >= 10
    # the control: without the gate the agent is never asked about lookup (the engine's rule decides)
    plain = DepthEnv(backend, StaticController(2, 2), EnvConfig(depth_zero=True))
    plain.reset(seed=0)
    for _ in range(200):
        assert plain.decision_kind == "depth"
        if plain.step(1)[2]:
            plain.reset()


def test_a_policy_file_carries_its_lookup_gate(tmp_path, traces, linear_profile):
    from policies.learned import load_policy
    from tests_helpers import make_policy

    gated = load_policy(make_policy(tmp_path / "g.pt", tree_width=1, depth_zero=True, lookup_gate=True))
    plain = load_policy(make_policy(tmp_path / "p.pt", tree_width=1, depth_zero=True))
    assert gated.decides_lookup and not plain.decides_lookup
    for policy in (gated, plain):  # replayed with lookup: exact whatever it decides
        recs = [replay_generate(rt, policy, linear_profile, lookup=LOOKUP) for rt in traces]
        assert [sum(r.emitted for r in rs) for rs in recs] == [
            sum(r.emitted for r in replay_generate(rt, None)) for rt in traces
        ]
        assert throughput(recs) > 0
