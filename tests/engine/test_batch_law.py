"""The law of a sampled request decoded inside a busy ``BatchedEngine``: the target's, exactly, whatever else
is in flight and however the row cap cuts its verification (``engine.batch``: "a sampled request keeps its
law, though not the same draws as alone").

Every sample is one request for the same prompt with its own seed, decoded among ~20 others: sampled subjects
of both sampling configurations, speculative with chains, trees and verify-fewer controllers, next to
background requests (greedy and sampled, autoregressive and speculative, longer) that are re-added as they
finish, with ``BatchConfig.max_rows`` small enough that most verifications are granted fewer nodes than they
asked (counted: the test asserts cuts happened). Requests join and leave at every step, so prefills run next
to cycles of every phase.

The learned case: every request with a controller (subjects and background) runs a load-aware learned policy
(``policies.learned.load_policy`` of a policy file whose observations carry ``DraftState.load``), sampled chain drafts.
Its decisions then depend on what the other requests did in the last step, themselves random: the law must
not care. Not vacuous: the test asserts the subjects drafted at a share of their cycles and decoded
autoregressively at others, and that the load changed a share of the policy's decisions (the same state
alone is decided otherwise). The batch's arrival rate, which the policy observes, is read on a clock that
advances a fixed step at each reading, so the samples stay the same at every run.

Outcome: the first ``LENGTH`` generated tokens (shorter when EOS ends the request). Their exact law is the
target's autoregressive law with the request's ``SamplingConfig`` (``engine.sampling.logits_to_probs``, what
the engine draws from), enumerated with the target model: every sequence of mass >= 3 / samples is a cell of
its own, all others one cell ``OTHER`` (its mass is the rest). The tiny target is diffuse at temperature 1
(no next token above 0.2 after the prompt), so the configurations are chosen sharp enough for a few hundred
samples to tell laws apart: temperature 0.3 alone (no truncation: ~20 cells, OTHER ~0.65), and temperature 1
with top_k 4 and top_p 0.8 (every sequence a cell). The checker is the shared one (``check_law``: chi-square
with cells of expected count < 5 pooled, p > 1e-3, and a total variation bound). Seeds are fixed: the samples,
and so the verdicts, are the same at every run.

Negative controls, at the same sample size: the same samples against wrong laws (the target's at a 30% higher
temperature, the draft's) must be rejected (p < 1e-3); so must the batch when its sampled-draft verification
recovers from the target instead of the residual, with the static subjects and with the learned policy
deciding (measured on the truncated configuration: at temperature 0.3
draft and target disagree too rarely for this rule to show in 450 samples; a 10% higher temperature is also
caught only at some seeds, so 30%).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import types

import pytest
import torch

import engine.batch as batch_module
import engine.engine as engine_module
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest
from engine.control import StaticController
from engine.costs.observation import FEATURE_VERSION
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig
from engine.lookup import LookupConfig
from engine.sampling import SamplingConfig, logits_to_probs, verify_chain
from policies.learned import load_policy
from policies.learned_controller import LearnedController
from tests_helpers import batched_profile, make_policy

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = "def "
LENGTH = 3
MAX_NEW = 4  # the first cycle's depth cap is MAX_NEW - 2 = 2: t1 and t2 mostly come out of one verification
NUM_SAMPLES = 450  # per sampling configuration and draft mode: ~50 subjects/s in this batch on one CPU thread
OTHER = "other"
SAMPLINGS = {
    "T0.3": SamplingConfig(temperature=0.3),
    "T1-top_k4-top_p0.8": SamplingConfig(temperature=1.0, top_k=4, top_p=0.8),
}
WRONG = {  # negative controls: the same truncation at a 30% higher temperature
    "T0.3": SamplingConfig(temperature=0.39),
    "T1-top_k4-top_p0.8": SamplingConfig(temperature=1.3, top_k=4, top_p=0.8),
}
# every new prompt prefilled at once (a prompt decodes from the step after its prefill), and 30 rows for 24
# requests: the row cap cuts many verifications and grants others whole
BATCH = BatchConfig(max_requests=24, max_rows=30, max_prefill_tokens=2048)
SUBJECT_SLOTS = 18  # the other 6 slots: background requests
SUBJECTS = {  # (draft mode, controllers of the sampled subjects)
    "deterministic": [
        lambda: StaticController(2),
        lambda: StaticController(2, 8, tree_width=3),
        lambda: StaticController(2, 1),
        lambda: StaticController(2, 4, tree_width=2),
    ],
    "sampled": [lambda: StaticController(2), lambda: StaticController(2, 1), lambda: StaticController(1)],
}
BACKGROUND_PROMPTS = ["The quick brown fox", "x", "import numpy as np\n", "class A:\n    def"]
GREEDY = SamplingConfig()
BACKGROUND = {  # (controller or None, sampling, max_new_tokens), cycled
    "deterministic": [
        (lambda: None, GREEDY, 20),
        (lambda: StaticController(3), GREEDY, 20),
        (lambda: None, SamplingConfig(temperature=1.0), 16),
        (lambda: StaticController(2, 4, tree_width=2), SamplingConfig(0.8, top_k=20), 16),
        (lambda: StaticController(4, 8, tree_width=2), GREEDY, 24),
        (lambda: StaticController(4), SamplingConfig(1.0, top_p=0.9), 16),
    ],
    "sampled": [  # sampled drafts: chains only, and no greedy request with a controller
        (lambda: None, GREEDY, 20),
        (lambda: None, SamplingConfig(temperature=1.0), 16),
        (lambda: StaticController(4), SamplingConfig(0.8, top_k=20), 16),
        (lambda: StaticController(1), SamplingConfig(temperature=1.0), 24),
        (lambda: StaticController(3, 2), SamplingConfig(1.0, top_p=0.9), 16),
    ],
}


LEARNED_MODE = "sampled"
"""The learned case's draft mode: sampled chains (the Leviathan rule, whose wrong recovery is a negative
control); every request with a controller runs its own copy of one load-aware learned policy, the greedy
background requests are autoregressive (sampled drafts need a temperature)."""
LEARNED_SEED = 56
"""Seed of the learned policy's random actors (``tests_helpers.make_policy``): the first whose policy drafts in
this batch (at 0 and 1 it never does; ``assert_decided_by_the_load`` refuses such a policy)."""


# ------------------------------------------------------------------------------------------ exact laws
@torch.inference_mode()
def next_probs(model, prompt_ids: list[int], prefixes: list[tuple], sampling: SamplingConfig) -> dict:
    """prefix -> the distribution the engine draws the next token from after prompt + prefix (the engine's
    processing in float32, renormalised in float64: what multinomial samples from)."""
    out = {}
    for length in sorted({len(p) for p in prefixes}):
        group = [p for p in prefixes if len(p) == length]
        logits = model(input_ids=torch.tensor([prompt_ids + list(p) for p in group])).logits[:, -1]
        probs = logits_to_probs(logits, sampling).double()
        out.update(zip(group, probs / probs.sum(-1, keepdim=True)))
    return out


def likely_sequences(model, prompt_ids: list[int], sampling: SamplingConfig, eos, floor: float) -> list:
    """Every sequence of the first ``LENGTH`` tokens (shorter: ending with EOS) whose probability is at
    least ``floor``: an enumeration pruned at the floor (a prefix below it has no extension above it)."""
    found, frontier = [], {(): 1.0}
    for _ in range(LENGTH):
        probs = next_probs(model, prompt_ids, list(frontier), sampling)
        grown = {}
        for prefix, mass in frontier.items():
            row = mass * probs[prefix]
            for token in torch.nonzero(row >= floor).flatten().tolist():
                if token in eos:
                    found.append(prefix + (token,))
                else:
                    grown[prefix + (token,)] = float(row[token])
        frontier = grown
    return sorted(found + list(frontier))


def law_of(model, prompt_ids: list[int], sampling: SamplingConfig, cells: list) -> dict:
    """The exact law of the outcome (one of ``cells`` or ``OTHER``) when every token is drawn from ``model``
    with ``sampling``: a cell's mass is the product of its tokens' probabilities, ``OTHER`` the rest."""
    prefixes = sorted({cell[:i] for cell in cells for i in range(len(cell))})
    probs = next_probs(model, prompt_ids, prefixes, sampling)
    law = {cell: math.prod(float(probs[cell[:i]][cell[i]]) for i in range(len(cell))) for cell in cells}
    law[OTHER] = max(0.0, 1.0 - sum(law.values()))
    return law


def outcome(tokens: list[int], cells: set) -> tuple | str:
    first = tuple(tokens[:LENGTH])  # a request that met EOS ended there
    return first if first in cells else OTHER


def exact_laws(tiny_pair) -> dict:
    """name -> (cells, target law, [wrong laws]): per sampling configuration."""
    ids = tiny_pair.tokenizer.encode(PROMPT)
    out = {}
    for name, sampling in SAMPLINGS.items():
        cells = likely_sequences(tiny_pair.target, ids, sampling, tiny_pair.eos_token_ids, 3 / NUM_SAMPLES)
        wrong = [
            law_of(tiny_pair.target, ids, WRONG[name], cells),
            law_of(tiny_pair.draft, ids, sampling, cells),
        ]
        out[name] = (cells, law_of(tiny_pair.target, ids, sampling, cells), wrong)
    return out


@pytest.fixture(scope="module")
def laws(tiny_pair):
    return exact_laws(tiny_pair)


def test_the_laws_are_distributions_with_enough_cells(laws):
    for cells, law, wrong in laws.values():
        for each in [law, *wrong]:
            assert abs(sum(each.values()) - 1.0) < 1e-9 and min(each.values()) >= 0
        assert len(cells) >= 15 and law[OTHER] < 0.75  # enough of the law is resolved for the test to bite


# ------------------------------------------------------------------------------------- a busy batch
def decode_in_busy_batch(
    pair,
    draft_mode: str,
    subjects: list[BatchRequest],
    roles: list | None = None,
    batches: list | None = None,
    lookup: LookupConfig | None = None,
    **config,
) -> tuple[list, list]:
    """Decode ``subjects`` in one ``BatchedEngine`` (``SUBJECT_SLOTS`` at a time, refilled as they finish)
    next to background requests (the other slots, refilled until the last subject finishes; ``roles``: what
    they run, by default ``BACKGROUND[draft_mode]``; ``config``: other ``BatchConfig`` fields, the engine appended
    to ``batches``). Returns the subjects' results in order, and (request, tokens) of every finished greedy
    background request."""
    batch = BatchedEngine(
        pair, dataclasses.replace(BATCH, engine=EngineConfig(draft_mode, lookup=lookup), **config)
    )
    if batches is not None:
        batches.append(batch)
    roles = roles or BACKGROUND[draft_mode]
    queue = list(enumerate(subjects))[::-1]
    results: list = [None] * len(subjects)
    running: dict[int, int] = {}  # rid -> subject index
    background: dict[int, BatchRequest] = {}
    greedy_done, made = [], 0
    while queue or running:
        while queue and len(running) < SUBJECT_SLOTS:
            index, request = queue.pop()
            running[batch.add(request)] = index
        while len(background) < BATCH.max_requests - SUBJECT_SLOTS:
            controller, sampling, max_new = roles[made % len(roles)]
            prompt = BACKGROUND_PROMPTS[made % len(BACKGROUND_PROMPTS)]
            request = BatchRequest(prompt, max_new, controller(), seed=made, sampling=sampling)
            background[batch.add(request)] = request
            made += 1
        for event in batch.step():
            if not event.finished:
                continue
            result = batch.result(event.rid)  # raises what a failed request failed with
            if event.rid in running:
                results[running.pop(event.rid)] = result
            else:
                request = background.pop(event.rid)
                if request.sampling.greedy:
                    greedy_done.append((request, result.tokens))
    return results, greedy_done


def spy_grants(monkeypatch) -> list:
    """Record every (asked, granted) of the row cap (``engine.batch.grant_rows``, unchanged)."""
    seen = []
    real = batch_module.grant_rows

    def recording(wants, budget):
        granted = real(wants, budget)
        seen.extend(zip(wants, granted))
        return granted

    monkeypatch.setattr(batch_module, "grant_rows", recording)
    return seen


def subject_requests(prompt_ids: list[int], controllers: list, seed0: int) -> list[BatchRequest]:
    """``NUM_SAMPLES`` requests per sampling configuration, interleaved, controllers (factories) cycled."""
    names = list(SAMPLINGS)
    return [
        BatchRequest(
            prompt_ids,
            MAX_NEW,
            controllers[(i // len(names)) % len(controllers)](),
            seed=seed0 + i,
            sampling=SAMPLINGS[names[i % len(names)]],
        )
        for i in range(NUM_SAMPLES * len(names))
    ]


def outcomes_by_sampling(subjects: list[BatchRequest], results: list, laws: dict) -> dict:
    out: dict[str, list] = {name: [] for name in SAMPLINGS}
    names = {id(s): n for n, s in SAMPLINGS.items()}
    for request, result in zip(subjects, results):
        name = names[id(request.sampling)]
        out[name].append(outcome(result.tokens, set(laws[name][0])))
    return out


CASES = [*SUBJECTS, "learned", "learned+lookup"]
"""The static subjects in each draft mode, then the learned policy deciding for every request, then a learned
policy that also decides context lookup (``lookup_gate``) in an engine whose lookup proposes often."""
LAW_LOOKUP = LookupConfig(min_ngram=1, max_ngram=2, max_tokens=3, long_ngram=0, long_tokens=0, max_requests=1)
"""The learned+lookup case's context lookup: short n-grams (the tiny pair's byte tokens repeat), and a load limit
of one request that a policy deciding lookup is not held to."""


@pytest.fixture(scope="module")
def learned_policy(tmp_path_factory) -> LearnedController:
    """A load-aware learned chain policy, read with ``load_policy`` from a policy file of the current feature
    version (6 and on: the observations carry the step's load) exported for the tiny pair the way the policy
    file tests make one (``tests_helpers.make_policy``: random actors, in milliseconds; it also decides depth
    0, so it can switch drafting off), with a fixed cost profile that has a batch axis, so its device
    features follow the load too (``DeviceAtLoad``). A trained run's policy would carry a measured profile,
    and its decisions, so the samples, would change from run to run."""
    path = tmp_path_factory.mktemp("learned") / "policy.pt"
    profile = batched_profile().to_dict()
    make_policy(path, seed=LEARNED_SEED, tree_width=1, max_depth=4, depth_zero=True, profile=profile)
    policy = load_policy(path)
    assert FEATURE_VERSION >= 6 and policy.loads is not None and policy.decides_depth_zero
    return policy


@pytest.fixture(scope="module")
def gated_policy(tmp_path_factory) -> LearnedController:
    """``learned_policy``'s twin that also decides context lookup (``lookup_gate``: its depth actor answers
    ``use_lookup``, seeing the proposal's length and the request's lookup acceptance)."""
    path = tmp_path_factory.mktemp("gated") / "policy.pt"
    profile = batched_profile().to_dict()
    make_policy(
        path, seed=LEARNED_SEED, tree_width=1, max_depth=4, depth_zero=True, profile=profile, lookup_gate=True
    )
    policy = load_policy(path)
    assert policy.decides_lookup and policy.loads is not None
    return policy


def case_setup(case: str, request) -> tuple[str, list, list]:
    """(draft mode, subjects' controller factories, background roles) of a case."""
    if not case.startswith("learned"):
        return case, SUBJECTS[case], BACKGROUND[case]
    policy = request.getfixturevalue("gated_policy" if case == "learned+lookup" else "learned_policy")

    def own() -> LearnedController:
        return copy.copy(policy)  # a controller instance serves one request at a time

    roles = [(c if sampling.greedy else own, sampling, n) for c, sampling, n in BACKGROUND[LEARNED_MODE]]
    return LEARNED_MODE, [own], roles


def steady_arrivals(monkeypatch) -> None:
    """The batch's arrival rate (``LoadState.arrival_rate``) read on a clock that advances 50 ms at every
    reading instead of the wall clock: a learned policy observes the rate, and the samples, so the verdicts,
    must be the same at every run."""
    ticks = itertools.count(0.0, 0.05)
    monkeypatch.setattr(batch_module, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))


