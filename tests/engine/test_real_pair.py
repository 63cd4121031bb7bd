"""Smoke test on the real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft).

The first run fetches and converts the weights (minutes); later runs load from the cache (seconds).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import SamplingConfig, SpeculativeEngine, load_pair
from policies import StaticController

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_pair():
    return load_pair("qwen2.5-coder", dtype=torch.float32, device="cpu", progress=False)


def test_real_pair_loads_compatible(real_pair):
    assert real_pair.vocab_size == 151936
    assert real_pair.draft.get_output_embeddings().weight.shape[0] == 151936
    assert real_pair.eos_token_ids, "the instruct models must have an end-of-turn token"
    ids = real_pair.encode("Say hi.")
    assert real_pair.tokenizer.decode(ids).count("Say hi.") == 1


def test_real_pair_greedy_speculative_equals_autoregressive(real_pair):
    engine = SpeculativeEngine(real_pair, SamplingConfig(temperature=0.0))
    prompt = real_pair.encode("Write a Python function that adds two numbers.")
    ar = engine.generate(prompt, max_new_tokens=24, controller=None)
    chain = engine.generate(prompt, max_new_tokens=24, controller=StaticController(depth=4))
    tree = engine.generate(prompt, max_new_tokens=24, controller=StaticController(depth=3, verify=6, tree_width=2))
    assert len(ar.tokens) > 0
    assert chain.tokens == ar.tokens
    assert tree.tokens == ar.tokens
    for res in (chain, tree):
        st = res.stats
        assert st["tokens_per_s"] > 0 and math.isfinite(st["tokens_per_s"])
        assert st["ttft_s"] > 0
        # a 0.5B draft of the same family agrees with its 1.5B target on most tokens of simple code
        assert 0.3 < st["acceptance_rate"] <= 1.0
        assert st["mean_accepted"] > 0.5
        assert sum(c.emitted for c in res.cycles) + 1 == len(res.tokens)
