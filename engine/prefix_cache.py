"""The prefix cache: KV entries of token prefixes kept across requests and turns, so that a prompt is never
computed twice (``engine.batch``: on by default in the server).

A ``PrefixTree`` is a radix tree over token ids (SGLang's RadixAttention layout; why a radix tree rather than
vLLM's hashed blocks: docs/engine.md, "Prefix cache"). Each node holds a run of tokens and, for a model,
the keys and values of every layer at those positions, ``[layers, 2, kv_heads, tokens, head_dim]``: the path
from the root to a node spells a prefix, and the nodes on it hold that prefix's KV. A match is token-granular
(the longest common prefix, cut anywhere inside a node); an insert shares what is there and adds one node for
the rest (splitting a node where the new run leaves it).

Why a hit is exact: a position's keys and values depend only on the tokens up to it. On the native decoder every
row is computed alone, whatever the row count, the chunking and the batch mates (``engine.batch_forward``), and a
verified node's row attends to exactly the committed prefix and its ancestors in cache order: so the KV a
prefill, a decode step or a verification forward wrote for a committed position are the same bits, and a
request that copies them gets the bits its own prefill would have computed (tested, with a shifted copy as the
negative control). On the torch path (float32, other devices) a position computed in another row count can
differ by ~1e-7, as batch mates already make it there; the output law is the target's either way.

What enters: only committed positions. The batched engine inserts a prompt when its prefill ends (every
position), the part of a prompt prefilled when it is cancelled, and a finished or cancelled request's committed
tokens but the last (the target's cache holds exactly those; the draft's its ``draft_len`` first); drafted and
rejected positions were compacted away by then (``engine.backends.kvcache.keep_entries``), so they never enter.

A request copies the KV it hits into its own cache (``load``): a slot's attention runs over one contiguous buffer
(the native decoder's layout), so sharing would mean paged attention; copying a 1,500-token prefix of the
default target is ~90 MB, tens of milliseconds, against 10+ seconds of prefill. The tree therefore keeps its own
bytes, counted against the engine's KV budget next to the slots' reservations.

Memory: ``PrefixCache.max_bytes`` bounds both trees (target and draft) together. Least-recently-used leaves go first (``evict``); a leaf that a waiting
request matched at admission is pinned (``pin``) until that request has copied it. Removing a leaf can make its
parent a leaf, so a cold branch goes from its tip back. A tree without tensors (``PrefixTree(None)``) keeps the
same structure and byte counts with no KV: the server replay (``envs.server``) uses it to charge hits as the
engine gets them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import InputError, is_int, short_repr


@dataclass(eq=False)
class _Node:
    tokens: list[int]
    kv: torch.Tensor | None
    """[layers, 2, kv_heads, len(tokens), head_dim] (None in a tree without tensors, and at the root)."""
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0
    pins: int = 0


@dataclass
class Match:
    """A prefix found in the tree: its length and the nodes that hold it (the last one possibly in part)."""

    length: int
    path: list[tuple[_Node, int]]
    """(node, tokens of it used), root side first."""

    @property
    def node(self) -> _Node | None:
        """The deepest node of the match (what ``pin`` holds), None for an empty match."""
        return self.path[-1][0] if self.path else None


class PrefixTree:
    """A radix tree of token prefixes with their KV for one model (module docstring). ``entry_bytes``: bytes of
    one position's KV (``engine.backends.kvcache.kv_bytes_per_entry``); ``clock``: the LRU counter it shares
    with the other tree of its ``PrefixCache``. A ``Match`` is loaded right after ``match``: an insert may
    split its nodes later, so a match kept longer serves only to ``pin`` and ``unpin``."""

    def __init__(self, entry_bytes: int, clock: list[int], with_kv: bool = True):
        if not is_int(entry_bytes) or entry_bytes < 1:
            raise InputError(f"entry_bytes must be an integer >= 1, got {short_repr(entry_bytes)}")
        self.entry_bytes, self.clock, self.with_kv = int(entry_bytes), clock, with_kv
        self.root = _Node([], None, None)
        self.entries = 0
        """Positions held (all nodes)."""
        self.evictions = 0
        """Nodes evicted so far."""
        self.evicted_entries = 0

    @property
    def bytes(self) -> int:
        return self.entries * self.entry_bytes

    # ------------------------------------------------------------------------------------------- lookup
    def match(self, ids: list[int], limit: int | None = None) -> Match:
        """The longest prefix of ``ids`` in the tree, at most ``limit`` tokens."""
        limit = len(ids) if limit is None else min(limit, len(ids))
        node, pos, path = self.root, 0, []
        while pos < limit:
            child = node.children.get(ids[pos])
            if child is None:
                break
            run = child.tokens
            take, most = 0, min(len(run), limit - pos)
            while take < most and run[take] == ids[pos + take]:
                take += 1
            path.append((child, take))
            pos += take
            if take < len(run):
                break
            node = child
        return Match(pos, path)

    def touch(self, match: Match) -> None:
        """Mark the nodes of ``match`` as just used (LRU order)."""
        self.clock[0] += 1
        for node, _ in match.path:
            node.last_used = self.clock[0]

    def pin(self, match: Match) -> None:
        """Keep ``match``'s nodes from eviction until ``unpin``: pinning the deepest node is enough, since only
        leaves are evicted and its ancestors have it as a descendant."""
        if match.node is not None:
            match.node.pins += 1

    def unpin(self, match: Match) -> None:
        if match.node is not None:
            match.node.pins -= 1

    def load(self, match: Match, cache: object) -> None:
        """Write the KV of ``match`` into the empty ``cache`` (``engine.backends.kvcache.new_cache``: its
        ``GrowingLayer``s' buffers, within their capacity) and expose it as the cache's first positions."""
        if not match.length:
            return
        if not self.with_kv:
            raise ValueError("this prefix tree holds no KV")
        layers = cache.layers
        first = match.path[0][0].kv
        like = first.new_empty((1, first.shape[2], 0, first.shape[4]))
        buffers = [layer.reserve(match.length, like) for layer in layers]
        if any(held for _, _, held in buffers):
            raise ValueError("a prefix is loaded into an empty cache only")
        pos = 0
        for node, take in match.path:
            kv = node.kv
            for (kbuf, vbuf, _), layer_kv in zip(buffers, kv):
                kbuf[0, :, pos : pos + take] = layer_kv[0, :, :take]
                vbuf[0, :, pos : pos + take] = layer_kv[1, :, :take]
            pos += take
        for layer in layers:
            layer.extend(match.length)
        self.touch(match)

    # ------------------------------------------------------------------------------------------- insert
    def insert(self, ids: list[int], cache: object | None, room: int) -> int:
        """Add the prefix ``ids`` whose KV is ``cache``'s first ``len(ids)`` positions (``cache`` None in a tree
        without tensors). What the tree holds already is shared; the rest, as much of it as ``room`` bytes
        hold, becomes one node (``PrefixCache.insert`` makes the room). Returns the positions added."""
        match = self.match(ids)
        node = self._split(match)
        self.touch(match)
        count = min(len(ids) - match.length, max(room, 0) // self.entry_bytes)
        if count <= 0:
            return 0
        start = match.length
        kv = None
        if self.with_kv:
            kv = torch.stack(
                [
                    torch.stack(
                        (layer.keys[0, :, start : start + count], layer.values[0, :, start : start + count])
                    )
                    for layer in cache.layers
                ]
            )  # a copy: the request's buffers are freed or overwritten later
        leaf = _Node(list(ids[start : start + count]), kv, node, last_used=self.clock[0])
        node.children[leaf.tokens[0]] = leaf
        self.entries += count
        return count

    def _split(self, match: Match) -> _Node:
        """Make the match end on a node boundary; the node new tokens hang from (the root for an empty
        match)."""
        if not match.path:
            return self.root
        node, take = match.path[-1]
        if take < len(node.tokens):
            node = self._cut(node, take)
            match.path[-1] = (node, take)
        return node

    def _cut(self, node: _Node, at: int) -> _Node:
        """Split ``node`` after ``at`` of its tokens; returns the new upper part (the lower keeps the pins and
        the children)."""
        parent = node.parent
        upper = _Node(node.tokens[:at], None, parent, last_used=node.last_used)
        if node.kv is not None:
            upper.kv = node.kv[:, :, :, :at].clone()
            node.kv = node.kv[:, :, :, at:].clone()
        node.tokens = node.tokens[at:]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        parent.children[upper.tokens[0]] = upper
        return upper

    # ------------------------------------------------------------------------------------------ evict
    def oldest_leaf(self, keep: _Node | None = None) -> _Node | None:
        """The least recently used leaf that may go (unpinned, not ``keep``), None if none."""
        best = None
        for node in self._nodes():
            if node.children or node.pins > 0 or node is keep:
                continue
            if best is None or node.last_used < best.last_used:
                best = node
        return best

    def remove(self, leaf: _Node) -> int:
        """Drop ``leaf`` (a leaf); the bytes freed."""
        del leaf.parent.children[leaf.tokens[0]]
        self.entries -= len(leaf.tokens)
        self.evicted_entries += len(leaf.tokens)
        self.evictions += 1
        leaf.kv = None
        return len(leaf.tokens) * self.entry_bytes

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check(self) -> None:
        """Raise AssertionError where the tree's structure or byte count is inconsistent (tests)."""
        total = 0
        for node in self._nodes():
            assert node.tokens, "an empty node"
            assert node.parent.children.get(node.tokens[0]) is node, "a node its parent does not list"
            if self.with_kv:
                assert node.kv is not None and node.kv.shape[3] == len(node.tokens), "KV of another length"
            total += len(node.tokens)
        assert total == self.entries, f"{total} positions held, {self.entries} counted"