def spy_learned_decisions(monkeypatch) -> list:
    """Record every draft-or-stop decision a learned controller makes in a batch: (depth, its decision, the
    decision it makes on the same state alone, load None); ``LearnedController.should_continue`` unchanged."""
    seen = []
    real = LearnedController.should_continue

    def recording(self, state):
        decision = real(self, state)
        if state.load is not None:
            seen.append((state.depth, decision, real(self, dataclasses.replace(state, load=None))))
        return decision

    monkeypatch.setattr(LearnedController, "should_continue", recording)
    return seen


def assert_decided_by_the_load(decisions: list, results: list) -> None:
    """The learned case is not vacuous: the subjects drafted at some cycles and decoded autoregressively at
    others (the policy's depth-0 decision), and the load changed its decisions (on the same state alone it
    decides otherwise at a share of them)."""
    cycles = [c for result in results for c in result.cycles if not c.lookup]
    drafted = sum(c.depth > 0 for c in cycles)
    assert 0.1 * len(cycles) < drafted < 0.9 * len(cycles), (drafted, len(cycles))
    starts = [(decision, alone) for depth, decision, alone in decisions if depth == 0]
    changed = sum(decision != alone for decision, alone in starts)
    assert 0.05 * len(starts) < changed < 0.95 * len(starts), (changed, len(starts))


