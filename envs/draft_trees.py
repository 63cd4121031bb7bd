"""Draft trees for many positions per draft forward (``envs.record_traces``): block tree masks over a shared
prefix cache, nodes that several positions share forwarded once, children chosen by the engine's own
``score_logprobs`` and ``expand_topk`` (``draft_trees``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.backends.kvcache import keep_entries, new_cache
from engine.backends.pair import ModelPair
from engine.forward import forward_logits
from engine.sampling import SamplingConfig, check_finite, score_logprobs
from engine.tree import DraftTree, expand_topk
from envs.recording import DEFAULT_CHUNK, check_record_settings


@torch.inference_mode()
def draft_trees(
    pair: ModelPair,
    prompt_ids: Sequence[int],
    tokens: Sequence[int],
    sampling: SamplingConfig,
    max_depth: int,
    tree_width: int,
    chunk: int = DEFAULT_CHUNK,
    progress: Callable[[int], None] | None = None,
) -> list[DraftTree]:
    """The draft tree at every position t of ``tokens`` (root ``tokens[t]``, committed prefix
    ``prompt_ids + tokens[:t+1]``), drafted to ``max_depth`` with width ``tree_width``.

    Chunks of positions [c0, c1) go in order; the cache holds the prefix ``seq[:n0 + c1]`` the chunk's
    last position needs (the others mask the rest), then the chunk's nodes, cropped off afterwards.
    Within a chunk a node is identified by its *canonical* form: a node of position t whose path starts
    with the trajectory's own next tokens is the node of a later position (same context, same position
    id), so it is forwarded once and shared (on two real prompts at depth 8, width 4, only 36% and 47% of
    the forwards remain). ``progress(n)`` is called after each chunk of n positions.
    """
    check_record_settings(max_depth=max_depth, tree_width=tree_width, chunk=chunk)
    model, device = pair.draft, pair.device
    seq = [int(t) for t in prompt_ids] + [int(t) for t in tokens]
    n0, trees = len(prompt_ids), []
    cache = new_cache(model)
    forward_logits(model, seq[:n0], range(n0), cache, device, keep=1)  # the prompt; tokens[0] comes next
    for c0 in range(0, len(tokens), chunk):
        c1 = min(c0 + chunk, len(tokens))
        # roots: row i predicts the children of tokens[c0 + i]; the forward extends the cache to the prefix
        logits = forward_logits(
            model, seq[n0 + c0 : n0 + c1], range(n0 + c0, n0 + c1), cache, device
        )  # [C, V]
        check_finite(logits, "draft")
        rows = {(t, ()): logits[t - c0] for t in range(c0, c1)}  # canonical node -> its logits row
        slots: dict[tuple, int] = {}  # canonical node -> its cache entry after the prefix
        chunk_trees = [DraftTree() for _ in range(c0, c1)]
        frontiers = [[-1] for _ in chunk_trees]  # -1: the root
        for _ in range(max_depth):
            keys = [
                [_canonical(seq, n0, c1, c0 + i, tree, node) for node in frontier]
                for i, (tree, frontier) in enumerate(zip(chunk_trees, frontiers))
            ]
            missing = list(dict.fromkeys(k for ks in keys for k in ks if k not in rows))
            if missing:
                rows.update(_forward_nodes(model, missing, slots, n0, n0 + c1, cache, pair.dtype, device))
            for i, (tree, parents) in enumerate(zip(chunk_trees, frontiers)):
                parent_logits = torch.stack([rows[k] for k in keys[i]])  # [P, V]: the engine's call shape
                scores = [tree.scores[n] if n >= 0 else 0.0 for n in parents]
                logprobs = score_logprobs(parent_logits, sampling)
                frontiers[i] = expand_topk(tree, parents, scores, logprobs, tree_width)
        keep_entries(cache, n0 + c1, [])  # drop the chunk's nodes
        trees.extend(chunk_trees)
        if progress is not None:
            progress(c1 - c0)
    return trees


def _canonical(seq: list[int], n0: int, end: int, t: int, tree: DraftTree, node: int) -> tuple:
    """(t', path') for the node of position t: strip path tokens equal to the trajectory's next tokens
    (the node of position t with path (tokens[t+1], *rest) is the node of t+1 with path rest); t' < end."""
    path = tuple(tree.tokens[n] for n in tree.path_to(node)) if node >= 0 else ()
    while path and t + 1 < end and path[0] == seq[n0 + t + 1]:
        path, t = path[1:], t + 1
    return t, path


def _forward_nodes(model, nodes, slots, n0, prefix, cache, dtype, device) -> dict:
    """One draft forward over canonical ``nodes`` (t, path), appended to the cache after the ``prefix``
    entries and the earlier nodes; returns their logits rows. Node (t, path) sees the committed entries
    < n0 + t + 1 and, among the nodes, its own path prefixes (all forwarded at earlier depths) and itself."""
    tail = len(slots)
    slots.update({node: tail + j for j, node in enumerate(nodes)})
    allowed = np.zeros((len(nodes), prefix + tail + len(nodes)), dtype=bool)  # [Q, prefix + tail + Q]
    ctx = np.asarray([n0 + t + 1 for t, _ in nodes])
    allowed[:, :prefix] = np.arange(prefix)[None, :] < ctx[:, None]
    rows, cols = [], []
    for j, (t, path) in enumerate(nodes):
        for k in range(1, len(path) + 1):
            rows.append(j)
            cols.append(prefix + slots[(t, path[:k])])
    allowed[rows, cols] = True
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(
        torch.from_numpy(~allowed), torch.finfo(dtype).min
    )
    positions = [n0 + t + len(path) for t, path in nodes]
    logits = forward_logits(
        model, [path[-1] for _, path in nodes], positions, cache, device, mask=mask[None, None].to(device)
    )  # [Q, V]
    check_finite(logits, "draft")
    return dict(zip(nodes, logits))
