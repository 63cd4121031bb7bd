"""The article's speedup model (docs/design.md section 6.1): expected tokens per cycle, speedup, best gamma."""

import pytest

from engine.costs.speedup_model import best_gamma, expected_tokens, expected_tokens_general, speedup


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
