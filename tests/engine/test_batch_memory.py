"""Memory-bounded admission in the batched engine (``engine.batch``, module docstring "Memory"): each request
reserves the KV memory it can reach; its caches are allocated at exactly that capacity and never grow past it;
``BatchConfig.max_kv_bytes`` bounds the reservations together (``MemoryFull`` until one finishes) and refuses a
request that could never fit (``InputError``)."""

from __future__ import annotations

import pytest

from engine.backends.kvcache import CacheFull, cache_bytes, kv_bytes_per_entry, new_cache
from engine.backends.models import load_pair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest, MemoryFull, RequestFailed
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.errors import InputError

pytestmark = pytest.mark.usefixtures("single_thread")

SPECS = [  # (prompt, max_new_tokens, controller): chains, a tree, autoregressive
    ("def main():", 30, lambda: StaticController(3)),
    ("The quick brown fox", 24, lambda: StaticController(2, 4, 2)),
    ("x", 40, lambda: None),
    ("import numpy as np\n", 20, lambda: StaticController(4, 4, 3)),
    ("while True:", 28, lambda: StaticController(1)),
]


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny", device="cpu")


def _need(pair, prompt, n, controller) -> int:
    probe = BatchedEngine(pair)
    probe.add(BatchRequest(prompt, n, controller))
    return probe.kv_reserved


def test_the_budget_is_never_exceeded_requests_queue_and_finish_exact(pair):
    needs = [_need(pair, p, n, c()) for p, n, c in SPECS]
    budget = sorted(needs)[-1] + sorted(needs)[-2]  # two at a time at most, the largest two included
    batch = BatchedEngine(pair, BatchConfig(max_requests=5, max_kv_bytes=budget))
    line, rids, refused, peak = list(range(len(SPECS))), {}, 0, 0
    out = {}
    while line or batch.active or batch.pending:
        while line:  # admission in order, as the server's worker does
            p, n, c = SPECS[line[0]]
            try:
                rid = batch.add(BatchRequest(p, n, c()))
            except MemoryFull as err:
                assert "retry" in str(err)
                refused += 1
                break
            rids[rid] = line.pop(0)
        for ev in batch.step():
            if ev.finished:
                out[rids[ev.rid]] = batch.result(ev.rid).tokens
        held = sum(
            cache_bytes(s.req.target_cache) + cache_bytes(s.req.draft_cache)
            if s.req is not None
            else cache_bytes(s.cache)  # a prompt prefilled in part: its target cache so far
            for s in batch._slots.values()
        )  # the buffers themselves
        assert held == batch.kv_allocated() <= batch.kv_reserved <= budget
        peak = max(peak, held)
    assert refused > 0  # the budget did hold requests back (negative control of the queueing)
    assert peak > max(needs) // 2  # and the caches were really allocated
    for i, (p, n, c) in enumerate(SPECS):
        assert out[i] == SpeculativeEngine(pair).generate(p, n, c()).tokens, SPECS[i]
    assert batch.kv_reserved == 0


def test_a_request_past_the_whole_budget_is_refused_with_what_it_needs(pair):
    need = _need(pair, "def main():", 200, StaticController(3))
    batch = BatchedEngine(pair, BatchConfig(max_kv_bytes=need - 1))
    with pytest.raises(InputError, match=r"needs .*KiB of KV cache.*more than the whole budget") as err:
        batch.add(BatchRequest("def main():", 200, StaticController(3)))
    assert not isinstance(err.value, MemoryFull)
    rid = batch.add(BatchRequest("def main():", 100, StaticController(3)))  # a smaller one fits
    assert batch.kv_reserved < need and batch.pending == [rid]
    with pytest.raises(InputError):
        BatchConfig(max_kv_bytes=0)


def test_the_reservation_is_the_buffers_a_full_length_request_holds(pair):
    """A request decoded to its last token holds exactly its target reservation (allocated at once), and the
    reservation counts layers x kv heads x head dim x 2 x element size per position."""
    config = pair.target.config
    per = (
        config.num_hidden_layers
        * config.num_key_value_heads
        * (config.hidden_size // config.num_attention_heads)
    )
    assert kv_bytes_per_entry(pair.target) == per * 2 * 4  # float32 activations
    batch = BatchedEngine(pair)
    prompt = batch.engine._prompt_ids("abc")
    rid = batch.add(BatchRequest(prompt, 30, None, ignore_eos=True))
    batch.step()
    (slot,) = batch._slots.values()
    assert slot.entries == (len(prompt) + 30 - 1, 0)
    assert batch.kv_allocated() == batch.kv_reserved == slot.entries[0] * kv_bytes_per_entry(pair.target)
    while batch.active:
        batch.step()
    assert len(batch.result(rid).tokens) == 30


def test_a_cache_never_grows_past_its_capacity(pair):
    cache = new_cache(pair.target, 5)
    engine = SpeculativeEngine(pair)
    engine.forward(pair.target, [1, 2, 3], 0, cache)
    engine.forward(pair.target, [4, 5], 3, cache)
    assert cache_bytes(cache) == 5 * kv_bytes_per_entry(pair.target)
    with pytest.raises(CacheFull, match="past the 5 reserved"):
        engine.forward(pair.target, [6], 5, cache)


def test_a_reservation_too_small_fails_that_request_alone(pair, monkeypatch):
    """Negative control of the bound: a reservation one position short of what the request reaches ends it
    with CacheFull (its buffers never double), and the request next to it is untouched."""
    real = BatchedEngine.kv_entries

    def short(self, prompt_len, max_new, controller, tree_cap):
        target, draft = real(self, prompt_len, max_new, controller, tree_cap)
        return (target - 1, draft) if prompt_len == 1 else (target, draft)

    monkeypatch.setattr(BatchedEngine, "kv_entries", short)
    batch = BatchedEngine(pair)
    a = batch.add(BatchRequest("x", 20, None, ignore_eos=True))
    b = batch.add(BatchRequest("def main():", 20, StaticController(2)))
    while batch.active or batch.pending:
        batch.step()
        assert batch.kv_allocated() <= batch.kv_reserved
    with pytest.raises(CacheFull):
        batch.result(a)
    assert (
        batch.result(b).tokens
        == SpeculativeEngine(pair).generate("def main():", 20, StaticController(2)).tokens
    )
    assert not issubclass(CacheFull, RequestFailed)