@pytest.mark.parametrize("case", CASES)
def test_sampled_requests_in_a_busy_batch_have_the_target_law(
    tiny_pair, laws, law_check, monkeypatch, request, case
):
    draft_mode, controllers, roles = case_setup(case, request)
    grants = spy_grants(monkeypatch)
    decisions = spy_learned_decisions(monkeypatch)
    steady_arrivals(monkeypatch)
    ids = tiny_pair.tokenizer.encode(PROMPT)
    subjects = subject_requests(ids, controllers, seed0=1_000_000 * (1 + CASES.index(case)))
    lookup = LAW_LOOKUP if case == "learned+lookup" else None
    answers = []
    real_use = LearnedController.use_lookup
    monkeypatch.setattr(
        LearnedController, "use_lookup", lambda self, s: answers.append(real_use(self, s)) or answers[-1]
    )
    results, greedy = decode_in_busy_batch(tiny_pair, draft_mode, subjects, roles, lookup=lookup)

    # the row cap bit: many verifications were granted fewer nodes than asked, some all they asked
    asked = [(w, g) for w, g in grants if w > 0]
    cut = sum(g < w for w, g in asked)
    assert cut > len(asked) // 8 and sum(0 < g == w for w, g in asked) > len(asked) // 20, (cut, len(asked))
    if case == "learned":
        assert_decided_by_the_load(decisions, results)
    if case == "learned+lookup":  # the policy was asked about proposals and some lookup cycles ran; the tiny
        # pair samples near-uniform bytes, so proposals are rare (greedy gating: tests/envs/test_lookup_gate.py)
        looked = sum(c.lookup for r in results for c in r.cycles)
        assert len(answers) >= 20 and sum(answers) > 0 and looked > 0, (len(answers), sum(answers), looked)
    else:
        assert not answers
    # the background's greedy requests decoded as alone (a sanity check of the batch they shared)
    alone = {}
    for req, tokens in greedy:
        key = (req.prompt, req.max_new_tokens, repr(req.controller))
        if key not in alone:
            alone[key] = (
                SpeculativeEngine(tiny_pair).generate(req.prompt, req.max_new_tokens, req.controller).tokens
            )
        assert tokens == alone[key], key
    assert len(greedy) >= 4

    for name, samples in outcomes_by_sampling(subjects, results, laws).items():
        _, law, wrong = laws[name]
        result = law_check(samples, law)
        assert result.num_samples == NUM_SAMPLES and result.agrees, (name, result)
        for other in wrong:  # negative controls: the same samples, wrong laws
            rejected = law_check(samples, other)
            assert rejected.pvalue < 1e-3 and not rejected.agrees, (name, rejected)


