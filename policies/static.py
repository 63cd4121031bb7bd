"""Fixed depth and verification size: the grid-searched baseline."""

from __future__ import annotations

from engine.control import Controller, DraftState
from engine.errors import InputError


class StaticController(Controller):
    """Draft ``depth`` levels (``tree_width`` > 1 drafts a tree), verify the top ``verify`` nodes; depth 0
    never drafts (autoregressive decoding through the speculative loop)."""

    decides_depth_zero = True

    def __init__(self, depth: int = 4, verify: int | None = None, tree_width: int = 1):
        for name, value, low in (("depth", depth, 0), ("tree_width", tree_width, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        verify = depth if verify is None else verify
        if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
            raise InputError(f"verify must be an integer >= 0, got {verify!r}")
        self.depth = depth
        self.verify = verify
        self.tree_width = tree_width

    def should_continue(self, state: DraftState) -> bool:
        return state.depth < self.depth

    def num_to_verify(self, state: DraftState) -> int:
        return self.verify

    def __repr__(self) -> str:
        return f"StaticController(depth={self.depth}, verify={self.verify}, tree_width={self.tree_width})"