class PrefixCache:
    """The target's and the draft's prefix trees under one byte bound and one LRU order (module docstring).
    ``entry_bytes``: (target, draft) bytes of one position; ``max_bytes``: what both trees may hold together."""

    def __init__(self, entry_bytes: tuple[int, int], max_bytes: int, with_kv: bool = True):
        if not is_int(max_bytes) or max_bytes < 1:
            raise InputError(
                f"the prefix cache size must be an integer >= 1 bytes, got {short_repr(max_bytes)}"
            )
        self.max_bytes = int(max_bytes)
        clock = [0]
        self.target = PrefixTree(entry_bytes[0], clock, with_kv)
        self.draft = PrefixTree(entry_bytes[1], clock, with_kv)
        self.stats = PrefixStats()

    @property
    def bytes(self) -> int:
        return self.target.bytes + self.draft.bytes

    @property
    def evictions(self) -> int:
        return self.target.evictions + self.draft.evictions

    def evict(self, nbytes: int, keep: tuple[PrefixTree, _Node] | None = None) -> int:
        """Drop least-recently-used leaves of either tree (unpinned; never ``keep``'s node)
        until ``nbytes`` are freed or none may go; the bytes freed."""
        freed = 0
        while freed < nbytes:
            picks = [
                (leaf, tree)
                for tree in (self.target, self.draft)
                if (leaf := tree.oldest_leaf(keep[1] if keep is not None and keep[0] is tree else None))
            ]
            if not picks:
                break
            leaf, tree = min(picks, key=lambda p: p[0].last_used)
            freed += tree.remove(leaf)
        return freed

    def insert(self, tree: PrefixTree, ids: list[int], cache: object | None, room: int | None = None) -> int:
        """``tree.insert`` of the prefix ``ids`` (its KV in ``cache``) after evicting what it needs, within
        ``max_bytes`` and ``room`` (bytes the cache may hold now in all: the engine's budget less the slots'
        reservations; None: ``max_bytes``). Returns the positions added."""
        cap = self.max_bytes if room is None else min(self.max_bytes, room)
        match = tree.match(ids)
        want = (len(ids) - match.length) * tree.entry_bytes
        if want <= 0:
            tree.touch(match)
            return 0
        keep = (tree, match.node) if match.node is not None else None
        if keep is not None:
            keep[1].pins += 1  # the prefix's own nodes stay while room is made
        try:
            self.evict(self.bytes + want - cap, keep)
        finally:
            if keep is not None:
                keep[1].pins -= 1
        return tree.insert(ids, cache, cap - self.bytes)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    n, most = 0, min(len(a), len(b), limit)
    while n < most and a[n] == b[n]:
        n += 1
    return n


@dataclass
class PrefixStats:
    """What the prefix cache did (the server's ``/metrics``)."""

    queries: int = 0
    """Prompts looked up (one a request, when its prefill starts)."""
    query_tokens: int = 0
    """Prompt tokens of those queries."""
    hit_tokens: int = 0
    """Prompt tokens taken from the cache (the target's)."""
    draft_hit_tokens: int = 0
    """Prompt tokens of the draft's lazy prefill taken from the cache."""
    insert_failures: int = 0
    """Inserts that raised (a cancelled request's KV could not be copied: the cache goes on without it)."""
