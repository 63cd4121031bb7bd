"""Bad inputs fail early with a clear error, incompatible pairs are refused at load time, NaN logits stop a
request instead of emitting a wrong token, and an error leaves the engine usable ("nothing lost")."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from transformers import Qwen2ForCausalLM

from engine.backends.models import load_pair
from engine.backends.pair import IncompatiblePairError, check_compatible, make_pair
from engine.backends.tiny import ByteTokenizer, tiny_config
from engine.control import Controller, StaticController
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig
from engine.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return SpeculativeEngine(tiny_pair)


@pytest.fixture(scope="module")
def reference(engine, prompts):
    """Greedy speculative output before any error (the engine must give it again after each error)."""
    return engine.generate(prompts[0], 12, StaticController(3)).tokens


def still_works(engine, prompts, reference) -> bool:
    return engine.generate(prompts[0], 12, StaticController(3)).tokens == reference


# ---------------------------------------------------------------------------------- request arguments
@pytest.mark.parametrize("prompt", ["", [], torch.tensor([], dtype=torch.long)])
def test_empty_prompt(engine, prompts, reference, prompt):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate(prompt, 5, StaticController(3))
    assert still_works(engine, prompts, reference)


@pytest.mark.parametrize("max_new_tokens", [0, -1, 1.5, True, "3", None])
def test_bad_max_new_tokens(engine, prompts, reference, max_new_tokens):
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(prompts[0], max_new_tokens, StaticController(3))
    assert still_works(engine, prompts, reference)


@pytest.mark.parametrize("ids", [[-1], [1, 2, 272], [10**6], [5, -3, 7]])
def test_token_ids_out_of_vocab(engine, prompts, reference, ids):
    assert engine.pair.vocab_size == 272
    with pytest.raises(ValueError, match=r"\[0, 272\)"):
        engine.generate(ids, 5, StaticController(3))
    assert still_works(engine, prompts, reference)


@pytest.mark.parametrize("extra", [0, 3])
def test_prompt_not_shorter_than_context(tiny_pair, prompts, extra):
    ids = tiny_pair.tokenizer.encode(prompts[1])
    pair = dataclasses.replace(tiny_pair, max_context=len(ids) - extra)
    with pytest.raises(ValueError, match="context limit"):
        SpeculativeEngine(pair).generate(ids, 5, StaticController(3))


def test_bad_sampling_and_engine_configs():
    for kwargs in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}):
        with pytest.raises(ValueError):
            SamplingConfig(**kwargs)
    for kwargs in ({"draft_mode": "beam"}, {"max_depth": 0}):
        with pytest.raises(ValueError):
            EngineConfig(**kwargs)


class WidthController(Controller):
    def __init__(self, tree_width):
        self.tree_width = tree_width

    def should_continue(self, state):
        return False

    def num_to_verify(self, state):
        return 1


@pytest.mark.parametrize("tree_width", [0, -1, 1.5, None])
def test_controller_with_bad_tree_width(engine, prompts, reference, tree_width):
    with pytest.raises(ValueError, match="tree_width"):
        engine.generate(prompts[0], 5, WidthController(tree_width))
    with pytest.raises(ValueError, match="tree_width"):
        StaticController(depth=3, tree_width=0)
    assert still_works(engine, prompts, reference)


def test_sampled_drafts_need_chains_and_temperature(tiny_pair, prompts):
    sampled = EngineConfig(draft_mode="sampled")
    with pytest.raises(ValueError, match="tree_width=1"):
        SpeculativeEngine(tiny_pair, SamplingConfig(temperature=1.0), sampled).generate(
            prompts[0], 5, StaticController(3, 6, 2)
        )
    greedy = SpeculativeEngine(tiny_pair, SamplingConfig(temperature=0.0), sampled)
    with pytest.raises(ValueError, match="temperature > 0"):
        greedy.generate(prompts[0], 5, StaticController(3))
    assert len(greedy.generate(prompts[0], 5).tokens) == 5  # target-only decoding needs no draft mode


# -------------------------------------------------------------------------------------- loading pairs
@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "no-such-pair"},
        {"target": "some/model"},
        {"draft": "some/model"},
        {},
        {"name": "tiny", "target": "a", "draft": "b"},
    ],
)
def test_load_pair_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        load_pair(**kwargs)


def test_mismatched_vocab_sizes_are_refused(tiny_pair):
    config = tiny_config()
    config.vocab_size = 300
    other = Qwen2ForCausalLM(config).to(torch.float64).eval()
    with pytest.raises(IncompatiblePairError, match=r"272 vs 300"):
        make_pair(tiny_pair.target, other, tiny_pair.tokenizer, tiny_pair.tokenizer, "mismatch")
    with pytest.raises(IncompatiblePairError):
        check_compatible(other, tiny_pair.draft, tiny_pair.tokenizer, tiny_pair.tokenizer)
    assert issubclass(IncompatiblePairError, ValueError)


class ShiftedTokenizer(ByteTokenizer):
    """Same size, different meaning: id i is byte i+1."""

    def get_vocab(self):
        return {name: (i + 1) % 256 if i < 256 else i for name, i in super().get_vocab().items()}


def test_mismatched_tokenizers_are_refused(tiny_pair):
    with pytest.raises(IncompatiblePairError, match="tokenizers differ"):
        check_compatible(tiny_pair.target, tiny_pair.draft, tiny_pair.tokenizer, ShiftedTokenizer())
    check_compatible(
        tiny_pair.target, tiny_pair.draft, tiny_pair.tokenizer, ByteTokenizer()
    )  # equal vocab: ok


# ----------------------------------------------------------------------------------------- NaN logits
def with_nan_head(model):
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.lm_head.weight.fill_(math.nan)
    return broken


@pytest.mark.parametrize("side", ["target", "draft"])
@pytest.mark.parametrize(
    "controller", [StaticController(3), StaticController(3, 6, 2)], ids=["chain", "tree"]
)
def test_nan_logits_raise_a_clear_error(tiny_pair, prompts, side, controller):
    pair = dataclasses.replace(tiny_pair, **{side: with_nan_head(getattr(tiny_pair, side))})
    with pytest.raises(FloatingPointError, match=rf"non-finite logits \(NaN or inf\) from the {side} model"):
        SpeculativeEngine(pair).generate(prompts[0], 10, controller)
    sampled = SpeculativeEngine(pair, SamplingConfig(temperature=1.0), EngineConfig(draft_mode="sampled"))
    with pytest.raises(FloatingPointError, match=f"the {side} model"):
        sampled.generate(prompts[0], 10, StaticController(3))


def test_nan_draft_does_not_matter_without_a_controller(tiny_pair, prompts):
    pair = dataclasses.replace(tiny_pair, draft=with_nan_head(tiny_pair.draft))
    expected = SpeculativeEngine(tiny_pair).generate(prompts[0], 10).tokens
    assert SpeculativeEngine(pair).generate(prompts[0], 10).tokens == expected


class NaNAfter:
    """Forward hook on a model: replace the logits with NaN on the ``call``-th forward (mid-request)."""

    def __init__(self, call: int):
        self.call, self.calls = call, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == self.call:
            output.logits = torch.full_like(output.logits, math.nan)
        return output


@pytest.mark.parametrize("side", ["target", "draft"])
def test_nothing_lost_after_a_mid_request_nan(engine, prompts, reference, side):
    handle = getattr(engine.pair, side).register_forward_hook(NaNAfter(call=3))
    try:
        with pytest.raises(FloatingPointError, match=f"the {side} model"):
            engine.generate(prompts[0], 12, StaticController(3))
    finally:
        handle.remove()
    assert still_works(engine, prompts, reference)
