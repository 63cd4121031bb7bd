"""The prefix cache (``engine.prefix_cache``) in the batched engine: a request served from the cache gives the
tokens of the same request cold, on every hit shape, at any load; on the native decoder its cache holds the
bits its own prefill computes (with a wrong-prefix negative control); rejected drafts never enter; memory
stays within the budget, least recently used first, pinned entries kept; and the radix tree itself."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.backends.attention import MAX_ROWWISE_ROWS
from engine.backends.kvcache import new_cache
from engine.backends.models import load_pair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest, MemoryFull
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.errors import InputError
from engine.prefix_cache import PrefixCache, common_prefix
from engine.scheduling import plan_prefills

pytestmark = pytest.mark.usefixtures("single_thread")

KQUANT = bool(shutil.which("c++"))
CACHE = 1 << 28
DOC = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 4
CONTROLLERS = [lambda: None, lambda: StaticController(3), lambda: StaticController(2, 4, 2)]


@pytest.fixture(scope="module", params=["float32"] + (["kquant"] if KQUANT else []))
def pair(request):
    return load_pair("tiny", weights=request.param, device="cpu")


@pytest.fixture(scope="module")
def kq_pair():
    if not KQUANT:
        pytest.skip("no C++ compiler: the native decoder cannot be built")
    return load_pair("tiny", weights="kquant", device="cpu")


def drain(batch: BatchedEngine, rids: list[int]) -> list:
    out = {}
    while batch.active or batch.pending:
        for ev in batch.step():
            if ev.finished:
                out[ev.rid] = batch.result(ev.rid)
    return [out[r] for r in rids]


def run(batch: BatchedEngine, requests: list[BatchRequest]) -> list:
    return drain(batch, [batch.add(r) for r in requests])


def cold(pair, prompt, n, controller):
    return SpeculativeEngine(pair).generate(prompt, n, controller).tokens


def ids(pair, text: str) -> list[int]:
    return pair.tokenizer.encode(text)


# ------------------------------------------------------------------------------------------- hit shapes
@pytest.mark.parametrize("make", CONTROLLERS, ids=["ar", "chain3", "tree"])
def test_every_hit_shape_gives_the_cold_tokens(pair, make):
    batch = BatchedEngine(pair, BatchConfig(max_requests=4, prefix_cache_bytes=CACHE))
    first = ids(pair, DOC + "Question: what jumps?")
    (r1,) = run(batch, [BatchRequest(first, 20, make())])
    assert r1.cached_tokens == 0 and r1.tokens == cold(pair, first, 20, make())
    # a hit inside the prompt: the document shared, another question
    inside = ids(pair, DOC + "Question: who sleeps?")
    (r2,) = run(batch, [BatchRequest(inside, 20, make())])
    shared = common_prefix(first, inside, len(inside))
    assert r2.cached_tokens == shared > 0 and r2.tokens == cold(pair, inside, 20, make())
    # a hit covering the whole prompt: everything but its last token (whose logits give the first token)
    (r3,) = run(batch, [BatchRequest(first, 20, make())])
    assert r3.cached_tokens == len(first) - 1 and r3.tokens == r1.tokens
    # a prefix that ends inside an earlier answer: the next turn of the first conversation
    turn = first + r1.tokens[:-1] + ids(pair, " Say more.")
    (r4,) = run(batch, [BatchRequest(turn, 20, make())])
    assert r4.cached_tokens == len(first) + len(r1.tokens) - 1  # all but the answer's last token, never run
    assert r4.tokens == cold(pair, turn, 20, make())
    batch.prefix.target.check()
    batch.prefix.draft.check()


def test_hits_next_to_other_requests_at_any_load(pair):
    """Hits and cold prompts mixed in one busy batch: every greedy request decodes as alone."""
    batch = BatchedEngine(pair, BatchConfig(max_requests=8, max_rows=24, prefix_cache_bytes=CACHE))
    prompts = [ids(pair, DOC + f"Item {i}: {'abc' * i}") for i in range(6)]
    warm = run(batch, [BatchRequest(prompts[0], 12, StaticController(2))])
    assert warm[0].cached_tokens == 0
    specs = [(p, CONTROLLERS[i % 3]) for i, p in enumerate(prompts)] + [(ids(pair, "x = 1"), CONTROLLERS[1])]
    rids = [batch.add(BatchRequest(p, 16, c())) for p, c in specs[:3]]
    batch.step()
    rids += [batch.add(BatchRequest(p, 16, c())) for p, c in specs[3:]]
    results = drain(batch, rids)
    for (p, c), r in zip(specs, results):
        assert r.tokens == cold(pair, p, 16, c()), p[-8:]
    assert sum(r.cached_tokens > 0 for r in results) >= 5


def test_a_prefix_still_being_filled_is_waited_for_not_computed_twice(pair):
    """Two requests sharing a long prefix arrive together: the second starts once the first's prompt is in,
    and takes it from the cache."""
    batch = BatchedEngine(
        pair,
        BatchConfig(max_requests=4, max_prefill_tokens=16, idle_prefill_tokens=512, prefix_cache_bytes=CACHE),
    )
    a, b = ids(pair, DOC + "First?"), ids(pair, DOC + "Second one?")
    ra, rb = run(batch, [BatchRequest(a, 12, StaticController(3)), BatchRequest(b, 12, StaticController(3))])
    assert rb.cached_tokens == common_prefix(a, b, len(b)) > 100
    assert ra.tokens == cold(pair, a, 12, StaticController(3))
    assert rb.tokens == cold(pair, b, 12, StaticController(3))
    stats = batch.prefix.stats
    assert stats.queries == 2 and stats.hit_tokens == rb.cached_tokens


def test_cancelled_mid_prefill_keeps_what_it_computed(kq_pair):
    pair = kq_pair  # prompts are prefilled in chunks on the native decoder
    batch = BatchedEngine(
        pair, BatchConfig(max_prefill_tokens=16, idle_prefill_tokens=16, prefix_cache_bytes=CACHE)
    )
    prompt = ids(pair, DOC + "Cancel me?")
    rid = batch.add(BatchRequest(prompt, 12, StaticController(2)))
    batch.step()
    batch.step()  # two chunks in
    assert batch.pending == [rid]
    batch.cancel(rid)
    assert batch.prefix.target.entries == 32
    (again,) = run(batch, [BatchRequest(prompt, 12, StaticController(2))])
    assert again.cached_tokens == 32
    assert again.tokens == cold(pair, prompt, 12, StaticController(2))


def test_after_evictions_hits_stay_exact_and_the_cache_stays_in_its_size(pair):
    probe = BatchedEngine(pair, BatchConfig(prefix_cache_bytes=CACHE))
    entry = sum(probe._entry_bytes)
    size = 300 * entry  # room for about one conversation of the two models
    batch = BatchedEngine(pair, BatchConfig(prefix_cache_bytes=size))
    prompts = [ids(pair, f"Topic {i}. " + DOC[: 150 + 10 * i]) for i in range(5)]
    for _ in range(2):
        for p in prompts:
            (r,) = run(batch, [BatchRequest(p, 10, StaticController(2))])
            assert r.tokens == cold(pair, p, 10, StaticController(2))
            assert batch.prefix.bytes <= size
    assert batch.prefix.evictions > 0
    batch.prefix.target.check()
    batch.prefix.draft.check()


def test_rejected_drafts_never_enter_the_cache(kq_pair):
    """After speculative requests (rejections included), every position the tree holds is a committed
    token's, with the bits a cold prefill of those tokens computes."""
    batch = BatchedEngine(kq_pair, BatchConfig(prefix_cache_bytes=CACHE))
    prompt = ids(kq_pair, DOC[:120])
    (r,) = run(batch, [BatchRequest(prompt, 40, StaticController(4, 4, 3))])
    assert sum(c.num_drafted - c.accepted for c in r.cycles) > 5  # some drafts were rejected
    committed = prompt + r.tokens
    for tree in (batch.prefix.target, batch.prefix.draft):
        model = kq_pair.target if tree is batch.prefix.target else kq_pair.draft
        (leaf,) = [n for n in tree._nodes() if not n.children]
        path, node = [], leaf
        while node is not tree.root:
            path.insert(0, node)
            node = node.parent
        held = [t for n in path for t in n.tokens]
        assert held == committed[: len(held)] and len(held) >= len(committed) - 2
        ref = new_cache(model)
        SpeculativeEngine(kq_pair).forward(model, held, 0, ref)
        kv = torch.cat([n.kv for n in path], dim=3)
        for layer, layer_kv in zip(ref.layers, kv):
            assert torch.equal(layer.keys[0], layer_kv[0]) and torch.equal(layer.values[0], layer_kv[1])


