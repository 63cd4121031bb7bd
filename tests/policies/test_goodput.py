"""GoodputController: its draft length follows the request's own acceptance and the load, and it stays exact."""

from __future__ import annotations

import numpy as np
import pytest

from engine.control import Controller, DraftState
from engine.load import LoadState
from engine.results import CycleRecord
from policies.goodput import GoodputController
from tests_helpers import assert_greedy_identity, batched_profile


def depth0(history, load: LoadState | None = None, max_depth: int = 8) -> DraftState:
    return DraftState.before_drafting(100, max_depth, history, load=load)


def draft_cycles(accepted: int, verified: int, n: int = 10) -> list[CycleRecord]:
    return [CycleRecord(100, verified, verified, verified, accepted, accepted + 1) for _ in range(n)]


def lookup_cycles(accepted: int, proposed: int, n: int = 10) -> list[CycleRecord]:
    return [CycleRecord(100, 0, proposed, proposed, accepted, accepted + 1, lookup=True) for _ in range(n)]


BUSY = LoadState(requests=8, other_rows=28, other_drafting=0)
"""Eight requests in the step, the seven others verifying three drafted rows each, none drafting."""


def length(history, load=None, **kw) -> int:
    return GoodputController(batched_profile(), **kw).length(depth0(history, load))


def test_is_a_depth_zero_deciding_chain_controller():
    ctrl = GoodputController(batched_profile())
    assert isinstance(ctrl, Controller) and ctrl.decides_depth_zero and ctrl.tree_width == 1
    with pytest.raises(ValueError):
        GoodputController(None)


def test_high_acceptance_drafts_low_acceptance_does_not():
    assert length(draft_cycles(4, 4)) >= 3
    assert length(draft_cycles(0, 2)) == 0
    # the length rises with the acceptance
    lengths = [length(draft_cycles(a, 4)) for a in range(5)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] > lengths[0]


def test_more_load_drafts_shorter():
    for a in range(5):
        history = draft_cycles(a, 4)
        assert length(history, BUSY) <= length(history)
    # somewhere the load makes the difference
    assert any(length(draft_cycles(a, 4), BUSY) < length(draft_cycles(a, 4)) for a in range(5))


def test_estimates_are_moving_averages_with_a_prior():
    ctrl = GoodputController(batched_profile(), prior=0.6, prior_weight=2.0, decay=0.8)
    assert ctrl.draft_alpha() == pytest.approx(0.6) and ctrl.lookup_alpha() == pytest.approx(0.6)
    ctrl.absorb(draft_cycles(0, 3, n=30))
    assert ctrl.draft_alpha() < 0.2  # the prior keeps a weight of 2 trials against ~5 decayed ones
    ctrl.absorb(draft_cycles(0, 3, n=30) + draft_cycles(3, 3, n=30))  # recent cycles weigh most
    assert ctrl.draft_alpha() > 0.8
    assert ctrl.lookup_alpha() == pytest.approx(0.6)  # lookup cycles have their own estimate


def test_lookup_acceptance_is_the_draft_prior_until_the_draft_runs():
    grounded = lookup_cycles(4, 4)
    ctrl = GoodputController(batched_profile(), prior=0.3)
    ctrl.absorb(grounded)
    assert ctrl.lookup_alpha() > 0.8 and ctrl.draft_alpha() == pytest.approx(ctrl.lookup_alpha())
    assert length(grounded, prior=0.3) > length([], prior=0.3)
    ctrl.absorb(grounded + draft_cycles(0, 3, n=20))  # the draft's own evidence takes over
    assert ctrl.draft_alpha() < 0.3


def test_probes_after_a_run_of_autoregressive_steps():
    ctrl = GoodputController(batched_profile(), probe_every=4)
    history = draft_cycles(0, 2)
    decisions = []
    for _ in range(8):
        decisions.append(ctrl.should_continue(depth0(history)))
        history = history + [CycleRecord(100, 0, 0, 0, 0, 1)]
    assert decisions == [False, False, False, True] * 2


def test_verifies_the_whole_chain_it_drafts():
    ctrl = GoodputController(batched_profile())
    history = draft_cycles(4, 4)
    assert ctrl.should_continue(depth0(history))
    n = ctrl._length

    def at(d: int) -> DraftState:
        return DraftState(d, np.zeros(1), np.ones(1), np.zeros(d), 100, 8, history)

    assert [ctrl.should_continue(at(d)) for d in range(1, 9)] == [d < n for d in range(1, 9)]
    assert ctrl.num_to_verify(at(n)) == n


def test_greedy_identity_through_the_engine(tiny_pair):
    profile = batched_profile()
    assert_greedy_identity(
        tiny_pair,
        ["Hello there, tell me a story.", "def f(x): return x + 1\ndef g(x): return f(x)\n"],
        [
            GoodputController(profile),
            GoodputController(profile, prior=0.95),
            GoodputController(profile, prior=0.0),
        ],
    )


def lookup_state(history, proposed: int, load: LoadState | None = None) -> DraftState:
    return DraftState.before_drafting(100, 8, history, load=load, lookup_proposed=proposed)


def test_decides_lookup_by_each_requests_own_lookup_acceptance():
    """Asked about a lookup proposal (``use_lookup``), it takes it where the request's lookup proposals have
    been accepted (a request copying its input) and declines it, under load, where they missed while its draft
    was accepted; with the gate off it is not asked (the engine's rule decides)."""
    copying = lookup_cycles(4, 4) + draft_cycles(1, 3, n=3)
    missing = lookup_cycles(0, 4) + draft_cycles(3, 3)
    assert GoodputController(batched_profile()).decides_lookup
    assert not GoodputController(batched_profile(), gate_lookup=False).decides_lookup
    for load in (None, BUSY):
        assert GoodputController(batched_profile()).use_lookup(lookup_state(copying, 4, load))
    assert not GoodputController(batched_profile()).use_lookup(lookup_state(missing, 2, BUSY))


def test_probes_lookup_after_a_run_of_declined_proposals():
    ctrl = GoodputController(batched_profile(), probe_every=4)
    history = lookup_cycles(0, 4) + draft_cycles(3, 3)
    answers = [ctrl.use_lookup(lookup_state(history, 2, BUSY)) for _ in range(8)]
    assert answers == [False, False, False, True] * 2


def test_greedy_identity_with_lookup_decided_per_request(tiny_pair):
    from engine.inputs import EngineConfig
    from engine.lookup import LookupConfig

    profile = batched_profile()
    assert_greedy_identity(
        tiny_pair,
        ["a b a b a b a b a b a b", "def f(x): return x + 1\ndef g(x): return f(x)\n"],
        [GoodputController(profile), GoodputController(profile, prior=0.0)],
        config=EngineConfig(lookup=LookupConfig(1, 2, 3, 0, 0)),
    )
