"""Fixed depth and verification size: the grid-searched baseline. ``StaticController`` is an engine
primitive (``engine.control``: the cost measurement and the generate command use it, and the engine may not
import policies); it is re-exported here with the other controllers.

``BatchSizeTableController`` is the static setting tuned per load level, the rule serving engines ship
(vLLM's ``num_speculative_tokens_per_batch_size``: a draft length looked up from the batch size): a chain of
the table's depth for the number of requests in the step (``DraftState.load``; alone: one request)."""

from __future__ import annotations

from collections.abc import Mapping

from engine.control import Controller, DraftState, StaticController
from engine.errors import InputError, is_int

__all__ = ["BatchSizeTableController", "StaticController"]


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
