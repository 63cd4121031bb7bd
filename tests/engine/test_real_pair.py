"""Smoke test on the real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft).

The first run fetches and converts the weights (minutes); later runs load from the cache (seconds).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.backends.kvcache import keep_entries, new_cache
from engine.backends.models import load_pair
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.forward import forward_logits
from engine.sampling import SamplingConfig

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
    tree = engine.generate(
        prompt, max_new_tokens=24, controller=StaticController(depth=3, verify=6, tree_width=2)
    )
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


@pytest.fixture(scope="module")
def real_pair_default():
    """The CPU default formats (kquant target: the GGUF blocks as stored; 4-bit kquant-strict draft)."""
    return load_pair("qwen2.5-coder", device="cpu", progress=False)


def test_default_formats_are_quantized_and_exact(real_pair_default):
    pair = real_pair_default
    assert pair.weights == "kquant" and pair.draft_weights == "kquant-strict", pair.precision
    kinds = {m["kind"] for m in pair.quant_info["target"].values()}
    assert kinds == {"k4", "k6"}  # Q4_K and Q6_K blocks moved bit for bit
    engine = SpeculativeEngine(pair, SamplingConfig(temperature=0.0))
    prompt = pair.encode("Scrivi una funzione Python che restituisce il massimo di una lista.")
    ar = engine.generate(prompt, max_new_tokens=32, controller=None)
    for controller in (
        StaticController(depth=3),
        StaticController(depth=4, verify=2),
        StaticController(depth=2, verify=6, tree_width=3),
        StaticController(depth=0),
    ):
        res = engine.generate(prompt, max_new_tokens=32, controller=controller)
        assert res.tokens == ar.tokens, controller
    assert (
        engine.generate(prompt, max_new_tokens=32, controller=StaticController(depth=3)).stats[
            "mean_accepted"
        ]
        > 0.5
    )


def test_default_target_is_batch_invariant(real_pair_default):
    """Rows of a 6-row verification forward are bitwise the one-row decode steps (the guarantee greedy
    exactness rests on, on the real shapes)."""
    model = real_pair_default.target
    ids = real_pair_default.encode("Explain recursion.") + [1000 + i for i in range(6)]
    ctx = len(ids) - 6
    with torch.inference_mode():
        cache = new_cache(model)
        forward_logits(model, ids[:ctx], range(ctx), cache, "cpu", keep=1)
        block = forward_logits(model, ids[ctx:], range(ctx, ctx + 6), cache, "cpu")
        keep_entries(cache, ctx, [])
        single = torch.stack(
            [forward_logits(model, ids[ctx + j : ctx + j + 1], [ctx + j], cache, "cpu")[0] for j in range(6)]
        )
    assert torch.equal(block, single)
