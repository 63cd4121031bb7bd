"""The controller seam: the only thing that differs between static, heuristic, analytic and learned
decoding. The engine owns this protocol; implementations live in ``policies``.

Per cycle the engine drafts one step at a time and, after each step, asks ``should_continue``; when
drafting stops it asks ``num_to_verify``; after verification it reports the cycle with ``observe``.
A controller that sets ``decides_depth_zero`` is also asked ``should_continue`` before the first draft
step (``state.depth == 0``): answering False makes the cycle an autoregressive step (depth 0: no draft,
one target forward of the pending token), so a controller can switch speculation off where it does not
pay. The draft catches up on the skipped tokens in its next draft step.

A controller that sets ``decides_lookup`` decides context lookup itself, request by request and cycle by
cycle: where the engine's context lookup (``engine.lookup``) has a proposal, ``use_lookup`` is asked with
``state.lookup_proposed`` set (its length, which tells a long match from a short one): True verifies the
proposal (a lookup cycle), False goes on to the controller's own cycle. The engine's load limit
(``LookupConfig.max_requests``) then does not apply: it is the rule for controllers that do not decide.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import InputError, is_int, short_repr
from engine.load import LoadState
from engine.results import CycleRecord


class ControllerError(InputError):
    """The engine was given something that is not a ``Controller``, or a controller answered something that
    is not a decision (``should_continue``: a bool; ``num_to_verify``: an integer) or has an unusable
    ``tree_width``; the message names the controller and the answer."""


@dataclass(frozen=True)
class DraftState:
    """What a controller sees during a cycle (every field is a function of the committed prefix)."""

    depth: int
    """Draft steps done so far in this cycle (>= 1; 0 before the first step, for controllers with
    ``decides_depth_zero``: then the frontier and node arrays are empty)."""
    frontier_scores: np.ndarray
    """[W] cumulative draft log-probs of the nodes the next step would expand, descending."""
    step_probs: np.ndarray
    """[W] draft probability of each frontier node given its parent (the last step's confidence)."""
    node_scores: np.ndarray
    """[N] cumulative draft log-probs of every node drafted so far, descending."""
    context_len: int
    """Committed tokens (prompt + generated) at the start of the cycle."""
    max_depth: int
    """Hard cap on depth this cycle (budget, context limit); the engine stops there regardless."""
    history: Sequence[CycleRecord]
    """Records of this request's previous cycles, oldest first."""
    temperature: float = 0.0
    """The request's sampling temperature (0: greedy). Draft scores are already temperature-scaled; how
    well they predict acceptance still depends on it (a sampled target accepts a deterministic draft less
    often than the greedy one does)."""
    load: LoadState | None = None
    """The load of the step this cycle runs in (``engine.load``): None when the request decodes alone
    (``generate``), set by the batched engine and by the server replay."""
    lookup_proposed: int = 0
    """The tokens the context lookup proposes this cycle, in the state ``use_lookup`` is asked with (a
    proposal after a long match is longer, ``LookupConfig.long_tokens``); 0 in every other state."""

    @classmethod
    def before_drafting(
        cls,
        context_len: int,
        max_depth: int,
        history: Sequence[CycleRecord],
        temperature: float = 0.0,
        load: LoadState | None = None,
        lookup_proposed: int = 0,
    ) -> DraftState:
        """The depth-0 state (asked of controllers with ``decides_depth_zero``, and ``use_lookup``'s with the
        proposal's length): nothing drafted yet."""
        empty = np.zeros(0, dtype=np.float32)
        return cls(
            depth=0,
            frontier_scores=empty,
            step_probs=empty,
            node_scores=empty,
            context_len=context_len,
            max_depth=max_depth,
            history=history,
            temperature=temperature,
            load=load,
            lookup_proposed=lookup_proposed,
        )


class Controller(ABC):
    """Decides draft depth (continue/stop after each step) and verification size, once per cycle."""

    tree_width: int = 1
    """Frontier width W and children per expanded node; 1 drafts a chain."""
    decides_depth_zero: bool = False
    """True: ``should_continue`` is also asked at depth 0 (draft at all this cycle?)."""
    decides_lookup: bool = False
    """True: ``use_lookup`` is asked whenever the engine's context lookup has a proposal (the load limit then
    does not apply); False: the engine's rule decides (module docstring)."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Called at the start of every request (clear per-request state)."""

    @abstractmethod
    def should_continue(self, state: DraftState) -> bool:
        """After a draft step: draft one more level (a bool)? (At depth 0, with ``decides_depth_zero``: draft
        at all?)"""

    @abstractmethod
    def num_to_verify(self, state: DraftState) -> int:
        """After drafting: how many of the drafted nodes (top by score) to verify (an integer); clamped to
        [0, min(N, EngineConfig.max_verify)]."""

    def use_lookup(self, state: DraftState) -> bool:
        """Asked of a controller with ``decides_lookup`` where context lookup proposes
        ``state.lookup_proposed`` tokens (``state.depth`` 0): verify them (a lookup cycle)? False: the cycle is
        the controller's (drafting, or an autoregressive step). The default takes every proposal."""
        return True

    def observe(self, record: CycleRecord) -> None:  # noqa: B027 - optional hook
        """Called after every cycle with its outcome (online estimates live here)."""


def decision(answer: object, controller: object, method: str = "should_continue") -> bool:
    """``should_continue``'s (or ``use_lookup``'s) answer as a bool. Anything but a bool (or the integers 0 and 1) is a
    ``ControllerError`` naming the controller, rather than a silent truth value (None is False, NaN True)."""
    if isinstance(answer, (bool, np.bool_)) or (is_int(answer) and answer in (0, 1)):
        return bool(answer)
    raise ControllerError(
        f"{type(controller).__name__}.{method} must return a bool, got "
        f"{short_repr(answer)} ({type(answer).__name__})"
    )


def verify_size(answer: object, controller: object) -> int:
    """``num_to_verify``'s answer as an int (then clamped by ``engine.tree.clamp_verify``); anything but an
    integer (None, NaN, 2.5, an array) is a ``ControllerError``."""
    if is_int(answer):
        return int(answer)
    raise ControllerError(
        f"{type(controller).__name__}.num_to_verify must return an integer, got "
        f"{short_repr(answer)} ({type(answer).__name__})"
    )


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
