"""StaticController: argument validation, the two decisions, and what the engine does with them."""

from __future__ import annotations

import numpy as np
import pytest

from engine.control import Controller, DraftState, StaticController
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig

pytestmark = pytest.mark.usefixtures("single_thread")


def state(depth: int) -> DraftState:
    return DraftState(
        depth=depth,
        frontier_scores=np.zeros(1),
        step_probs=np.ones(1),
        node_scores=np.zeros(depth),
        context_len=10,
        max_depth=32,
        history=[],
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"depth": -1},
        {"depth": 1.5},
        {"depth": True},
        {"depth": "4"},
        {"tree_width": 0},
        {"tree_width": 2.0},
        {"tree_width": False},
        {"verify": -1},
        {"verify": 1.5},
        {"verify": True},
    ],
)
def test_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        StaticController(**kwargs)


def test_defaults_and_edges():
    ctrl = StaticController()
    assert isinstance(ctrl, Controller)
    assert (ctrl.depth, ctrl.verify, ctrl.tree_width) == (4, 4, 1)
    assert StaticController(depth=7).verify == 7  # verify defaults to depth
    assert StaticController(depth=3, verify=0).verify == 0  # verify=0 is allowed (draft, verify nothing)
    assert repr(StaticController(2, 5, 3)) == "StaticController(depth=2, verify=5, tree_width=3)"


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_should_continue_stops_at_depth(depth):
    ctrl = StaticController(depth=depth, verify=2)
    assert [ctrl.should_continue(state(d)) for d in range(1, depth + 3)] == [
        d < depth for d in range(1, depth + 3)
    ]
    assert all(ctrl.num_to_verify(state(d)) == 2 for d in range(1, depth + 1))
    ctrl.reset()  # the protocol's optional hooks exist and are no-ops
    ctrl.observe(None)
    assert ctrl.should_continue(state(1)) == (depth > 1)


@pytest.mark.parametrize(
    "depth, verify, tree_width", [(1, None, 1), (3, None, 1), (5, 2, 1), (3, 9, 3), (4, 100, 2)]
)
def test_engine_drafts_exactly_depth_and_verifies_min_of_verify_and_nodes(
    tiny_pair, prompts, depth, verify, tree_width
):
    ctrl = StaticController(depth, verify, tree_width)
    res = SpeculativeEngine(tiny_pair).generate(prompts[0], 30, ctrl)
    for cycle in res.cycles:
        remaining = 30 - (cycle.context_len - res.prompt_len)
        cap = min(depth, remaining - 1)
        if cap < 1:  # the budget's last token is an autoregressive step
            assert cycle.depth == 0 and cycle.num_drafted == 0
            continue
        assert cycle.depth == cap
        # a level adds tree_width children per frontier node, the frontier keeps the tree_width best
        assert cycle.num_drafted == tree_width + (cap - 1) * tree_width**2
        assert cycle.num_verified == min(ctrl.verify, cycle.num_drafted)


def test_depth_zero_is_autoregressive_decoding_through_the_loop(tiny_pair):
    """StaticController(0) never drafts: every cycle is a depth-0 step, tokens equal autoregressive
    decoding, and the controller is asked at depth 0 (and told every cycle)."""
    engine = SpeculativeEngine(tiny_pair)
    ids = tiny_pair.encode("def main():")
    ar = engine.generate(ids, max_new_tokens=16)
    off = engine.generate(ids, max_new_tokens=16, controller=StaticController(0))
    assert off.tokens == ar.tokens
    assert all(c.depth == 0 and c.num_drafted == 0 and c.emitted == 1 for c in off.cycles)
    assert StaticController(0).should_continue(state(0)) is False
    assert StaticController(2).should_continue(state(0)) is True


class Alternating(StaticController):
    """Drafts (depth 2) every other cycle, switches speculation off in between."""

    def reset(self):
        self.n = 0

    def should_continue(self, st):
        if st.depth == 0:
            self.n += 1
            return self.n % 2 == 0
        return super().should_continue(st)


def test_mixed_depth_zero_cycles_stay_exact_and_the_draft_catches_up(tiny_pair):
    engine = SpeculativeEngine(tiny_pair, config=EngineConfig(validate_caches=True))
    ids = tiny_pair.encode("The quick brown fox")
    ar = engine.generate(ids, max_new_tokens=24)
    mixed = engine.generate(ids, max_new_tokens=24, controller=Alternating(2, 2))
    assert mixed.tokens == ar.tokens
    depths = [c.depth for c in mixed.cycles]
    assert 0 in depths and 2 in depths


def test_depth_zero_not_asked_of_controllers_that_do_not_decide_it(tiny_pair):
    asked = []

    class Recorder(Controller):
        def should_continue(self, st):
            asked.append(st.depth)
            return st.depth < 2

        def num_to_verify(self, st):
            return 2

    engine = SpeculativeEngine(tiny_pair)
    engine.generate(tiny_pair.encode("x"), max_new_tokens=8, controller=Recorder())
    assert asked and min(asked) == 1
