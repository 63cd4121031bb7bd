"""The batched engine (engine.batch) and the batched forward (engine.batch_forward): each request of a batch
decodes exactly as ``generate`` of it alone; caps and bad input refused cleanly."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import SamplingConfig, SpeculativeEngine, StaticController, load_pair
from engine.backends import lean
from engine.backends.kvcache import new_cache
from engine.batch import BatchConfig, BatchedEngine, BatchRequest, CapacityError, grant_rows
from engine.batch_forward import Rows, forward_rows
from engine.errors import InputError

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
    """At most ``max_prefill_tokens`` prompt tokens are prefilled in a step (at least one request, whatever its
    length); a later, shorter prompt does not overtake a waiting one; the tokens are each request's alone."""
    prompts = [pair.encode(text) for text in ("a" * 12, "e" * 40, "d", "b" * 5)]  # token ids
    lengths = [len(p) for p in prompts]
    budget = lengths[0] + lengths[2]  # the 3rd would fit next to the 1st, but the 2nd waits before it
    assert lengths[1] > budget and lengths[2] + lengths[3] <= budget  # the 2nd goes alone, over budget
    batch = BatchedEngine(pair, BatchConfig(max_requests=5, max_rows=16, max_prefill_tokens=budget))
    rids = [batch.add(BatchRequest(p, 6)) for p in prompts]
    prefilled = []
    while batch.pending:
        before = set(batch.pending)
        batch.step()
        prefilled.append([r for r in rids if r in before and r not in batch.pending])
    assert prefilled == [[rids[0]], [rids[1]], [rids[2], rids[3]]]
    got = _drain(batch, rids)
    for p, tokens in zip(prompts, got):
        assert tokens == _alone(pair, p, None, 6)
    with pytest.raises(InputError):
        BatchConfig(max_prefill_tokens=0)


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
        if model is pair.target and len(items) > 1:
            items = [Rows(it.ids, [p + 5 for p in it.positions], it.cache, it.mask, it.keep) for it in items]
        return real(model, items, device)

    monkeypatch.setattr(batch_module, "forward_rows", shifted)
    batch = BatchedEngine(pair, BatchConfig(max_requests=4))
    rids = [batch.add(BatchRequest(p, 16, StaticController(2))) for p in PROMPTS]
    got = _drain(batch, rids)
    assert any(tokens != _alone(pair, p, StaticController(2), 16) for p, tokens in zip(PROMPTS, got))
