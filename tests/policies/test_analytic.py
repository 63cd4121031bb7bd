"""AnalyticController's depth-0 decision: speculate only when the recent acceptance says it pays."""

from __future__ import annotations

import numpy as np

from engine.control import DraftState
from engine.results import CycleRecord
from policies.analytic import AnalyticController


class FlatProfile:
    """Target step 1 s whatever the rows; draft step ``c`` s; no overhead."""

    def __init__(self, c: float):
        self.c = c

    def draft_step_s(self, width, ctx):
        return self.c

    def verify_s(self, nodes, ctx, chain=False):
        return 1.0

    def overhead_s(self, nodes, depth=1, tree_width=1):
        return 0.0


def depth0(history) -> DraftState:
    empty = np.zeros(0, np.float32)
    return DraftState(
        depth=0,
        frontier_scores=empty,
        step_probs=empty,
        node_scores=empty,
        context_len=100,
        max_depth=8,
        history=history,
    )


def cycles(accepted: int, verified: int, n: int = 10) -> list[CycleRecord]:
    return [CycleRecord(100, verified, verified, verified, accepted, accepted + 1) for _ in range(n)]


def test_depth_zero_follows_the_cost_model():
    cheap, dear = AnalyticController(FlatProfile(0.05)), AnalyticController(FlatProfile(0.9))
    assert cheap.decides_depth_zero
    assert cheap.should_continue(depth0([]))  # no evidence yet: draft
    good, bad = cycles(3, 3), cycles(0, 2)
    assert cheap.should_continue(depth0(good))
    # alpha = 0: one token per cycle at cost 1 + d * c > 1: autoregressive decoding is faster
    assert not cheap.should_continue(depth0(bad))
    # alpha ~ 0.5 with a draft step at 0.9 of a target step: E(0.5, 1) = 1.5 tokens for 1.9 s < 1 token/s
    assert not dear.should_continue(depth0(cycles(1, 2)))
    assert cheap.should_continue(depth0(cycles(1, 2)))


def test_depth_zero_probes_again_after_a_run_of_autoregressive_steps():
    ctrl = AnalyticController(FlatProfile(0.05), probe_every=4)
    off = [CycleRecord(100, 0, 0, 0, 0, 1) for _ in range(3)]
    assert not ctrl.should_continue(depth0(cycles(0, 2) + off))
    assert ctrl.should_continue(depth0(cycles(0, 2) + off + off[:1]))  # 4 in a row: probe
