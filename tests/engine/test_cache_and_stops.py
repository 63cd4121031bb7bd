"""The cache invariant after every cycle, and the stops: EOS inside an accepted block, max_new_tokens, the
context limit; plus the per-cycle records and summary statistics that the controllers and reports use."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import engine.engine as engine_module
from engine.backends.kvcache import _crop
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig
from engine.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("single_thread")

SAMPLED = SamplingConfig(temperature=1.0, top_k=20, top_p=0.95)
# name -> (sampling, engine config, controller factory)
SETUPS = {
    "chain-greedy": (SamplingConfig(), EngineConfig(), lambda: StaticController(4)),
    "tree-greedy": (SamplingConfig(), EngineConfig(), lambda: StaticController(3, 8, 3)),
    "chain-sampled": (SAMPLED, EngineConfig(), lambda: StaticController(4, 2)),
    "tree-sampled": (SAMPLED, EngineConfig(), lambda: StaticController(4, 12, 2)),
    "sampled-drafts": (SAMPLED, EngineConfig(draft_mode="sampled"), lambda: StaticController(4)),
    "sampled-drafts-partial": (SAMPLED, EngineConfig(draft_mode="sampled"), lambda: StaticController(4, 2)),
}


def check_records(res, depth: int) -> None:
    """Field relations every result must satisfy."""
    context = res.prompt_len + 1  # the prefill commits one token
    for c in res.cycles:
        assert c.context_len == context
        assert 0 <= c.accepted <= c.num_verified <= c.num_drafted
        assert 1 <= c.emitted <= c.accepted + 1
        assert c.depth <= depth and (c.depth == 0) == (c.num_drafted == 0)
        assert min(c.draft_s, c.verify_s, c.controller_s, c.overhead_s, c.forward_s) >= 0
        context += c.emitted
    assert context == res.prompt_len + len(res.tokens)  # sum(emitted) + 1 == len(tokens)


@pytest.mark.parametrize("name", list(SETUPS))
def test_caches_hold_committed_tokens_after_every_cycle(tiny_pair, prompts, name):
    sampling, config, make_controller = SETUPS[name]
    checked = SpeculativeEngine(tiny_pair, sampling, dataclasses.replace(config, validate_caches=True))
    plain = SpeculativeEngine(tiny_pair, sampling, config)
    total_accepted = 0
    for seed, prompt in enumerate(prompts):
        res = checked.generate(prompt, 30, make_controller(), seed=seed)  # raises on a bad cache
        assert res.tokens == plain.generate(prompt, 30, make_controller(), seed=seed).tokens
        check_records(res, depth=4)
        total_accepted += sum(c.accepted for c in res.cycles)
    assert total_accepted > 0  # non-trivial paths were committed and compacted


def test_cache_validation_catches_a_broken_compaction(tiny_pair, prompts, monkeypatch):
    """Negative control: a compaction that only crops (keeps the wrong entries off a tree path) is caught."""
    monkeypatch.setattr(
        engine_module, "keep_entries", lambda cache, start, keep: _crop(cache, start + len(keep))
    )
    engine = SpeculativeEngine(tiny_pair, config=EngineConfig(validate_caches=True))
    with pytest.raises(AssertionError, match="differs from a fresh forward"):
        for prompt in prompts:
            engine.generate(prompt, 40, StaticController(3, 9, 3))


# --------------------------------------------------------------------------------------------- EOS
def eos_inside_accepted_block(engine, prompt):
    """Greedy: a token that first appears at an *accepted draft* position j of a multi-token block (so
    tokens after it in the same block must be cut). Returns (autoregressive tokens, j) or None."""
    reference = engine.generate(prompt, 40).tokens
    res = engine.generate(prompt, 40, StaticController(4))
    start = 1
    for c in res.cycles:
        for j in range(start, start + c.accepted):  # the accepted drafts; the block continues after them
            if reference.index(reference[j]) == j:
                return reference, j
        start += c.emitted
    return None


@pytest.fixture(scope="module")
def eos_case(tiny_pair, prompts):
    found = eos_inside_accepted_block(SpeculativeEngine(tiny_pair), prompts[0])
    assert found is not None, "no accepted draft token that first appears mid-block: pick another prompt"
    reference, j = found
    return dataclasses.replace(tiny_pair, eos_token_ids=frozenset({reference[j]})), reference[: j + 1]


def test_eos_inside_accepted_block_stops_there(eos_case, prompts):
    pair, expected = eos_case
    res = SpeculativeEngine(pair).generate(prompts[0], 40, StaticController(4))
    assert res.tokens == expected
    assert res.finish_reason == "eos"
    last = res.cycles[-1]
    assert last.emitted <= last.accepted  # the block was cut at the EOS: not everything accepted was emitted
    check_records(res, depth=4)
    # autoregressive decoding stops at the same place
    assert SpeculativeEngine(pair).generate(prompts[0], 40).tokens == expected


def test_eos_inside_block_leaves_caches_holding_committed_tokens(eos_case, prompts):
    """docs/design.md section 2: after each cycle the caches hold exactly the committed tokens -- including
    the cycle whose block is cut at an accepted EOS (validate_caches must not crash a valid request)."""
    pair, expected = eos_case
    engine = SpeculativeEngine(pair, config=EngineConfig(validate_caches=True))
    res = engine.generate(prompts[0], 40, StaticController(4))
    assert res.tokens == expected and res.finish_reason == "eos"


def test_eos_as_first_token(tiny_pair, prompts):
    first = SpeculativeEngine(tiny_pair).generate(prompts[1], 1).tokens[0]
    pair = dataclasses.replace(tiny_pair, eos_token_ids=frozenset({first}))
    res = SpeculativeEngine(pair).generate(prompts[1], 20, StaticController(3))
    assert res.tokens == [first] and res.finish_reason == "eos" and res.cycles == []


# ------------------------------------------------------------------------------------ length limits
@pytest.mark.parametrize("name", [None, *SETUPS])
def test_max_new_tokens_is_never_exceeded(tiny_pair, prompts, name):
    sampling, config, make_controller = SETUPS[name] if name else (SAMPLED, EngineConfig(), lambda: None)
    engine = SpeculativeEngine(tiny_pair, sampling, config)
    for max_new in (1, 2, 3, 7):
        for seed, prompt in enumerate(prompts):
            res = engine.generate(prompt, max_new, make_controller(), seed=seed)
            assert len(res.tokens) <= max_new
            if tiny_pair.eos_token_ids.isdisjoint(res.tokens):
                assert len(res.tokens) == max_new and res.finish_reason == "length"
            check_records(res, depth=4)


class PositionRecorder:
    """Forward pre-hook: the largest position id a model is ever run at."""

    def __init__(self):
        self.max_position = -1

    def __call__(self, module, args, kwargs):
        self.max_position = max(self.max_position, int(kwargs["position_ids"].max()))


@pytest.mark.parametrize(
    "controller",
    [None, StaticController(8), StaticController(8, 40, 3), StaticController(1)],
    ids=["ar", "chain8", "tree8", "chain1"],
)
@pytest.mark.parametrize("room", [1, 2, 5])
def test_context_limit(tiny_pair, prompts, controller, room):
    prompt_ids = tiny_pair.tokenizer.encode(prompts[1])
    pair = dataclasses.replace(tiny_pair, max_context=len(prompt_ids) + room)
    recorders = [PositionRecorder(), PositionRecorder()]
    handles = [
        model.register_forward_pre_hook(rec, with_kwargs=True)
        for model, rec in zip((pair.target, pair.draft), recorders)
    ]
    try:
        res = SpeculativeEngine(pair).generate(prompt_ids, 100, controller)
    finally:
        for handle in handles:
            handle.remove()
    assert len(res.tokens) == room and res.finish_reason == "context"
    assert max(rec.max_position for rec in recorders) < pair.max_context
    check_records(res, depth=8)


# ---------------------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("name", list(SETUPS))
def test_stats_are_sane(tiny_pair, prompts, name):
    sampling, config, make_controller = SETUPS[name]
    res = SpeculativeEngine(tiny_pair, sampling, config).generate(prompts[0], 40, make_controller(), seed=1)
    stats = res.stats
    assert stats["num_tokens"] == len(res.tokens) and stats["num_cycles"] == len(res.cycles)
    assert stats["tokens_per_s"] > 0 and stats["decode_tokens_per_s"] > 0
    assert stats["ttft_s"] == res.prefill_s > 0
    assert stats["total_s"] >= stats["ttft_s"]
    assert 0 < stats["itl_p50_s"] <= stats["itl_p90_s"] <= stats["itl_p99_s"]
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert 0.0 <= stats["mean_accepted"] <= stats["mean_depth"] <= 4
    assert 0.0 <= stats["overhead_fraction"] <= 1.0 and 0.0 <= stats["controller_fraction"] <= 1.0
    assert stats["tokens_per_cycle"] == (len(res.tokens) - 1) / len(res.cycles)
    assert math.isfinite(stats["peak_memory_mb"]) and stats["peak_memory_mb"] > 0
    assert res.to_dict()["stats"] == pytest.approx(stats, nan_ok=True)


def test_autoregressive_stats(tiny_pair, prompts):
    res = SpeculativeEngine(tiny_pair).generate(prompts[0], 10)
    assert len(res.cycles) == 9 and all(c.emitted == 1 and c.depth == 0 for c in res.cycles)
    assert math.isnan(res.stats["acceptance_rate"]) and res.stats["mean_accepted"] == 0.0
    check_records(res, depth=0)


def test_generate_leaves_global_rng_alone(tiny_pair, prompts):
    """Randomness is explicit (docs/design.md section 1.7): sampling must not consume the global torch RNG."""
    state = torch.get_rng_state()
    SpeculativeEngine(tiny_pair, SAMPLED, EngineConfig(draft_mode="sampled")).generate(
        prompts[0], 10, StaticController(3), seed=5
    )
    assert torch.equal(state, torch.get_rng_state())
