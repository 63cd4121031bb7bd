"""The lean Qwen2 forward (engine.backends.lean) is bitwise transformers' forward on every shape the engine uses:
one row, chains of rows, tree masks, kept rows; on dense and kquant weights."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from engine.backends import lean
from engine.backends.kvcache import keep_entries, new_cache
from engine.backends.models import load_pair
from engine.tree import tree_attention_mask

pytestmark = pytest.mark.usefixtures("single_thread")

FORMATS = ["float32", "int4"] + (["kquant"] if shutil.which("c++") else [])


def _hf(model, ids, positions, cache, mask=None, keep=0):
    out = model(
        input_ids=torch.tensor([ids]),
        position_ids=torch.tensor([positions]),
        attention_mask=mask,
        cache=cache,
        use_cache=True,
        logits_to_keep=keep,
    )
    return out.logits[0]


def _lean(model, ids, positions, cache, mask=None, keep=0):
    return lean.forward(model, torch.tensor([ids]), torch.tensor([positions]), cache, mask, keep)


@pytest.mark.parametrize("fmt", FORMATS)
def test_lean_forward_is_bitwise_the_transformers_forward(fmt, monkeypatch):
    monkeypatch.setattr(lean, "NATIVE", False)  # kquant models take the native decoder otherwise
    pair = load_pair("tiny", weights=fmt, device="cpu")
    model = pair.target
    assert lean.supports(model)
    prompt = list(range(3, 40))
    caches = {}
    for name, fn in (("hf", _hf), ("lean", _lean)):
        cache = new_cache(model)
        _hf(model, prompt, list(range(len(prompt))), cache)  # the prefill is transformers' in both
        caches[name] = (cache, fn)
    n = len(prompt)
    # a tree of 5 nodes: 0 -> (1, 2), 1 -> 3, 2 -> 4; each node sees itself and its ancestors
    parents, depths = [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2]
    allowed = np.eye(5, dtype=bool)
    for i, p in enumerate(parents):
        while p >= 0:
            allowed[i, p], p = True, parents[p]
    steps = [  # (ids, positions, tree?, keep)
        ([7], [n], False, 0),
        ([7, 8, 9, 10], [n + 1, n + 2, n + 3, n + 4], False, 0),
        ([11, 12, 13], [n + 5, n + 6, n + 7], False, 1),
        ([20, 21, 22, 23, 24], [n + 8 + d for d in depths], True, 0),
    ]
    for ids, positions, tree, keep in steps:
        results = []
        for cache, fn in caches.values():
            mask = (
                tree_attention_mask(cache.get_seq_length(), allowed, torch.float32, "cpu") if tree else None
            )
            results.append(fn(model, ids, positions, cache, mask, keep))
        assert torch.equal(results[0], results[1]), (fmt, ids)
    hf_cache, lean_cache = caches["hf"][0], caches["lean"][0]
    for a, b in zip(hf_cache.layers, lean_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    keep_entries(lean_cache, n, [n])  # surgery on a lean-built cache works as on any other
    assert lean_cache.get_seq_length() == n + 1


def test_lean_forward_refuses_what_it_does_not_cover():
    pair = load_pair("tiny", device="cpu")
    with pytest.raises(ValueError, match="at most"):
        _lean(pair.target, list(range(100)), list(range(100)), new_cache(pair.target))
    pair.target.set_attn_implementation("sdpa")
    assert not lean.supports(pair.target)  # another attention: transformers' forward is used
