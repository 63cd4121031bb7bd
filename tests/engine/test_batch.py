"""The batched engine (engine.batch) and the batched forward (engine.batch_forward): each request of a batch
decodes exactly as ``generate`` of it alone; caps and bad input refused cleanly."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.backends import lean
from engine.backends.attention import MAX_ROWWISE_ROWS
from engine.backends.kvcache import new_cache
from engine.backends.models import load_pair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest, CapacityError
from engine.batch_forward import Rows, forward_rows
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.errors import InputError
from engine.sampling import SamplingConfig
from engine.scheduling import grant_rows
from tests_helpers import late_starter

pytestmark = pytest.mark.usefixtures("single_thread")

KQUANT = bool(shutil.which("c++"))
PROMPTS = ["def main():", "The quick brown fox", "x", "import numpy as np\nimport torch\n"]
CONTROLLERS = [
    lambda: None,
    lambda: StaticController(1),
    lambda: StaticController(3),
    lambda: StaticController(2, 4, 2),
]


@pytest.fixture(scope="module", params=["float32"] + (["kquant"] if KQUANT else []))
def pair(request):
    return load_pair("tiny", weights=request.param, device="cpu")


def _alone(pair, prompt, controller, n, sampling=None, seed=0):
    return SpeculativeEngine(pair, sampling).generate(prompt, n, controller, seed=seed).tokens


def _drain(batch, rids):
    out = {}
    while batch.active or batch.pending:
        for ev in batch.step():
            if ev.finished:
                out[ev.rid] = batch.result(ev.rid).tokens
    return [out[r] for r in rids]


def test_greedy_batch_tokens_are_each_request_alone(pair):
    n = 20
    batch = BatchedEngine(pair, BatchConfig(max_requests=6, max_rows=64))
    specs = [(p, c, n - 3 * i) for i, (p, c) in enumerate(zip(PROMPTS, CONTROLLERS))]
    rids = [batch.add(BatchRequest(p, m, c())) for p, c, m in specs[:2]]
    batch.step()
    batch.step()  # two more join mid-way
    rids += [batch.add(BatchRequest(p, m, c())) for p, c, m in specs[2:]]
    got = _drain(batch, rids)
    for (p, c, m), tokens in zip(specs, got):
        assert tokens == _alone(pair, p, c(), m), (p, c())
        assert len(tokens) <= m


def test_row_cap_changes_speed_not_tokens(pair):
    batch = BatchedEngine(pair, BatchConfig(max_requests=4, max_rows=5))
    rids = [batch.add(BatchRequest(p, 16, StaticController(4))) for p in PROMPTS]
    got = _drain(batch, rids)
    for p, tokens in zip(PROMPTS, got):
        assert tokens == _alone(pair, p, StaticController(4), 16)


def test_sampled_requests_reproduce_their_seeds_alone(pair):
    sampling = [
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.7, top_k=20),
        SamplingConfig(0.9, top_p=0.9),
    ]
    batch = BatchedEngine(pair, BatchConfig(max_requests=3, max_rows=64))
    rids = [
        batch.add(BatchRequest(p, 16, StaticController(2), seed=7 + i, sampling=s))
        for i, (p, s) in enumerate(zip(PROMPTS, sampling))
    ]
    got = _drain(batch, rids)
    for i, (p, s) in enumerate(zip(PROMPTS, sampling)):
        assert got[i] == _alone(pair, p, StaticController(2), 16, s, seed=7 + i)


def test_batched_forward_rows_are_each_sequence_alone_and_depend_on_their_cache(pair):
    model = pair.target
    native = lean.native_decoder(model) is not None
    lengths = [5, 23, 40]
    prompts = [[(7 * i + 3 * j) % 200 for i in range(n)] for j, n in enumerate(lengths)]

    def prefilled():
        caches = [new_cache(model) for _ in prompts]
        for ids, cache in zip(prompts, caches):
            forward_rows(model, [Rows(ids, range(len(ids)), cache)], "cpu")
        return caches

    def step(caches, swap=False):
        items = [Rows([9, 10], [len(p), len(p) + 1], c) for p, c in zip(prompts, caches)]
        if swap:  # negative control: sequence 1's rows on sequence 2's positions
            items[1] = Rows([9, 10], [lengths[2], lengths[2] + 1], caches[1])
        return forward_rows(model, items, "cpu", native=native)

    batched = step(prefilled())
    for j in range(len(prompts)):
        caches = prefilled()
        alone = forward_rows(
            model, [Rows([9, 10], [lengths[j], lengths[j] + 1], caches[j])], "cpu", native=native
        )[0]
        if native:
            assert torch.equal(alone, batched[j])
        else:  # float32 products differ by rounding with the row count (module docstring)
            torch.testing.assert_close(alone, batched[j], atol=1e-4, rtol=0)
    wrong = step(prefilled(), swap=True)
    assert not torch.equal(wrong[1], batched[1])
    assert torch.equal(wrong[0], batched[0]) or not native


def test_caps_cancel_and_bad_input(pair):
    batch = BatchedEngine(pair, BatchConfig(max_requests=2, max_rows=8))
    a = batch.add(BatchRequest("abc", 8))
    batch.step()
    b = batch.add(BatchRequest("def", 8, stop_token_ids={ord("e")}))
    with pytest.raises(CapacityError):
        batch.add(BatchRequest("ghi", 8))
    for bad in (
        BatchRequest("", 8),
        BatchRequest("x", 0),
        BatchRequest("x", 4, seed=-1),
        BatchRequest("x", 4, stop_token_ids=[10**6]),
    ):
        with pytest.raises(InputError):
            batch.add(bad)
    assert batch.active == [a] and batch.pending == [b]
    batch.cancel(a)
    assert batch.active == [] and batch.pending == [b]
    c = batch.add(BatchRequest("abc", 8))
    results = {}
    while batch.active or batch.pending:
        for ev in batch.step():
            if ev.finished:
                results[ev.rid] = batch.result(ev.rid)
    assert results[c].tokens == _alone(pair, "abc", None, 8)
    stopped = results[b]
    alone = _alone(pair, "def", None, 8)
    if ord("e") in alone:  # the stop token ends it there, committed
        assert stopped.finish_reason == "stop" and stopped.tokens == alone[: alone.index(ord("e")) + 1]
    else:
        assert stopped.tokens == alone
    with pytest.raises(InputError):
        batch.result(b)  # handed over once
    with pytest.raises(InputError):
        batch.cancel(12345)


def test_prefills_take_a_token_budget_a_step_in_admission_order(pair):
    """At most ``max_prefill_tokens`` prompt tokens are prefilled a step, in admission order: a prompt starts only
    once every earlier one is in (a later, shorter prompt never overtakes), and the budget is used up while
    prompts wait. Chunked (the native decoder): any prompt in pieces of at most ``MAX_ROWWISE_ROWS``; the torch
    path: whole prompts while they fit, at least one a step. The tokens are each request's alone."""
    prompts = [pair.encode(text) for text in ("a" * 12, "e" * 40, "d", "b" * 5)]  # token ids
    lengths = [len(p) for p in prompts]
    budget = lengths[0] + lengths[2]
    assert lengths[1] > budget  # the 2nd is over budget by itself
    fixed = BatchConfig(max_requests=5, max_rows=16, max_prefill_tokens=budget, idle_prefill_tokens=budget)
    batch = BatchedEngine(pair, fixed)  # a fixed budget (the budget that follows the load: test_prefix_cache)
    rids = [batch.add(BatchRequest(p, 6)) for p in prompts]
    filled = [0] * 4
    steps = []
    while batch.pending:
        batch.step()
        now = [batch._slots[r].filled if r in batch.pending else n for r, n in zip(rids, lengths)]
        steps.append([b - a for a, b in zip(filled, now)])
        filled = now
        for i in range(3):  # admission order: nothing of a prompt before the one ahead of it is in
            assert filled[i + 1] == 0 or filled[i] == lengths[i]
    left = sum(lengths)
    for took in steps:
        if batch._chunked:
            assert sum(took) == min(budget, left) and max(took) <= MAX_ROWWISE_ROWS
        else:
            assert all(t in (0, n) for t, n in zip(took, lengths))  # whole prompts
            assert sum(took) <= budget or sum(t > 0 for t in took) == 1
        left -= sum(took)
    if not batch._chunked:
        assert [[r for r, t in zip(rids, took) if t] for took in steps] == [
            [rids[0]],
            [rids[1]],
            [rids[2], rids[3]],
        ]
    got = _drain(batch, rids)
    for p, tokens in zip(prompts, got):
        assert tokens == _alone(pair, p, None, 6)
    with pytest.raises(InputError):
        BatchConfig(max_prefill_tokens=0)


