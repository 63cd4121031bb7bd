"""The static setting tuned per load level, the rule serving engines ship (vLLM's
``num_speculative_tokens_per_batch_size``: a draft length looked up from the batch size), and its file.

``BatchSizeTableController``: a chain of the table's depth for the number of requests in the step
(``DraftState.load``; alone: one request). The table file is the JSON list vLLM reads (``batch_size_table``,
``write_batch_size_table``, ``read_batch_size_table``): ``serve.py --policy table:FILE`` serves it, vLLM runs
it (``peers.vllm_peer``), training writes the tuned one and the policy's own (``training.export``).
(The fixed depth and size, ``StaticController``, is an engine primitive: ``engine.control``.)"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from engine.backends.files import atomic_write
from engine.control import Controller, DraftState
from engine.errors import InputError, is_int


class BatchSizeTableController(Controller):
    """Draft ``table[n]`` levels (0: an autoregressive step) and verify the top ``table[n]`` nodes (a whole
    chain), ``n`` the requests in the step: the entry of the largest key <= n (keys: batch sizes from which
    an entry holds)."""

    decides_depth_zero = True

    def __init__(self, table: Mapping[int, int], tree_width: int = 1):
        if not table or any(not is_int(k) or k < 1 or not is_int(v) or v < 0 for k, v in table.items()):
            raise InputError(f"a batch-size table maps batch sizes >= 1 to depths >= 0, got {dict(table)!r}")
        self.table = {int(k): int(v) for k, v in sorted(table.items())}
        if 1 not in self.table:
            raise InputError(f"a batch-size table needs an entry for batch size 1, got {self.table}")
        self._keys = sorted(self.table)
        if not is_int(tree_width) or tree_width < 1:
            raise InputError(f"tree_width must be an integer >= 1, got {tree_width!r}")
        self.tree_width = int(tree_width)

    @classmethod
    def from_file(cls, path: str | Path, tree_width: int = 1) -> BatchSizeTableController:
        """The controller of a table file (``write_batch_size_table``'s, vLLM's format), checked as vLLM checks
        it (``ValueError`` naming the file): the first batch size of each range -> its depth (a gap or the sizes
        past the last range keep the previous depth)."""
        return cls(read_table(path), tree_width=tree_width)

    def depth_for(self, requests: int) -> int:
        """The table's depth for a step of ``requests`` requests."""
        key = max(k for k in self._keys if k <= max(requests, 1))
        return self.table[key]

    def _depth(self, state: DraftState) -> int:
        return self.depth_for(state.load.requests if state.load is not None else 1)

    def should_continue(self, state: DraftState) -> bool:
        return state.depth < self._depth(state)

    def num_to_verify(self, state: DraftState) -> int:
        return state.depth

    def __repr__(self) -> str:
        return f"BatchSizeTableController({self.table}, tree_width={self.tree_width})"


# --------------------------------------------------------------------------- the per-batch-size table file
def batch_size_table(table: Mapping[tuple[int, int], int]) -> list[list[int]]:
    """``{(first, last): k}`` (inclusive batch-size ranges -> draft length) as the list vLLM reads as
    ``speculative_config.num_speculative_tokens_per_batch_size``: ``[[first, last, k], ...]`` sorted by
    ``first``. Checked as ``vllm.v1.spec_decode.dynamic.utils.validate_and_normalize_dynamic_sd_schedule``
    (0.32.0) checks it: not empty, positive ranges with first <= last, k >= 0, no overlaps, the first range
    starting at 1. vLLM carries a k forward through gaps and past the last range, and clamps every k to
    ``num_speculative_tokens`` (``peers.vllm_peer.speculative_config`` sets that to the table's largest k)."""
    if not table:
        raise ValueError("the table is empty")
    rows = []
    for key, k in table.items():
        first, last = (int(x) for x in key)
        if first <= 0 or last <= 0 or first > last:
            raise ValueError(f"batch-size range ({first}, {last}) must be positive with first <= last")
        if int(k) != k or k < 0:
            raise ValueError(f"draft length {k!r} for ({first}, {last}) must be an integer >= 0")
        rows.append([first, last, int(k)])
    rows.sort()
    for (_, prev_last, _), (first, last, _) in zip(rows, rows[1:]):
        if first <= prev_last:
            raise ValueError(f"batch-size range ({first}, {last}) overlaps the one ending at {prev_last}")
    if rows[0][0] != 1:
        raise ValueError(f"the first batch-size range starts at {rows[0][0]}, not 1")
    if max(k for _, _, k in rows) == 0:
        raise ValueError("every draft length is 0: run vLLM without speculation instead")
    return rows


def write_batch_size_table(table: Mapping[tuple[int, int], int], path: str | Path) -> Path:
    """Write ``table`` (``{(first, last): k}``) to ``path`` as the JSON list vLLM reads as
    ``num_speculative_tokens_per_batch_size``; ``read_batch_size_table`` (``BatchSizeTableController.from_file``,
    ``peers.vllm_peer.speculative_config(draft, table=path)``) reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(batch_size_table(table)) + "\n")
    return path


def read_batch_size_table(path: str | Path) -> list[list[int]]:
    """The table file ``write_batch_size_table`` wrote, checked again (ValueError naming the file)."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a table file ({err})") from None
    if not isinstance(rows, list) or not all(
        isinstance(r, list) and len(r) == 3 and all(is_int(x) for x in r) for r in rows
    ):
        raise ValueError(f"{path}: not a list of [first, last, k] integer entries")
    return batch_size_table({(r[0], r[1]): r[2] for r in rows})


def read_table(path: str | Path) -> dict[int, int]:
    """A table file as ``BatchSizeTableController`` takes it: the first batch size of each range -> its depth
    (``read_batch_size_table``'s checks; ``ValueError`` naming the file)."""
    return {first: depth for first, _, depth in read_batch_size_table(path)}
