"""The article's speedup model (docs/design.md section 6.1): expected tokens per cycle, speedup, best gamma;
and the model over a drafted tree the analytic controller and the features share."""

import numpy as np
import pytest

from engine.costs.speedup_model import (
    MEASURED_SIZES,
    SIZE_LADDER,
    best_gamma,
    cycle_cost_s,
    expected_accepted,
    expected_tokens,
    expected_tokens_general,
    next_level_probs,
    speedup,
    verify_curve,
)


def test_expected_tokens_article_value():
    assert expected_tokens(0.7, 6) == pytest.approx(3.058819, abs=1e-6)


def test_speedup_article_values():
    assert speedup(0.7, 6, 0.05) == pytest.approx(2.353, abs=1e-3)
    assert best_gamma(0.7, 0.05) == 6
    assert best_gamma(0.7, 0.20) == 3
    assert speedup(0.7, 3, 0.20) == pytest.approx(1.583, abs=1e-3)
    assert speedup(0.7, 6, 0.05, g=3.0) == pytest.approx(0.927, abs=1e-3)
    assert speedup(0.7, 6, 0.05, g=lambda gamma: 3.0) == pytest.approx(0.927, abs=1e-3)


def test_general_form_matches_constant_alpha_and_edges():
    assert expected_tokens_general([0.7] * 6) == pytest.approx(expected_tokens(0.7, 6), abs=1e-12)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens_general([0.9, 0.5, 0.0, 1.0]) == pytest.approx(1 + 0.9 + 0.45, abs=1e-12)
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError):
        expected_tokens(0.5, -1)


def test_tree_model_expected_tokens_and_next_level():
    probs = np.array([0.9, 0.5, 0.2])
    assert expected_accepted(probs, np.array([1, 2, 8])).tolist() == pytest.approx([0.9, 1.4, 1.6])
    assert expected_accepted(np.zeros(0), np.array([1, 4])).tolist() == [0.0, 0.0]
    # two children of the 0.2 frontier node: the best shares the last step's 0.5, its sibling gets 0.5 * 0.5
    nxt = next_level_probs(probs, np.array([0.2]), np.array([0.3, 0.5]), tree_width=2)
    assert nxt.tolist() == pytest.approx([0.9, 0.5, 0.2, 0.1, 0.05])


def test_tree_model_costs():
    class Linear:  # draft step 0.1 s a node of width, verification 1 + 0.05 s a node, overhead 0.01 s
        def draft_step_s(self, width, ctx):
            return 0.1 * width

        def verify_s(self, nodes, ctx, chain=False):
            return 1.0 + 0.05 * nodes

        def overhead_s(self, nodes, depth=1, tree_width=1):
            return 0.01 if depth > 0 else 0.002

    assert cycle_cost_s(Linear(), 3, [1, 4], 100, tree_width=2).tolist() == pytest.approx([1.66, 1.81])
    assert cycle_cost_s(Linear(), 0, [0], 100).tolist() == pytest.approx([1.002])
    known = np.array([0.8, 1.0, 1.1, 1.3, 2.0, 5.0])  # at 0, 1, 2, 4, 16, 64 nodes
    assert verify_curve(known, np.array([0.0, 3.0, 40.0, 112.0])).tolist() == pytest.approx(
        [0.8, 1.2, 3.5, 8.0]
    )
    assert MEASURED_SIZES == (0, *SIZE_LADDER)