LONG = "Summarise this, then answer: " + " ".join(f"item {i} is {i * 7 % 13}" for i in range(40))


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(pair):
    """A long prompt arriving among running requests: chunked, every step of its prefill still gives each running
    request its next tokens, and the prefill takes the steps its chunks need; every request's tokens are its
    tokens alone (greedy and a sampled seed), whatever the chunk boundaries."""
    long_ids = pair.encode(LONG)
    assert len(long_ids) > 2 * MAX_ROWWISE_ROWS
    budget = 24
    fixed = BatchConfig(max_requests=4, max_rows=16, max_prefill_tokens=budget, idle_prefill_tokens=budget)
    batch = BatchedEngine(pair, fixed)
    sampled = SamplingConfig(temperature=0.8)
    specs = [(PROMPTS[0], StaticController(2), SamplingConfig()), (PROMPTS[1], None, sampled)]
    rids = [batch.add(BatchRequest(p, 120, c, seed=3, sampling=sm, ignore_eos=True)) for p, c, sm in specs]
    while batch.pending:
        batch.step()
    long_rid = batch.add(BatchRequest(long_ids, 8, StaticController(1), seed=5, sampling=sampled))
    prefill_steps = 0
    while long_rid in batch.pending:
        events = {ev.rid: ev for ev in batch.step()}
        prefill_steps += 1
        for rid in rids:  # no running request waits for the prefill
            assert events[rid].tokens or events[rid].finished
    expected = -(-len(long_ids) // budget) if batch._chunked else 1
    assert prefill_steps == expected
    got = _drain(batch, rids + [long_rid])
    for (p, c, sm), tokens in zip(specs, got):
        alone = BatchedEngine(pair, BatchConfig(max_requests=1, max_rows=16, max_prefill_tokens=512))
        rid = alone.add(BatchRequest(p, 120, c, seed=3, sampling=sm, ignore_eos=True))
        assert tokens == _drain(alone, [rid])[0]
    assert (
        got[2] == SpeculativeEngine(pair, sampled).generate(long_ids, 8, StaticController(1), seed=5).tokens
    )


@pytest.mark.skipif(not KQUANT, reason="needs the compiled kernels (a C++ compiler)")
def test_prefill_in_chunks_is_bitwise_the_prefill_whole():
    """On the native decoder a prompt forwarded in chunks, at any boundaries, leaves the same cache bits and
    gives the same logits as one forward of it (which itself runs in chunks of ``MAX_ROWWISE_ROWS``), and
    those are transformers' forward's within float error; a chunk at the wrong positions changes them
    (negative control)."""
    from engine.forward import forward_logits

    pair = load_pair("tiny", weights="kquant", device="cpu")
    model, device = pair.target, pair.device
    ids = pair.encode(LONG)
    n = len(ids)

    def run(bounds, shift_at=None):
        cache = new_cache(model)
        cuts = [0, *bounds, n]
        logits = None
        for a, b in zip(cuts, cuts[1:]):
            shift = 3 if a == shift_at else 0
            logits = forward_logits(model, ids[a:b], range(a + shift, b + shift), cache, device, keep=1)
        return logits, cache

    whole, whole_cache = run([])
    for bounds in ([7], [64, 65], [1, 40, 100, 101], list(range(13, n, 13))):
        logits, cache = run(bounds)
        assert torch.equal(logits, whole), bounds
        for mine, ref in zip(cache.layers, whole_cache.layers):
            assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    shifted, _ = run([40, 100], shift_at=40)
    assert not torch.equal(shifted, whole)
    reference = forward_logits(model, ids, range(n), None, device, keep=1)  # transformers' forward
    assert torch.allclose(whole, reference, atol=1e-3 * float(reference.abs().max()))


def test_grant_rows_water_fills_in_order():
    assert grant_rows([3, 1, 0], 10) == [3, 1, 0]
    assert grant_rows([8, 8, 1], 6) == [3, 2, 1]
    assert grant_rows([4, 4], 0) == [0, 0]
    assert sum(grant_rows([5, 9, 2, 7], 11)) == 11


def test_the_comparison_catches_a_batch_that_mixes_up_positions(pair, monkeypatch):
    # negative control: a broken batch whose target forwards shift every batched request's positions
    import engine.batch as batch_module

    real = batch_module.forward_rows

    def shifted(model, items, device):
        # the decoding rows of shared target forwards (not the prompts, which ride there too: one shift for all of
        # a sequence's rows would be invisible to the rotary embedding)
        if model is pair.target and len(items) > 1:
            items = [
                Rows(
                    it.ids,
                    [p + 5 for p in it.positions] if it.positions[0] else it.positions,
                    it.cache,
                    it.mask,
                    it.keep,
                )
                for it in items
            ]
        return real(model, items, device)

    monkeypatch.setattr(batch_module, "forward_rows", shifted)
    batch = BatchedEngine(pair, BatchConfig(max_requests=4))
    rids = [batch.add(BatchRequest(p, 16, StaticController(2))) for p in PROMPTS]
    got = _drain(batch, rids)
    assert any(tokens != _alone(pair, p, StaticController(2), 16) for p, tokens in zip(PROMPTS, got))


def _whole_catch_up(pair, tokens, prompt_len, length):
    """The draft cache a whole catch-up leaves over ``tokens[:length]``: the prompt in one forward (the lazy
    prefill), then the rest in one forward (the first draft step's pending tokens), as ``generate`` alone runs
    them."""
    from engine.forward import forward_logits

    cache = new_cache(pair.draft)
    forward_logits(pair.draft, tokens[:prompt_len], range(prompt_len), cache, pair.device, keep=1)
    forward_logits(
        pair.draft, tokens[prompt_len:length], range(prompt_len, length), cache, pair.device, keep=1
    )
    return cache


@pytest.mark.parametrize("bound", [8, 16, 10**6])
def test_under_load_the_draft_catches_up_in_chunks(pair, monkeypatch, bound):
    """A request whose controller holds back (depth 0) while another runs, then drafts: under load its draft
    catches up on the prompt and the pending tokens ``draft_catch_up_tokens`` at a time, one chunk a cycle next
    to an autoregressive step (a catch-up cycle), so no step runs a draft forward of more than that many of its
    rows; its draft cache ends as a whole catch-up would leave it (bitwise on the native decoder), every
    request's tokens are its tokens alone, and alone the whole catch-up runs at once. Negative control: a huge
    bound gives the one big forward of before."""
    import engine.batch as batch_module
    from engine.inputs import EngineConfig

    real = batch_module.forward_rows
    rows_of: dict[int, list[int]] = {}  # draft cache id -> rows of each draft forward item on it

    def counting(model, items, device):
        if model is pair.draft:
            for it in items:
                rows_of.setdefault(id(it.cache), []).append(len(it.ids))
        return real(model, items, device)

    monkeypatch.setattr(batch_module, "forward_rows", counting)
    snapshots = {}  # draft cache id -> (tokens, draft_len, cache copy) at its first draft tree

    real_expand = SpeculativeEngine._expand

    def expand(self, tree, parents, scores, logits, width, sampled, probs, req):
        if len(tree) == 0 and id(req.draft_cache) not in snapshots:
            layers = [(x.keys.clone(), x.values.clone()) for x in req.draft_cache.layers]
            snapshots[id(req.draft_cache)] = (list(req.tokens), req.draft_len, layers)
        return real_expand(self, tree, parents, scores, logits, width, sampled, probs, req)

    monkeypatch.setattr(SpeculativeEngine, "_expand", expand)
    config = EngineConfig(draft_catch_up_tokens=bound, validate_caches=True)
    batch = BatchedEngine(pair, BatchConfig(max_requests=2, max_rows=32, engine=config))
    skip, prompt = 30, LONG[:80]
    busy = batch.add(BatchRequest(PROMPTS[0], 160, StaticController(1), ignore_eos=True))
    late = batch.add(BatchRequest(prompt, 60, late_starter(skip, depth=2), ignore_eos=True))
    records = {}
    caches = {}
    while batch.active or batch.pending:
        if late in batch.active:
            caches[late] = id(batch._slots[late].req.draft_cache)
        for ev in batch.step():
            if ev.finished:
                records[ev.rid] = batch.result(ev.rid)
    prompt_len = len(pair.tokenizer.encode(prompt))
    assert prompt_len > MAX_ROWWISE_ROWS
    late_rows = rows_of[caches[late]]
    cycles = records[late].cycles
    catch_ups = [c for c in cycles if c.catch_up]
    behind = prompt_len + skip + 1  # the prompt and the tokens of the held-back cycles, the first one too
    if bound < behind:
        assert max(late_rows) <= bound  # never more than a chunk of its catch-up in a forward
        assert len(catch_ups) == -(-(behind - bound) // (bound - 1))  # each chunk lets one more token in
        assert all(c.depth == 0 and c.catch_up == bound and c.emitted == 1 for c in catch_ups)
        assert cycles[skip : skip + len(catch_ups)] == catch_ups and cycles[skip + len(catch_ups)].depth > 0
    else:  # negative control: the whole catch-up in one cycle: the prompt, then every pending token
        assert not catch_ups and late_rows[:2] == [prompt_len, skip + 1]
    assert records[busy].cycles[-1].context_len > cycles[-1].context_len  # it ran all along
    for rid, text, ctrl, n in (
        (busy, PROMPTS[0], StaticController(1), 160),
        (late, prompt, late_starter(skip, depth=2), 60),
    ):
        alone = SpeculativeEngine(pair, config=EngineConfig(validate_caches=True)).generate(text, n, ctrl)
        # alone it stops at an EOS, which the batch ignores (to keep both running)
        assert records[rid].tokens[: len(alone.tokens)] == alone.tokens
        assert len(alone.tokens) == n or alone.finish_reason == "eos"
        if rid == late:
            assert not any(c.catch_up for c in alone.cycles)  # alone: the whole catch-up at once
            assert alone.cycles[skip].depth > 0
    tokens, length, layers = snapshots[caches[late]]
    whole = _whole_catch_up(pair, tokens, prompt_len, length)
    for (keys, values), ref in zip(layers, whole.layers):
        if lean.native_decoder(pair.draft) is not None:
            assert torch.equal(keys, ref.keys) and torch.equal(values, ref.values)
        else:  # the torch path: float32 products round with the row count (engine.batch_forward)
            torch.testing.assert_close(keys, ref.keys, atol=1e-4, rtol=0)
            torch.testing.assert_close(values, ref.values, atol=1e-4, rtol=0)


def test_the_catch_up_bound_is_a_positive_integer():
    from engine.inputs import EngineConfig

    assert EngineConfig().draft_catch_up_tokens == 16
    for bad in (0, -1, 2.5, "16", True):
        with pytest.raises(InputError, match="draft_catch_up_tokens"):
            EngineConfig(draft_catch_up_tokens=bad)
