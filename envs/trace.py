"""Recorded traces: one target-law trajectory of one prompt plus, at every position, the full draft tree.

Why replay is exact (docs/design.md section 3): with deterministic drafting the tree drafted at a position
depends only on the committed prefix, and the accepted path is the longest tree path that the
trajectory walks down. So a trace holds the trajectory and, at every position, the tree the live engine
would draft there up to (max_depth, tree_width); any controller's cycle outcomes follow from it.

Positions: position t (0 <= t < len(tokens)) is the cycle state in which ``prompt + tokens[:t+1]`` are
committed, i.e. ``tokens[t]`` is the root (pending token) and the context length is
``prompt_len + t + 1``. ``tokens[0]`` comes from the prefill.

On disk: one ``.npz`` per trace (numpy arrays, compressed) holding the fields below; ``meta`` is a JSON
string (pair, sampling, tree width, max depth, format version, ...).
"""

from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.backends.files import atomic_path
from engine.errors import DraftpilotError

FORMAT_VERSION = 1


class TraceError(DraftpilotError, ValueError):
    """A trace file is missing, corrupt or of another format version."""


@dataclass
class Trace:
    prompt_id: str
    prompt_len: int
    tokens: np.ndarray
    """[T] int32: the trajectory (generated tokens, the prefill token first; EOS last if it ended so)."""
    node_offsets: np.ndarray
    """[T+1] int64: the nodes of position t are rows node_offsets[t]:node_offsets[t+1]."""
    node_tokens: np.ndarray
    """[N] int32."""
    node_parents: np.ndarray
    """[N] int16: parent index *within the position's nodes*, -1 for the root's children."""
    node_depths: np.ndarray
    """[N] int8 (1 = child of the root)."""
    node_scores: np.ndarray
    """[N] float32: cumulative draft log-prob (what the engine ranks nodes by)."""
    meta: dict = field(default_factory=dict)
    """pair, sampling (temperature, top_k, top_p), tree_width, max_depth, seed, finish_reason, ..."""

    @property
    def num_positions(self) -> int:
        return len(self.tokens)

    def nodes(self, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, parents, depths, scores) of the tree drafted at position t, in creation order."""
        lo, hi = int(self.node_offsets[t]), int(self.node_offsets[t + 1])
        return (
            self.node_tokens[lo:hi],
            self.node_parents[lo:hi],
            self.node_depths[lo:hi],
            self.node_scores[lo:hi],
        )

    def save(self, path: str | Path) -> None:
        """Write atomically (``engine.backends.files.atomic_path``): a kill mid-write never leaves a half trace under the
        final name, and the temporary file (``.<name>.<random>.tmp``) never matches ``*.npz``."""
        with atomic_path(path) as tmp, open(tmp, "wb") as f:  # a file object: numpy adds no ".npz" to it
            np.savez_compressed(
                f,
                prompt_id=np.asarray(self.prompt_id),
                prompt_len=np.asarray(self.prompt_len),
                tokens=self.tokens.astype(np.int32),
                node_offsets=self.node_offsets.astype(np.int64),
                node_tokens=self.node_tokens.astype(np.int32),
                node_parents=self.node_parents.astype(np.int16),
                node_depths=self.node_depths.astype(np.int8),
                node_scores=self.node_scores.astype(np.float32),
                meta=np.asarray(json.dumps({**self.meta, "format_version": FORMAT_VERSION})),
            )

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        path = Path(path)
        if not path.is_file():
            raise TraceError(f"trace file not found: {path}")
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                trace = cls(
                    prompt_id=str(data["prompt_id"]),
                    prompt_len=int(data["prompt_len"]),
                    tokens=data["tokens"],
                    node_offsets=data["node_offsets"],
                    node_tokens=data["node_tokens"],
                    node_parents=data["node_parents"],
                    node_depths=data["node_depths"],
                    node_scores=data["node_scores"],
                    meta=meta,
                )
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
            raise TraceError(f"{path}: not a readable trace file, truncated or corrupt ({err})") from err
        if meta.get("format_version") != FORMAT_VERSION:
            raise TraceError(
                f"{path}: trace format version {meta.get('format_version')}, expected {FORMAT_VERSION}"
            )
        trace.validate(str(path))
        return trace

    def validate(self, where: str = "trace") -> None:
        """Structural checks, so a corrupt trace fails loudly instead of replaying nonsense."""
        n_pos, n_nodes = len(self.tokens), len(self.node_tokens)
        if (
            len(self.node_offsets) != n_pos + 1
            or self.node_offsets[0] != 0
            or self.node_offsets[-1] != n_nodes
        ):
            raise TraceError(f"{where}: node_offsets do not cover the {n_nodes} nodes of {n_pos} positions")
        if np.any(np.diff(self.node_offsets) < 0):
            raise TraceError(f"{where}: node_offsets are not non-decreasing")
        if not (len(self.node_parents) == len(self.node_depths) == len(self.node_scores) == n_nodes):
            raise TraceError(f"{where}: node arrays have different lengths")
        if n_nodes and not np.all(np.isfinite(self.node_scores)):
            raise TraceError(f"{where}: non-finite node scores")
        for t in range(n_pos):
            _, parents, depths, _ = self.nodes(t)
            idx = np.arange(len(parents))
            if np.any(parents >= idx) or np.any(parents < -1):
                raise TraceError(f"{where}: position {t}: a parent does not precede its child")
            want = np.where(parents < 0, 1, depths[np.maximum(parents, 0)] + 1)
            if np.any(depths != want):
                raise TraceError(f"{where}: position {t}: depths inconsistent with parents")
