"""The native decoder (engine/backends/csrc/decoder.cpp, through engine.backends.lean) for kquant models: batch invariant
(rows of a chain or a tree bitwise the one-row steps that would decode them), close to the lean forward of
the same weights, and clear about bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.backends import lean, native
from engine.backends.kvcache import new_cache
from engine.backends.models import load_pair
from engine.tree import tree_attention_mask

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not native.available(), reason="the compiled kernels cannot be built here"),
]

PROMPT = [(7 * i) % 50 + 5 for i in range(23)]
# a tree of 6 nodes: 0 -> (1, 2), 1 -> 3, 2 -> (4, 5); a node sees itself and its ancestors
PARENTS = [-1, 0, 0, 1, 2, 2]


@pytest.fixture(scope="module")
def model():
    pair = load_pair("tiny", weights="kquant", device="cpu")
    assert lean.native_decoder(pair.target) is not None
    return pair.target


def _forward(model, ids, positions, cache, mask=None, keep=0):
    return lean.forward(model, torch.tensor([ids]), torch.tensor([positions]), cache, mask, keep)


def _prefilled(model):
    cache = new_cache(model)
    _forward(model, PROMPT, list(range(len(PROMPT))), cache)
    return cache


def _path(node, parents):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _allowed(parents):
    allowed = np.eye(len(parents), dtype=bool)
    for i in range(len(parents)):
        for a in _path(i, parents):
            allowed[i, a] = True
    return allowed


def test_native_decoder_is_batch_invariant_on_chains(model):
    n, ids = len(PROMPT), [30, 31, 32, 33, 34, 35]
    cache = _prefilled(model)
    chain = _forward(model, ids, list(range(n, n + len(ids))), cache)
    cache1 = _prefilled(model)
    steps = torch.cat([_forward(model, [t], [n + i], cache1) for i, t in enumerate(ids)])
    assert torch.equal(chain, steps)
    for a, b in zip(cache.layers, cache1.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _tree_rows(model, ids, parents):
    n = len(PROMPT)
    cache = _prefilled(model)
    depths = [len(_path(i, parents)) - 1 for i in range(len(parents))]
    mask = tree_attention_mask(n, _allowed(parents), torch.float32, "cpu")
    return _forward(model, ids, [n + d for d in depths], cache, mask)


def test_native_decoder_tree_rows_are_the_one_row_steps_of_their_paths(model):
    n, ids = len(PROMPT), [30, 31, 32, 33, 34, 35]
    tree = _tree_rows(model, ids, PARENTS)
    for node in range(len(PARENTS)):
        cache = _prefilled(model)
        for depth, i in enumerate(_path(node, PARENTS)):
            logits = _forward(model, [ids[i]], [n + depth], cache)
        assert torch.equal(tree[node], logits[0]), node


def test_tree_rows_depend_on_the_keys_they_see(model):
    # negative control: the same ids under another tree (node 4 under node 1) change node 4's row only
    other = [-1, 0, 0, 1, 1, 2]
    a, b = (
        _tree_rows(model, [30, 31, 32, 33, 34, 35], PARENTS),
        _tree_rows(model, [30, 31, 32, 33, 34, 35], other),
    )
    assert torch.equal(a[:4], b[:4]) and torch.equal(a[5], b[5])
    assert not torch.equal(a[4], b[4])


def test_native_decoder_is_close_to_the_lean_forward(model, monkeypatch):
    n = len(PROMPT)
    steps = [([7], [n], 0), ([8, 9, 10], [n + 1, n + 2, n + 3], 0), ([11, 12], [n + 4, n + 5], 1)]
    results = {}
    for use_native in (True, False):
        monkeypatch.setattr(lean, "NATIVE", use_native)
        cache = new_cache(model)
        model(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True)  # the same prefill for both
        results[use_native] = [_forward(model, ids, pos, cache, keep=keep) for ids, pos, keep in steps]
    for a, b in zip(results[True], results[False], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-4 * float(b.abs().max()), rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_native_decoder_refuses_bad_inputs(model):
    decoder = lean.native_decoder(model)
    config = model.config
    hidden, kv, d = config.hidden_size, config.num_key_value_heads, model.model.layers[0].self_attn.head_dim
    layers = decoder.num_layers()
    x, cos = torch.zeros(2, hidden), torch.ones(2, d)
    buffers = [torch.zeros(1, kv, 8, d) for _ in range(layers)]
    none = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="sees 9 keys"):
        decoder.forward(x, cos, cos, buffers, buffers, 0, torch.tensor([1, 9]), none)
    with pytest.raises(RuntimeError, match="cache buffers"):
        decoder.forward(x, cos, cos, buffers, buffers, 7, torch.tensor([1, 2]), none)
    with pytest.raises(RuntimeError, match="ascending"):
        decoder.forward(
            x, cos, cos, buffers, buffers, 0, torch.tensor([1, 2]), torch.tensor([[0, 0], [1, 0]])
        )
    with pytest.raises(RuntimeError, match=r"x must be float32"):
        decoder.forward(torch.zeros(2, hidden + 1), cos, cos, buffers, buffers, 0, torch.tensor([1, 2]), none)


# Fingerprint of the native decoder's outputs (hidden states and cache entries) on fixed random layers:
# prompt rows, a chain and a tree over a cache, head sizes on and off the 16-wide dot product path.
# Recorded traces hold what the decoder computed: a change that alters any bit must increment
# engine.backends.native.KERNEL_NUMERICS and then update this fingerprint (a restructuring that keeps every bit,
# e.g. a faster attention loop, must leave it as it is).
DECODER_FINGERPRINT = "87ee09ee51145dc8"


def _random_decoder(rng, hidden, heads, kv_heads, head_dim, intermediate, layers=2, ops=None):
    from engine.backends.kquant import quantize_k4, quantize_k6, tiled_parts

    decoder = (ops or native.kernels()).Decoder(hidden, heads, kv_heads, head_dim, intermediate, 1e-6)
    shapes = [
        (heads * head_dim, hidden),
        (kv_heads * head_dim, hidden),
        (kv_heads * head_dim, hidden),
        (hidden, heads * head_dim),
        (intermediate, hidden),
        (intermediate, hidden),
        (hidden, intermediate),
    ]
    for _ in range(layers):
        parts, biases = [], []
        for i, (n, k) in enumerate(shapes):
            w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
            parts.append(tiled_parts(quantize_k6(w) if i in (2, 6) else quantize_k4(w), k))
            biases.append(
                torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.1) if i < 3 else None
            )
        norms = [torch.from_numpy((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)) for _ in "ab"]
        decoder.add_layer(norms[0], norms[1], parts, biases)
    return decoder


def _decoder_digest(ops=None) -> str:
    """The fingerprint of the decoder in ``ops`` (a compiled extension; default: the machine's build)."""
    import hashlib

    rng = np.random.RandomState(11)  # numpy's legacy generator: the same numbers on every machine
    digest = hashlib.sha256()
    for hidden, heads, kv_heads, head_dim, inter in (
        (256, 4, 2, 64, 384),
        (256, 6, 2, 128, 256),
        (96, 4, 4, 24, 160),
    ):
        decoder = _random_decoder(rng, hidden, heads, kv_heads, head_dim, inter, ops=ops)
        cap, n = 64, 40
        keys = [torch.zeros(1, kv_heads, cap, head_dim) for _ in range(2)]
        values = [torch.zeros(1, kv_heads, cap, head_dim) for _ in range(2)]

        none = torch.empty(0, dtype=torch.long)
        # a prompt, a chain, then a tree over the cache: 0 -> (1, 2), 2 -> 3; row r sees the prompt, the
        # chain's first row and its path
        paths = [[0], [0, 1], [0, 2], [0, 2, 3]]
        index = torch.zeros((4, n + 1 + 3), dtype=torch.long)
        counts = []
        for r, path in enumerate(paths):
            seen = list(range(n + 1)) + [n + 3 + p for p in path]
            index[r, : len(seen)] = torch.tensor(seen)
            counts.append(len(seen))
        steps = [
            (n, 0, torch.arange(1, n + 1), none),
            (3, n, torch.arange(n + 1, n + 4), none),
            (4, n + 3, torch.tensor(counts), index),
        ]
        for q, past, seen_counts, seen_index in steps:
            x = torch.from_numpy(rng.standard_normal((q, hidden)).astype(np.float32))
            angles = torch.from_numpy(rng.uniform(0, 6.3, (q, head_dim // 2)).astype(np.float32)).repeat(1, 2)
            h = decoder.forward(x, angles.cos(), angles.sin(), keys, values, past, seen_counts, seen_index)
            digest.update(h.numpy().tobytes())
        for t in keys + values:
            digest.update(t.numpy().tobytes())
    return digest.hexdigest()[:16]


def test_native_decoder_arithmetic_matches_the_recorded_fingerprint():
    if not native.kernels().simd():
        pytest.skip("the fingerprint is of the SIMD paths (AVX-512, AVX2); this CPU runs the portable one")
    assert _decoder_digest() == DECODER_FINGERPRINT, (
        "the decoder's outputs changed: increment engine.backends.native.KERNEL_NUMERICS (recorded traces no longer "
        "match) and update DECODER_FINGERPRINT"
    )


def test_avx2_decoder_computes_the_avx512_bits(avx2_kernels):
    """The AVX2 build (what a CPU without AVX-512 compiles) gives the decoder's fingerprint bit for bit, so traces
    and profiles recorded on one hold on the other. On an AVX-512 machine this compiles the AVX2 path apart."""
    assert _decoder_digest(avx2_kernels) == DECODER_FINGERPRINT


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """A process killed while loading the kernels leaves torch's build lock; torch would wait on it forever."""
    import os
    import time

    from engine.backends.native import clear_stale_lock

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a build in progress keeps its lock
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert not clear_stale_lock(tmp_path)  # nothing to remove
