"""Greedy speculative decoding equals greedy target-only decoding, token for token (docs/design.md section 1),
whatever the controller: chains, trees, verify=0, verify beyond the drafted nodes, depth 1 and deep ones,
a draft that is always right and one that is always wrong."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.control import Controller, StaticController
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig
from engine.sampling import SamplingConfig
from tests_helpers import late_starter

pytestmark = pytest.mark.usefixtures("single_thread")

NUM_NEW = 40
# (depth, verify, tree_width); verify=None means the default (= depth)
CONTROLLERS = [
    (1, None, 1),
    (1, 0, 1),
    (2, 1, 1),
    (3, None, 1),
    (5, 2, 1),
    (3, 100, 1),
    (12, None, 1),
    (1, 3, 4),
    (2, 0, 3),
    (3, 1, 3),
    (3, 8, 3),
    (4, 16, 2),
    (6, 64, 4),
    (12, 30, 2),
]


@pytest.fixture(scope="module")
def greedy_engine(tiny_pair):
    return SpeculativeEngine(tiny_pair, SamplingConfig(temperature=0.0))


@pytest.fixture(scope="module")
def ar_tokens(greedy_engine, prompts):
    """Greedy target-only output per prompt (controller=None)."""
    outputs = {prompt: greedy_engine.generate(prompt, NUM_NEW) for prompt in prompts}
    for res in outputs.values():
        assert res.cycles and all(c.depth == 0 and c.num_verified == 0 for c in res.cycles)
    return {prompt: res.tokens for prompt, res in outputs.items()}


@pytest.mark.parametrize("depth, verify, tree_width", CONTROLLERS)
def test_greedy_speculative_equals_autoregressive(
    greedy_engine, ar_tokens, prompts, depth, verify, tree_width
):
    for prompt in prompts:
        res = greedy_engine.generate(prompt, NUM_NEW, StaticController(depth, verify, tree_width))
        assert res.tokens == ar_tokens[prompt], (prompt, res.cycles)
        assert res.finish_reason == "length"
        assert max(c.depth for c in res.cycles) <= depth
        if verify == 0:
            assert all(c.accepted == 0 and c.emitted == 1 for c in res.cycles)


@settings(max_examples=8, deadline=None, database=None)
@given(
    depth=st.integers(1, 12),
    verify=st.integers(0, 40),
    tree_width=st.integers(1, 4),
    prompt_index=st.integers(0, 2),
    num_new=st.integers(1, 20),
)
def test_greedy_property(greedy_engine, ar_tokens, prompts, depth, verify, tree_width, prompt_index, num_new):
    prompt = prompts[prompt_index]
    res = greedy_engine.generate(prompt, num_new, StaticController(depth, verify, tree_width))
    assert res.tokens == ar_tokens[prompt][:num_new]


class OddController(Controller):
    """Asks for a negative or oversized verification (the engine clamps to [0, nodes]) and never stops."""

    tree_width = 2

    def __init__(self, verify: int):
        self.verify = verify

    def should_continue(self, state):
        return True  # the engine's caps (max_depth, budget, context) end the drafting

    def num_to_verify(self, state):
        return self.verify


@pytest.mark.parametrize("verify", [-5, 10**6])
def test_engine_caps_and_clamps_the_controller(tiny_pair, ar_tokens, prompts, verify):
    engine = SpeculativeEngine(tiny_pair, config=EngineConfig(max_depth=3))
    res = engine.generate(prompts[0], NUM_NEW, OddController(verify))
    assert res.tokens == ar_tokens[prompts[0]]
    assert all(c.depth <= 3 for c in res.cycles)
    assert all(c.num_verified == (0 if verify < 0 else c.num_drafted) for c in res.cycles)


def test_greedy_float32_bit_identical(tiny_pair_f32, prompts):
    engine = SpeculativeEngine(tiny_pair_f32)
    for prompt in prompts:
        reference = engine.generate(prompt, NUM_NEW).tokens
        for controller in (StaticController(4), StaticController(3, 8, 3), StaticController(6, 20, 2)):
            assert engine.generate(prompt, NUM_NEW, controller).tokens == reference, (prompt, controller)


def test_prompt_forms_agree(greedy_engine, tiny_pair, ar_tokens, prompts):
    ids = tiny_pair.tokenizer.encode(prompts[0])
    for prompt in (ids, torch.tensor(ids), torch.tensor([ids])):
        res = greedy_engine.generate(prompt, NUM_NEW, StaticController(3))
        assert res.tokens == ar_tokens[prompts[0]]
        assert res.prompt_len == len(ids)
        assert res.text == tiny_pair.tokenizer.decode(res.tokens)


# ------------------------------------------------------------------- always / never accepted drafts
def test_draft_equal_to_target_is_always_accepted(tiny_pair, ar_tokens, prompts):
    engine = SpeculativeEngine(dataclasses.replace(tiny_pair, draft=tiny_pair.target))
    for prompt in prompts:
        res = engine.generate(prompt, NUM_NEW, StaticController(depth=4))
        assert res.tokens == ar_tokens[prompt]
        assert res.stats["acceptance_rate"] == 1.0
        assert all(c.accepted == c.num_verified == c.depth for c in res.cycles)
        # every cycle but the budget-capped tail drafts the full depth and emits depth + 1 tokens
        assert [c.emitted for c in res.cycles[:-1]] == [5] * (len(res.cycles) - 1)


def with_biased_draft_head(pair, token: int, bias: float = 1e4):
    """A pair whose draft always proposes ``token``: its lm_head gets a huge bias on that id."""
    draft = copy.deepcopy(pair.draft)
    head = draft.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True, dtype=head.weight.dtype)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[token] = bias
    draft.lm_head = biased
    return dataclasses.replace(pair, draft=draft.requires_grad_(False))


def test_draft_never_accepted(tiny_pair, ar_tokens, prompts):
    never = 271  # a padding id the target's greedy output never contains (checked below)
    assert all(never not in tokens for tokens in ar_tokens.values())
    pair = with_biased_draft_head(tiny_pair, never)
    engine = SpeculativeEngine(pair)
    for prompt in prompts:
        res = engine.generate(prompt, NUM_NEW, StaticController(depth=3))
        assert res.tokens == ar_tokens[prompt]
        assert res.stats["acceptance_rate"] == 0.0
        assert all(c.accepted == 0 and c.emitted == 1 and c.num_verified == c.depth for c in res.cycles)


@pytest.mark.parametrize("skip", [0, 1, 7, 10**6])
def test_the_draft_prefill_waits_for_the_first_drafting_cycle(tiny_pair, ar_tokens, prompts, skip):
    # the draft runs the prompt only when a cycle first drafts: a request never drafted never pays for it,
    # and one that starts late drafts exactly the trees an eager prefill would give (same tokens, same
    # cycles as a controller drafting from the same state), its caches checked after every cycle
    engine = SpeculativeEngine(tiny_pair, config=EngineConfig(validate_caches=True))
    res = engine.generate(prompts[1], NUM_NEW, late_starter(skip, depth=3))
    assert res.tokens == ar_tokens[prompts[1]]
    drafted = [c for c in res.cycles if c.depth > 0]
    assert (len(drafted) == 0) == (skip >= NUM_NEW)
    assert all(c.depth == 0 for c in res.cycles[: min(skip, len(res.cycles))])
    if skip >= NUM_NEW:  # never drafted: the draft never ran
        assert all(c.draft_s == 0 for c in res.cycles)
    req = engine._prefill(tiny_pair.tokenizer.encode(prompts[1]), torch.Generator(), with_draft=True)
    assert req.draft_prompt is not None and req.draft_len == 0  # nothing run on the draft at prefill


@pytest.mark.parametrize("skip", [0, 7, 10**6])
def test_the_lazy_draft_prefill_is_reported_as_prefill(tiny_pair, prompts, skip, monkeypatch):
    # a fake clock: every forward takes 1 ms, the draft's run over the prompt 100 s
    engine = SpeculativeEngine(tiny_pair)
    now = [0.0]
    forward = SpeculativeEngine.forward

    def timed_forward(self, model, ids, start, *args, **kwargs):
        now[0] += 100.0 if model is self.pair.draft and start == 0 else 0.001
        return forward(self, model, ids, start, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "forward", timed_forward)
    engine.clock = lambda: now[0]
    res = engine.generate(prompts[1], NUM_NEW, late_starter(skip, depth=3))
    drafted = skip < NUM_NEW
    assert (100.0 <= res.prefill_s < 101.0) if drafted else res.prefill_s < 1.0  # target + draft prefill
    assert all(c.total_s < 1.0 for c in res.cycles)  # no cycle is charged for the draft's prefill
    assert any(c.depth > 0 for c in res.cycles) == drafted


def test_a_lazy_draft_prefill_drafts_what_an_eager_one_would(tiny_pair, prompts, monkeypatch):
    def cycles(engine):
        res = engine.generate(prompts[2], NUM_NEW, late_starter(5, depth=4))
        return res.tokens, [(c.depth, c.num_drafted, c.num_verified, c.accepted) for c in res.cycles]

    engine = SpeculativeEngine(tiny_pair)
    lazy = cycles(engine)
    lazy_prefill = SpeculativeEngine._prefill

    def eager_prefill(self, prompt_ids, generator, with_draft):  # the draft runs the prompt at once
        req = lazy_prefill(self, prompt_ids, generator, with_draft)
        if with_draft:
            self.forward(self.pair.draft, req.draft_prompt, 0, req.draft_cache, keep=1)
            req.draft_len, req.draft_prompt = len(req.draft_prompt), None
        return req

    monkeypatch.setattr(SpeculativeEngine, "_prefill", eager_prefill)
    assert cycles(engine) == lazy
    assert any(d > 0 for d, *_ in lazy[1])  # it drafted after the autoregressive start
