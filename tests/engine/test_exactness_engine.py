"""End to end exactness on the tiny pair: the law of the tokens the engine emits right after the prefill
token equals the target model's own autoregressive law, computed exactly by enumeration with the target.

Outcome: (tokens[1], tokens[2]) for a fixed prompt with max_new_tokens=4, so the first cycle drafts the full
depth 2 and both tokens come out of its verified block whenever a draft is accepted (tokens[0] is a plain
prefill draw). The law is marginalised over tokens[0]; EOS ends a sequence early (the outcome is shorter).
"""

from __future__ import annotations

import pytest
import torch

import engine.engine as engine_module
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig
from engine.lookup import LookupConfig
from engine.sampling import SamplingConfig, logits_to_probs, verify_chain

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = "def "
MAX_NEW = 4  # first cycle: cap = MAX_NEW - 2 = 2 = the controllers' depth
NUM_SAMPLES = 600  # ~9 ms per generate() on a shared 2-core CPU: ~6 s per configuration
# top_k / top_p keep the two-token law small (167 and 105 outcomes): at T=1.3 with top_k=8 (288 outcomes)
# the negative control below was NOT caught at this sample size (p-value 0.08), so the support was cut further.
SAMPLINGS = {
    "T0.7": SamplingConfig(temperature=0.7, top_k=8, top_p=0.8),
    "T1.3": SamplingConfig(temperature=1.3, top_k=5, top_p=0.9),
}
MODES = {
    "chain": (EngineConfig(), lambda: StaticController(depth=2)),
    "tree": (
        EngineConfig(),
        lambda: StaticController(depth=2, verify=8, tree_width=3),
    ),  # 12 nodes, 8 verified
    "sampled-chain": (EngineConfig(draft_mode="sampled"), lambda: StaticController(depth=2)),
    # verify only a prefix of the sampled chain (the size decision); tokens[2] is then the bonus token
    "sampled-chain-verify1": (
        EngineConfig(draft_mode="sampled"),
        lambda: StaticController(depth=2, verify=1),
    ),
}
CASES = [
    (mode, name) for mode in MODES for name in SAMPLINGS if mode != "sampled-chain-verify1" or name == "T0.7"
]


@torch.inference_mode()
def exact_law(
    model, prompt_ids: list[int], sampling: SamplingConfig, eos: frozenset, length: int = 3
) -> dict:
    """Target law of the first ``length`` generated tokens (EOS ends a sequence), by enumeration with one
    batched forward per position, then marginalised over the first token."""
    sequences = {(): 1.0}
    for _ in range(length):
        done = {seq: mass for seq, mass in sequences.items() if seq and seq[-1] in eos}
        open_seqs = [seq for seq in sequences if seq not in done]
        logits = model(input_ids=torch.tensor([prompt_ids + list(seq) for seq in open_seqs])).logits[:, -1]
        probs = logits_to_probs(logits, sampling).double()  # the engine's processing (float32 rows)
        probs /= probs.sum(-1, keepdim=True)  # what multinomial samples from
        grown = dict(done)
        for seq, row in zip(open_seqs, probs):
            for token in torch.nonzero(row).flatten().tolist():
                grown[seq + (token,)] = sequences[seq] * float(row[token])
        sequences = grown
    law: dict[tuple, float] = {}
    for seq, mass in sequences.items():
        law[seq[1:]] = law.get(seq[1:], 0.0) + mass
    return law


@pytest.fixture(scope="module")
def prompt_ids(tiny_pair):
    return tiny_pair.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def exact_laws(tiny_pair, prompt_ids):
    return {
        name: exact_law(tiny_pair.target, prompt_ids, sampling, tiny_pair.eos_token_ids)
        for name, sampling in SAMPLINGS.items()
    }


def sample_outcomes(engine, prompt_ids, make_controller, seed0: int) -> list[tuple]:
    return [
        tuple(engine.generate(prompt_ids, MAX_NEW, make_controller(), seed=seed0 + i).tokens[1:3])
        for i in range(NUM_SAMPLES)
    ]


def test_exact_law_is_a_distribution(exact_laws):
    for law in exact_laws.values():
        assert abs(sum(law.values()) - 1.0) < 1e-9
        assert 50 < len(law) < 200  # small enough for the sample size, large enough to be a real test


@pytest.mark.parametrize("mode, sampling_name", CASES)
def test_engine_law_equals_target_law(tiny_pair, prompt_ids, exact_laws, law_check, mode, sampling_name):
    config, make_controller = MODES[mode]
    engine = SpeculativeEngine(tiny_pair, SAMPLINGS[sampling_name], config)
    seed0 = 1_000_000 * (list(MODES).index(mode) + 1) + 10_000 * list(SAMPLINGS).index(sampling_name)
    result = law_check(sample_outcomes(engine, prompt_ids, make_controller, seed0), exact_laws[sampling_name])
    assert result.agrees, result


