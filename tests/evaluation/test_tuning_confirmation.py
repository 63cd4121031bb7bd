"""Live confirmation of the static grid: a paired median over prompts, so one disturbed prompt cannot pick
the winner (evaluation.tuning)."""

from __future__ import annotations

import math

import pytest

from evaluation import tuning

# tokens/s of two candidates per tune prompt: A (replay-best) is 10% faster on every prompt but the
# second, where the machine was busy while A ran (3x slower)
RATES = {(2, 2): [30.0, 10.0, 30.0, 30.0], (1, 1): [27.0, 27.0, 27.0, 27.0]}
TOKENS = 128


@pytest.fixture
def fake_runs(monkeypatch):
    calls = []

    def run_engine(engine, ids, controller, max_new_tokens, seed):
        key = (controller.depth, controller.verify)
        prompt = ids[0]
        calls.append((prompt, key))
        return {"num_tokens": TOKENS, "total_s": TOKENS / RATES[key][prompt]}

    monkeypatch.setattr(tuning, "run_engine", run_engine)
    return calls


def candidates():
    return [
        {"depth": 2, "verify": 2, "replay_tokens_per_s": 31.0},
        {"depth": 1, "verify": 1, "replay_tokens_per_s": 29.0},
    ]


def test_one_disturbed_prompt_does_not_pick_the_winner(fake_runs):
    prompts = [(f"p{i}", [i]) for i in range(4)]
    confirmed = tuning.confirm_live(None, candidates(), 1, prompts, TOKENS, 0)
    a, b = confirmed
    # negative control: the sum over prompts (the earlier rule) prefers the slower candidate
    assert b["live_tokens_per_s"] > a["live_tokens_per_s"]
    assert a["live_median_ratio"] == 1.0
    assert b["live_median_ratio"] == pytest.approx(0.9)
    assert tuning.confirmed_best(confirmed) is a
    assert a["live_prompt_tokens_per_s"] == pytest.approx(RATES[(2, 2)])
    # every candidate ran on every prompt, the order rotated per prompt
    assert sorted(fake_runs) == sorted((i, k) for i in range(4) for k in RATES)
    assert [k for p, k in fake_runs if p == 1] == [(1, 1), (2, 2)]


def test_a_candidate_faster_on_most_prompts_wins(fake_runs, monkeypatch):
    monkeypatch.setitem(RATES, (1, 1), [33.0, 33.0, 33.0, 20.0])
    prompts = [(f"p{i}", [i]) for i in range(4)]
    confirmed = tuning.confirm_live(None, candidates(), 1, prompts, TOKENS, 0)
    assert tuning.confirmed_best(confirmed) is confirmed[1]


def test_ties_and_nan_keep_the_replay_order():
    first = {"depth": 2, "verify": 2, "live_median_ratio": 1.0}
    tied = {"depth": 1, "verify": 1, "live_median_ratio": 1.0}
    broken = {"depth": 3, "verify": 3, "live_median_ratio": math.nan}
    assert tuning.confirmed_best([first, tied, broken]) is first
    assert tuning.confirmed_best([broken, tied]) is tied
