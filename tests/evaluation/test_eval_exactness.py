"""The exactness audit's own power: the sampled two-sample test passes the engine and flags a broken
sampler; the law checks pass ``verify_chain`` and flag the article's wrong rule; greedy audit bookkeeping."""

from __future__ import annotations

import pytest

import engine.engine
from engine.backends.models import load_pair
from engine.control import StaticController
from envs.prompts import load_suite
from evaluation.exactness import first_divergence, greedy_audit, law_checks, sampled_test

TEMPERATURE = 0.2
"""The tiny pair is nearly uniform at 0.7 (every 3-token outcome unique in 200 draws: no power); at 0.2 its
outcomes concentrate enough for the chi-square cells."""


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts():
    return load_suite(split="test", languages=["it", "en"], limit_per_language=1)


def audit(pair, prompts):
    return sampled_test(
        pair,
        lambda: StaticController(2, 6, tree_width=2),
        prompts,
        temperature=TEMPERATURE,
        samples=100,
        k=3,
        budget=5,
        seed=0,
    )


def test_sampled_test_does_not_reject_the_engine(pair, prompts):
    result = audit(pair, prompts)
    assert len(result["prompts"]) == 2 and result["samples_per_arm"] == 100
    for p in result["prompts"]:
        assert p["n_a"] == p["n_b"] == 100 and p["cells"] >= 3 and p["dof"] == p["cells"] - 1
        # a static depth-2 controller drafts in every cycle with budget left (at least once per request):
        # the test exercised speculation
        assert 100 <= p["drafting_cycles"] <= p["speculative_cycles"]
    assert result["fisher_pvalue"] > 1e-4 and not result["rejects"]


def always_accept(node_tokens, node_parents, draw_target):
    """A broken verifier: walks down the first child at every node without checking the target."""
    path, node = [], -1
    while True:
        child = next((i for i, p in enumerate(node_parents) if p == node), None)
        if child is None:
            return path, draw_target(node + 1)
        path.append(child)
        node = child


def test_sampled_test_rejects_a_broken_sampler(pair, prompts, monkeypatch):
    monkeypatch.setattr(engine.engine, "verify_tree", always_accept)
    result = audit(pair, prompts)
    assert result["fisher_pvalue"] < 1e-4 and result["rejects"]


def test_law_checks_pass_verify_chain_and_flag_the_wrong_rule():
    checks = law_checks(trials=2000, seed=0)
    assert all(c["ok"] for c in checks), checks
    assert {c["rule"] for c in checks if c["expected"] == "disagree"} == {"wrong: resample from target"}
    wrong = [c for c in checks if c["expected"] == "disagree"]
    assert all(c["tv"] > c["tv_bound"] and c["pvalue"] < 1e-6 for c in wrong)


def test_greedy_audit_reports_the_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    tokens = {"autoregressive": {"a": [1, 2, 3], "b": [4, 5]}, "x": {"a": [1, 2, 3], "b": [4, 6]}}
    result = greedy_audit(tokens)["x"]
    assert result["identical"] == 1 and result["match_rate"] == 0.5
    assert result["divergences"] == [{"prompt_id": "b", "position": 1, "tokens": 2, "reference": 2}]