def verify_chain_resample_from_target(target_probs, draft_probs, draft_tokens, generator):
    """The WRONG rule (negative control): on a rejection, draw from the target instead of the residual."""
    num_accepted, next_token = verify_chain(target_probs, draft_probs, draft_tokens, generator)
    if num_accepted < draft_tokens.shape[0]:
        next_token = int(torch.multinomial(target_probs[num_accepted], 1, generator=generator))
    return num_accepted, next_token


@pytest.mark.parametrize("case", ["sampled", "learned"])
def test_a_batch_with_the_wrong_recovery_rule_is_caught(
    tiny_pair, laws, law_check, monkeypatch, request, case
):
    """The same batch, checker and sample size must reject sampled-draft verification that recovers from the
    target instead of the residual after a rejection (the classic wrong rule), with the static subjects and
    with the learned policy deciding."""
    draft_mode, controllers, roles = case_setup(case, request)
    monkeypatch.setattr(engine_module, "verify_chain", verify_chain_resample_from_target)
    steady_arrivals(monkeypatch)
    name = "T1-top_k4-top_p0.8"  # at temperature 0.3 draft and target disagree too rarely for 450 samples
    ids = tiny_pair.tokenizer.encode(PROMPT)
    seed0 = 9_000_000 + 1_000_000 * ["sampled", "learned"].index(case)
    subjects = [s for s in subject_requests(ids, controllers, seed0) if s.sampling is SAMPLINGS[name]]
    results, _ = decode_in_busy_batch(tiny_pair, draft_mode, subjects, roles)
    samples = outcomes_by_sampling(subjects, results, laws)[name]
    result = law_check(samples, laws[name][1])
    assert result.pvalue < 1e-3 and not result.agrees, result


