"""The evaluation's DecisionLoggingController asks the wrapped policy what the engine would ask it, depth 0
included, and logs it."""

from __future__ import annotations

import math

from engine.backends.models import load_pair
from engine.control import DraftState, StaticController
from engine.engine import SpeculativeEngine
from evaluation.measurements import DecisionLoggingController


class _SkipEveryOther(StaticController):
    """Drafts (depth 2, verify 2) on every second cycle only."""

    decides_depth_zero = True

    def __init__(self):
        super().__init__(2, 2)
        self.asked = 0

    def should_continue(self, state: DraftState) -> bool:
        if state.depth == 0:
            self.asked += 1
            return self.asked % 2 == 0
        return super().should_continue(state)


def test_decision_logging_passes_depth_zero_through():
    inner = _SkipEveryOther()
    wrapped = DecisionLoggingController(inner)
    assert wrapped.decides_depth_zero
    pair = load_pair("tiny", device="cpu")
    engine = SpeculativeEngine(pair)
    ids = pair.encode("def f(x):")
    ar = engine.generate(ids, max_new_tokens=20)
    got = engine.generate(ids, max_new_tokens=20, controller=wrapped)
    assert got.tokens == ar.tokens
    zero = [row for row in wrapped.depth_log if row[1] == 0]
    assert zero and inner.asked == len(zero)
    assert all(math.isnan(row[2]) and math.isnan(row[3]) for row in zero)
    assert {row[4] for row in zero} == {0, 1}  # skipped some cycles, drafted others
