"""Controllers practitioners use today: transformers' +2/-1 schedule and a draft-confidence stop."""

from __future__ import annotations

from engine.control import Controller, DraftState
from engine.results import CycleRecord


class HeuristicController(Controller):
    """transformers' "heuristic" assisted-generation schedule on a chain: draft ``depth`` tokens; after a
    cycle where every drafted token was accepted draft 2 more next time, otherwise 1 fewer (min 1)."""

    tree_width = 1

    def __init__(self, initial_depth: int = 5, max_depth: int = 32):
        if initial_depth < 1 or max_depth < initial_depth:
            raise ValueError(f"need 1 <= initial_depth <= max_depth, got {initial_depth}, {max_depth}")
        self.initial_depth = initial_depth
        self.max_depth = max_depth
        self.depth = initial_depth

    def reset(self) -> None:
        self.depth = self.initial_depth

    def should_continue(self, state: DraftState) -> bool:
        return state.depth < self.depth

    def num_to_verify(self, state: DraftState) -> int:
        return len(state.node_scores)

    def observe(self, record: CycleRecord) -> None:
        if record.num_verified == 0:
            return
        if record.accepted == record.num_verified:
            self.depth = min(self.depth + 2, self.max_depth)
        else:
            self.depth = max(self.depth - 1, 1)

    def __repr__(self) -> str:
        return f"HeuristicController(initial_depth={self.initial_depth}, max_depth={self.max_depth})"


class ConfidenceController(Controller):
    """Stop drafting when the draft's confidence in its latest token falls below ``threshold`` (llama.cpp's
    p-min, transformers' assistant_confidence_threshold, DISCO); verify everything drafted.

    With a tree, the confidence is that of the best frontier node."""

    def __init__(
        self, threshold: float = 0.4, max_depth: int = 16, tree_width: int = 1, max_verify: int = 64
    ):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if max_depth < 1 or tree_width < 1 or max_verify < 0:
            raise ValueError("max_depth and tree_width must be >= 1 and max_verify >= 0")
        self.threshold = threshold
        self.max_depth = max_depth
        self.tree_width = tree_width
        self.max_verify = max_verify

    def should_continue(self, state: DraftState) -> bool:
        return state.depth < self.max_depth and float(state.step_probs.max()) >= self.threshold

    def num_to_verify(self, state: DraftState) -> int:
        return min(len(state.node_scores), self.max_verify)

    def __repr__(self) -> str:
        return (
            f"ConfidenceController(threshold={self.threshold}, max_depth={self.max_depth}, "
            f"tree_width={self.tree_width}, max_verify={self.max_verify})"
        )