def test_sampled_requests_served_from_the_prefix_cache_have_the_target_law(tiny_pair, laws, law_check):
    """The same busy batch with the prefix cache on (``engine.prefix_cache``): every subject after the first
    takes its prompt but the last token (target and draft KV) from the cache, and the answers of the requests
    before it are cached too; the law is the target's, and the wrong laws are still rejected."""
    name = "T1-top_k4-top_p0.8"
    ids = tiny_pair.tokenizer.encode(PROMPT)
    subjects = [
        s for s in subject_requests(ids, SUBJECTS["sampled"], 7_000_000) if s.sampling is SAMPLINGS[name]
    ]
    batches: list = []
    results, greedy = decode_in_busy_batch(
        tiny_pair, "sampled", subjects, batches=batches, prefix_cache_bytes=1 << 26
    )
    stats = batches[0].prefix.stats
    assert sum(r.cached_tokens == len(ids) - 1 for r in results) > 0.9 * len(results)
    assert stats.draft_hit_tokens > 0 and batches[0].prefix.target.entries > len(ids)
    alone = {}
    for req, tokens in greedy:  # the greedy background requests, hits or not, decode as alone
        key = (req.prompt, req.max_new_tokens)
        if key not in alone:
            alone[key] = (
                SpeculativeEngine(tiny_pair).generate(req.prompt, req.max_new_tokens, req.controller).tokens
            )
        assert tokens == alone[key], key
    samples = outcomes_by_sampling(subjects, results, laws)[name]
    _, law, wrong = laws[name]
    result = law_check(samples, law)
    assert result.num_samples == NUM_SAMPLES and result.agrees, result
    for other in wrong:
        rejected = law_check(samples, other)
        assert rejected.pvalue < 1e-3 and not rejected.agrees, rejected