def verify_chain_resample_from_target(target_probs, draft_probs, draft_tokens, generator):
    """The WRONG rule (negative control): on a rejection, draw from the target instead of the residual."""
    num_accepted, next_token = verify_chain(target_probs, draft_probs, draft_tokens, generator)
    if num_accepted < draft_tokens.shape[0]:
        next_token = int(torch.multinomial(target_probs[num_accepted], 1, generator=generator))
    return num_accepted, next_token


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_wrong_recovery_rule_is_caught(
    tiny_pair, prompt_ids, exact_laws, law_check, monkeypatch, sampling_name
):
    """The same checker, sample size and configuration as above must reject the engine with the wrong rule."""
    monkeypatch.setattr(engine_module, "verify_chain", verify_chain_resample_from_target)
    config, make_controller = MODES["sampled-chain"]
    engine = SpeculativeEngine(tiny_pair, SAMPLINGS[sampling_name], config)
    outcomes = sample_outcomes(engine, prompt_ids, make_controller, seed0=7_000_000)
    result = law_check(outcomes, exact_laws[sampling_name])
    assert result.pvalue < 1e-6, result


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_deterministic_drafts_reproduce_the_autoregressive_sample(tiny_pair, prompt_ids, sampling_name):
    """With deterministic drafts the target draws one token per position from the same generator in the
    same order, so a seed gives the autoregressive sample itself (the coupling trace replay relies on,
    docs/design.md section 3) -- a much sharper check than a law, for the deterministic modes."""
    engine = SpeculativeEngine(tiny_pair, SAMPLINGS[sampling_name])
    for seed in range(15):
        reference = engine.generate(prompt_ids, 20, seed=seed).tokens
        for controller in (StaticController(3), StaticController(4, 10, 3)):
            assert engine.generate(prompt_ids, 20, controller, seed=seed).tokens == reference, (
                seed,
                controller,
            )


# ---------------------------------------------------------------------------------------- context lookup
LOOKUP = LookupConfig(min_ngram=1, max_ngram=1, max_tokens=2)


@pytest.fixture(scope="module")
def lookup_prompt(tiny_pair, prompt_ids):
    """``prompt_ids`` behind pairs (a, b): a among the target's 8 likeliest next tokens, b its greedy successor
    (three rounds, each on the previous prompt), so most first cycles find a lookup proposal (the first
    token occurred in the prompt) and its tokens are accepted sometimes, rejected sometimes."""

    def top(ids, k):
        return tiny_pair.target(input_ids=torch.tensor([ids])).logits[0, -1].topk(k).indices.tolist()

    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(3):
            pairs = []
            for a in top(ids, 8):
                pairs += [a, top(ids + [a], 1)[0]]
            ids = pairs + list(prompt_ids)
    return ids


@pytest.fixture(scope="module")
def lookup_laws(tiny_pair, lookup_prompt):
    return {
        name: exact_law(tiny_pair.target, lookup_prompt, sampling, tiny_pair.eos_token_ids)
        for name, sampling in SAMPLINGS.items()
    }


def _lookup_outcomes(engine, ids, seed0):
    outcomes, hits = [], 0
    for i in range(NUM_SAMPLES):
        result = engine.generate(ids, MAX_NEW, StaticController(depth=2), seed=seed0 + i)
        outcomes.append(tuple(result.tokens[1:3]))
        hits += result.cycles[0].lookup
    return outcomes, hits


@pytest.mark.parametrize("draft_mode", ["deterministic", "sampled"])
@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_lookup_law_equals_target_law(
    tiny_pair, lookup_prompt, lookup_laws, law_check, draft_mode, sampling_name
):
    """Lookup cycles (most first cycles here) mixed with the controller's chain cycles keep the target law."""
    engine = SpeculativeEngine(
        tiny_pair, SAMPLINGS[sampling_name], EngineConfig(draft_mode=draft_mode, lookup=LOOKUP)
    )
    seed0 = 20_000_000 + 1_000_000 * (draft_mode == "sampled") + 10_000 * list(SAMPLINGS).index(sampling_name)
    outcomes, hits = _lookup_outcomes(engine, lookup_prompt, seed0)
    assert hits > NUM_SAMPLES // 3  # a large share of the law is the lookup cycles
    result = law_check(outcomes, lookup_laws[sampling_name])
    assert result.agrees, result


REAL_VERIFY_TREE = engine_module.verify_tree


def verify_tree_trusting_the_first_node(node_tokens, node_parents, draw_target):
    """The WRONG rule (negative control): a lookup's first proposed token is kept even when rejected."""
    path, token = REAL_VERIFY_TREE(node_tokens, node_parents, draw_target)
    return ([0], token) if node_tokens and not path else (path, token)


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_wrong_lookup_rule_is_caught(
    tiny_pair, lookup_prompt, lookup_laws, law_check, monkeypatch, sampling_name
):
    """Same checker, sample size and configuration as above (sampled drafts: ``verify_tree`` serves only the
    lookup cycles) must reject the engine that trusts the lookup."""
    monkeypatch.setattr(engine_module, "verify_tree", verify_tree_trusting_the_first_node)
    engine = SpeculativeEngine(
        tiny_pair, SAMPLINGS[sampling_name], EngineConfig(draft_mode="sampled", lookup=LOOKUP)
    )
    outcomes, _ = _lookup_outcomes(engine, lookup_prompt, seed0=27_000_000)
    result = law_check(outcomes, lookup_laws[sampling_name])
    assert result.pvalue < 1e-6, result


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_lookup_reproduces_the_autoregressive_sample(tiny_pair, lookup_prompt, sampling_name):
    """A lookup proposal is a deterministic draft: a seed gives the autoregressive sample itself, with or
    without a controller (deterministic drafts) for the cycles without a proposal."""
    reference_engine = SpeculativeEngine(tiny_pair, SAMPLINGS[sampling_name])
    engine = SpeculativeEngine(
        tiny_pair, SAMPLINGS[sampling_name], EngineConfig(lookup=LookupConfig(1, 3, 4))
    )
    lookups = accepted = 0
    for seed in range(15):
        reference = reference_engine.generate(lookup_prompt, 20, seed=seed).tokens
        for controller in (None, StaticController(3), StaticController(4, 10, 3)):
            result = engine.generate(lookup_prompt, 20, controller, seed=seed)
            assert result.tokens == reference, (seed, controller)
            lookups += sum(c.lookup for c in result.cycles)
            accepted += sum(c.accepted for c in result.cycles if c.lookup)
    assert lookups > 50 and accepted >= 10  # proposals taken, not only rejected