def test_a_hit_holds_the_bits_of_its_own_prefill(kq_pair):
    """On the native decoder the target cache of a request served from the cache is bitwise its cache
    cold; the same check catches a hit taken from another prompt (negative control)."""
    prompt = ids(kq_pair, DOC + "Bits?")
    other = list(prompt)
    other[5] = (other[5] + 1) % kq_pair.vocab_size  # one token off, early

    def prefilled_cache(seed_prompt):
        batch = BatchedEngine(kq_pair, BatchConfig(prefix_cache_bytes=CACHE))
        if seed_prompt is not None:
            run(batch, [BatchRequest(seed_prompt, 4, None)])
        rid = batch.add(BatchRequest(prompt, 4, None))
        while batch.pending:
            batch.step()
        return batch._slots[rid].req.target_cache, batch._slots[rid].cached

    cache_cold, n0 = prefilled_cache(None)
    cache_hit, n1 = prefilled_cache(prompt + [7, 8])
    assert n0 == 0 and n1 == len(prompt) - 1
    for a, b in zip(cache_cold.layers, cache_hit.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # negative control: the tree's KV of another prompt loaded as if it matched this one
    batch = BatchedEngine(kq_pair, BatchConfig(prefix_cache_bytes=CACHE))
    run(batch, [BatchRequest(other, 4, None)])
    tree = batch.prefix.target
    real_match = tree.match
    tree.match = lambda ids_, limit=None: real_match(other, limit)
    rid = batch.add(BatchRequest(prompt, 4, None))
    while batch.pending:
        batch.step()
    wrong = batch._slots[rid].req.target_cache
    assert any(not torch.equal(a.keys, b.keys) for a, b in zip(cache_cold.layers, wrong.layers))


# --------------------------------------------------------------------------------------------- memory
def test_the_cache_gives_way_to_requests_within_the_kv_budget(pair):
    probe = BatchedEngine(pair)
    probe.add(BatchRequest(ids(pair, DOC), 16, StaticController(2)))
    need = probe.kv_reserved
    budget = int(need * 2.5)
    batch = BatchedEngine(pair, BatchConfig(max_requests=4, max_kv_bytes=budget, prefix_cache_bytes=CACHE))
    for i in range(6):  # each leaves its conversation in the cache; later ones evict it
        p = ids(pair, f"{i} " + DOC)
        rids = [batch.add(BatchRequest(p, 16, StaticController(2)))]
        while batch.active or batch.pending:
            batch.step()
            assert batch.kv_reserved + batch.prefix_bytes <= budget
        (r,) = [batch.result(rid) for rid in rids]
        assert r.tokens == cold(pair, p, 16, StaticController(2))
    assert batch.prefix.evictions > 0 and batch.prefix_bytes > 0
    # two fit next to each other only when the cache gives way
    a = batch.add(BatchRequest(ids(pair, "A " + DOC), 16, None))
    b = batch.add(BatchRequest(ids(pair, "B " + DOC), 16, None))
    assert batch.kv_reserved + batch.prefix_bytes <= budget
    drain(batch, [a, b])


def test_a_pinned_prefix_is_not_evicted_and_memory_full_says_so(pair):
    probe = BatchedEngine(pair)
    probe.add(BatchRequest(ids(pair, DOC), 16, None))
    need = probe.kv_reserved
    batch = BatchedEngine(
        pair, BatchConfig(max_requests=4, max_kv_bytes=int(need * 2.2), prefix_cache_bytes=CACHE)
    )
    run(batch, [BatchRequest(ids(pair, DOC), 16, None)])
    again = ids(pair, DOC + "again")
    hit = batch.prefix.target.match(again, len(again) - 1).length
    assert hit > 100
    rid = batch.add(BatchRequest(again, 16, None))  # matches the cached prompt: pinned until it starts
    with pytest.raises(MemoryFull, match="retry"):
        batch.add(BatchRequest(ids(pair, "Z" + DOC), 16, None))
    assert batch.prefix.evictions > 0  # what was not pinned (the first answer's tokens) went
    assert batch.prefix.target.match(again, len(again) - 1).length == hit  # the pinned prompt stayed
    (r,) = drain(batch, [rid])
    assert r.cached_tokens == hit


def test_bad_prefix_cache_settings_are_refused():
    with pytest.raises(InputError, match="prefix_cache_bytes"):
        BatchConfig(prefix_cache_bytes=-1)
    with pytest.raises(InputError, match="idle_prefill_tokens"):
        BatchConfig(idle_prefill_tokens=0)


# ------------------------------------------------------------------------------------ prefill budget
def test_the_prefill_budget_follows_the_load(pair):
    batch = BatchedEngine(pair, BatchConfig(max_prefill_tokens=16, idle_prefill_tokens=512))
    assert batch.prefill_budget(0) == (512, 512)
    assert batch.prefill_budget(1) == (MAX_ROWWISE_ROWS, MAX_ROWWISE_ROWS)
    assert batch.prefill_budget(2) == (MAX_ROWWISE_ROWS // 2, MAX_ROWWISE_ROWS)
    assert batch.prefill_budget(8) == (16, MAX_ROWWISE_ROWS)
    fixed = BatchedEngine(pair, BatchConfig(max_prefill_tokens=16, idle_prefill_tokens=16))
    assert {fixed.prefill_budget(d)[0] for d in range(5)} == {16}
    smaller = BatchedEngine(pair, BatchConfig(max_prefill_tokens=64, idle_prefill_tokens=16))
    assert smaller.prefill_budget(0) == (64, 64) and smaller.prefill_budget(3) == (64, MAX_ROWWISE_ROWS)
    assert plan_prefills([600, 40], 512, True, 512) == [512]
    assert plan_prefills([300, 400], 512, True, 512) == [300, 212]
    assert plan_prefills([300], 512, True, MAX_ROWWISE_ROWS) == [MAX_ROWWISE_ROWS]


def test_a_lone_prompt_prefills_in_few_steps_and_decodes_as_alone(kq_pair):
    pair = kq_pair  # prompts are prefilled in chunks on the native decoder
    prompt = ids(pair, DOC * 2)
    batch = BatchedEngine(pair, BatchConfig(max_prefill_tokens=16, idle_prefill_tokens=512))
    rid = batch.add(BatchRequest(prompt, 12, StaticController(2)))
    steps = 0
    while batch.pending:
        batch.step()
        steps += 1
    assert steps == -(-len(prompt) // 512)
    (r,) = drain(batch, [rid])
    assert r.tokens == cold(pair, prompt, 12, StaticController(2))


# ------------------------------------------------------------------------------------------ the tree
def _fake_cache(tokens: list[int], layers: int = 2):
    """A cache whose KV at position i is the token id there (to check what the tree hands back)."""

    class Layer:
        pass

    cache = type("C", (), {})()
    cache.layers = []
    for layer_index in range(layers):
        layer = Layer()
        t = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None] + 1000 * layer_index
        layer.keys, layer.values = t.clone(), -t.clone()
        cache.layers.append(layer)
    return cache


def test_the_radix_tree_splits_shares_and_evicts_least_recently_used():
    cache = PrefixCache((8, 8), max_bytes=8 * 20)
    tree = cache.target
    assert cache.insert(tree, [1, 2, 3, 4, 5], _fake_cache([1, 2, 3, 4, 5])) == 5
    assert cache.insert(tree, [1, 2, 3, 9, 9, 9], _fake_cache([1, 2, 3, 9, 9, 9])) == 3  # shares 1 2 3
    tree.check()
    m = tree.match([1, 2, 3, 9, 9, 7])
    assert m.length == 5 and [len(n.tokens) for n, _ in m.path] == [3, 3]
    kv = torch.cat([n.kv[:, :, :, :take] for n, take in m.path], dim=3)
    assert kv[0, 0, 0, :, 0].tolist() == [1, 2, 3, 9, 9] and kv[1, 1, 0, :, 0].tolist() == [
        -1001,
        -1002,
        -1003,
        -1009,
        -1009,
    ]
    assert tree.match([1, 2, 3, 4, 5], limit=4).length == 4
    assert tree.match([2, 1]).length == 0
    # full: the least recently used leaf goes first ([4 5], last used before [9 9 9] was matched)
    assert cache.insert(tree, [7] * 14, _fake_cache([7] * 14)) == 14
    assert tree.match([1, 2, 3, 4, 5]).length == 3 and tree.match([1, 2, 3, 9, 9, 9]).length == 6
    assert cache.evictions == 1 and cache.bytes <= cache.max_bytes
    tree.check()
    # a pinned leaf stays; with no room at all the insert is cut
    pinned = tree.match([7] * 14)
    tree.pin(pinned)
    assert cache.insert(tree, [5] * 30, _fake_cache([5] * 30)) == 20 - 14
    assert tree.match([7] * 14).length == 14
    tree.unpin(pinned)
    tree.check()


def test_a_tree_without_tensors_counts_the_same():
    with_kv, bare = PrefixCache((4, 4), 4 * 50), PrefixCache((4, 4), 4 * 50, with_kv=False)
    seqs = [[1, 2, 3, 4], [1, 2, 5], [6] * 20, [1, 2, 3, 4, 8, 8], [9] * 30]
    for s in seqs:
        a = with_kv.insert(with_kv.target, s, _fake_cache(s))
        b = bare.insert(bare.target, s, None)
        assert a == b and with_kv.bytes == bare.bytes
        assert with_kv.target.match(s).length == bare.target.match(s).length
    bare.target.check()
