"""The draft tree of one cycle: nodes, parents, scores, the top-V selection and tree attention masks.

Nodes are stored in creation order, so a parent always precedes its children. A node's *score* is the
cumulative draft log-probability of its path; scores never increase along a path, so "the top-V nodes
by score, ties broken by creation order" is always a connected sub-tree containing the root's children
it needs (docs/design.md section 3 relies on this for exact replay).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DraftTree:
    """All nodes drafted in one cycle (the root, i.e. the pending token, is implicit: parent -1)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    draft_slot: list[int] = field(default_factory=list)
    """Index of the node's entry in the draft KV cache tail (-1 while the draft has not run it)."""

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(float(score))
        self.draft_slot.append(-1)
        return len(self.tokens) - 1

    def select(self, num_verify: int) -> list[int]:
        """Indices of the top-``num_verify`` nodes by score (ties: earlier node first), in creation order."""
        if num_verify <= 0 or not self.tokens:
            return []
        scores = np.asarray(self.scores)
        order = np.lexsort((np.arange(len(scores)), -scores))  # score desc, then creation order
        return sorted(order[:num_verify].tolist())

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


MAX_TREE_NODES = 32767
"""Default ``EngineConfig.max_tree_nodes``: the most nodes a trace holds per position (int16 parent ids), so
every tree the trace format can record is drafted in full."""


def tree_size(width: int, depth: int) -> int:
    """Nodes of a tree drafted ``depth`` levels at frontier width ``width`` (``expand_topk``: the first step
    adds ``width`` children of the root, each later step ``width`` children to each of ``width`` frontier
    nodes). A function of (width, depth) only: the node cap becomes a depth cap that the engine and replay
    apply identically."""
    return 0 if depth <= 0 else width + (depth - 1) * width * width


def depth_limit(width: int, max_nodes: int) -> int:
    """The deepest tree of frontier width ``width`` with at most ``max_nodes`` nodes (0: not even one
    level fits)."""
    if width > max_nodes:
        return 0
    return 1 + (max_nodes - width) // (width * width)


def clamp_verify(num_verify: int, num_drafted: int, max_verify: int) -> int:
    """Nodes actually verified when a controller asks for ``num_verify``: clamped to [0, min(drafted,
    max_verify)]. The engine and replay both call this (same rule, same numbers)."""
    return min(max(int(num_verify), 0), num_drafted, max_verify)


def expand_topk(
    tree: DraftTree, parents: list[int], parent_scores: list[float], logprobs: torch.Tensor, width: int
) -> list[int]:
    """One EAGLE-2 style level: each parent (row of ``logprobs`` [P, V]) gets its top-``width`` children,
    all added to the tree; the new frontier is the top-``width`` of them by cumulative score (ties: the
    earlier node). The engine and the trace recorder both draft through this function, so a recorded tree
    is the tree the engine would draft."""
    top = torch.topk(logprobs, width, dim=-1)  # [P, k]
    cand = (torch.as_tensor(parent_scores, dtype=torch.float32)[:, None] + top.values.float().cpu()).flatten()
    tokens = top.indices.cpu().flatten().tolist()
    new = [tree.add(tok, parents[i // width], float(s)) for i, (tok, s) in enumerate(zip(tokens, cand))]
    if len(new) <= width:
        return new
    order = np.lexsort((np.arange(len(new)), -cand.numpy()))[:width]
    return [new[i] for i in order]


def ancestor_matrix(parents: list[int]) -> np.ndarray:
    """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors.

    ``parents`` index into the same list (-1 = root); parents precede children.
    """
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            anc[i] = anc[parent]
        anc[i, i] = True
    return anc


def tree_attention_mask(
    num_cached: int, allowed_tail: np.ndarray, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive 4D mask [1, 1, Q, num_cached + T]: every query sees the first ``num_cached`` cache
    entries (committed tokens) and, among the T tail entries, those marked in ``allowed_tail`` [Q, T]."""
    q, t = allowed_tail.shape
    allowed = np.ones((q, num_cached + t), dtype=bool)
    allowed[:, num_cached:] = allowed_tail
    mask = torch.zeros((1, 1, q, num_cached + t), dtype=dtype)
    mask.masked_fill_(torch.from_numpy(~allowed)[None, None], torch.finfo(dtype).min)
    return mask.to(device)
