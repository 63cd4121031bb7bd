"""HeuristicController (+2/-1) and ConfidenceController behaviour, and their use by the engine."""

import numpy as np
import pytest

from engine.control import DraftState
from engine.engine import SpeculativeEngine
from engine.results import CycleRecord
from policies.heuristic import ConfidenceController, HeuristicController


def _state(depth, step_probs, n_nodes=4):
    return DraftState(
        depth=depth,
        frontier_scores=np.zeros(len(step_probs), np.float32),
        step_probs=np.asarray(step_probs, np.float32),
        node_scores=np.zeros(n_nodes, np.float32),
        context_len=10,
        max_depth=32,
        history=(),
    )


def test_heuristic_schedule_plus_two_minus_one():
    ctrl = HeuristicController(initial_depth=5, max_depth=8)
    ctrl.observe(CycleRecord(10, 5, 5, 5, 5, 6))  # all accepted: +2
    assert ctrl.depth == 7
    ctrl.observe(CycleRecord(10, 7, 7, 7, 7, 8))  # capped at max_depth
    assert ctrl.depth == 8
    ctrl.observe(CycleRecord(10, 8, 8, 8, 3, 4))  # a rejection: -1
    assert ctrl.depth == 7
    for _ in range(20):
        ctrl.observe(CycleRecord(10, 1, 1, 1, 0, 1))
    assert ctrl.depth == 1
    assert ctrl.should_continue(_state(1, [0.9])) is False
    ctrl.reset()
    assert (
        ctrl.depth == 5
        and ctrl.should_continue(_state(4, [0.9]))
        and not ctrl.should_continue(_state(5, [0.9]))
    )
    with pytest.raises(ValueError):
        HeuristicController(initial_depth=0)


def test_confidence_stops_below_threshold():
    ctrl = ConfidenceController(threshold=0.5, max_depth=6)
    assert ctrl.should_continue(_state(1, [0.6]))
    assert not ctrl.should_continue(_state(1, [0.4]))
    assert not ctrl.should_continue(_state(6, [0.99]))
    assert ctrl.num_to_verify(_state(3, [0.9], n_nodes=3)) == 3
    with pytest.raises(ValueError):
        ConfidenceController(threshold=1.5)


@pytest.mark.parametrize(
    "ctrl",
    [
        HeuristicController(3, 10),
        ConfidenceController(0.3, 8),
        ConfidenceController(0.2, 5, tree_width=2, max_verify=6),
    ],
)
def test_practitioner_controllers_keep_greedy_output(tiny_pair, ctrl):
    engine = SpeculativeEngine(tiny_pair)
    ar = engine.generate("The quick brown fox", max_new_tokens=40)
    res = engine.generate("The quick brown fox", max_new_tokens=40, controller=ctrl)
    assert res.tokens == ar.tokens
    depths = {c.depth for c in res.cycles}
    assert len(depths) > 1, "an adaptive controller should vary its depth on this prompt"
