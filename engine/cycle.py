"""The rules of one decoding cycle, written once: the live engine (``SpeculativeEngine.cycle``, and through it
``engine.batch``) and the exact trace replay (``envs.replay.replay_cycles``, and through it the environments,
the server replay and the oracle's checks) both drive them, so the two cannot drift apart.

``cycle_rules`` decides a cycle: its kind, the questions its controller is asked and in which order, its depth
and the size asked. It does no work itself: it yields each question (``Question``) and receives the answer,
and the side driving it does what the answer needs in between (live: the draft forwards that make the state
of the next question; replay: reading the recorded tree). The order:

1. context lookup first, where one is configured and runs at the cycle's load (``LookupConfig.runs_at``): a
   proposal makes a lookup cycle, and no controller is asked; a controller that ``decides_lookup`` is asked
   instead (``use_lookup``, at every load: the load limit is the rule for the others), and "no" goes on;
2. no controller, or a depth cap below 1: an autoregressive step;
3. a controller that ``decides_depth_zero`` is asked at depth 0 (draft at all?): "no" is an autoregressive step;
4. under load (``shares_its_step``) a draft behind by more than ``EngineConfig.draft_catch_up_tokens``: a
   catch-up cycle (the draft runs the next that-many tokens next to an autoregressive step);
5. else a speculative cycle: after each draft level below the cap the controller is asked whether to draft one
   more; then how many nodes to verify.

``ask`` is the one place a controller's answers are checked (``decision``, ``verify_size``), and ``answer``
the one dispatch of the messages of a replayed cycle (``envs.replay.Message``) to a controller: the questions
are asked, every cycle but a lookup cycle is observed (a lookup cycle is no controller's decision). The caps,
each computed here once for the live engine, the batched engine and the replay: ``draft_budget`` (what a cycle
may add, by budget and context), ``tree_cap`` (the depth a controller's tree reaches under the node cap),
``cycle_cap`` (the cycle's depth cap: both), ``lookup_cap`` (the tokens a context lookup may propose); and
``DraftLag`` (what the draft is behind by, counted as replay counts it: the live engine reads it off its
caches).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal

from engine.control import Controller, DraftState, decision, verify_size
from engine.load import LoadState
from engine.lookup import LookupConfig
from engine.results import CycleRecord
from engine.tree import depth_limit

DRAFT_CATCH_UP_TOKENS = 16
"""The default of ``EngineConfig.draft_catch_up_tokens`` (``BatchConfig.max_prefill_tokens``'s default too)."""

Kind = Literal["lookup", "autoregressive", "catch_up", "speculative"]
Question = tuple[Literal["lookup", "use_lookup", "depth", "size"], int]
"""What ``cycle_rules`` asks its driver: ``("lookup", 0)``: the number of tokens the context lookup proposes;
``("use_lookup", k)``: verify the k tokens it proposes (a bool; asked of a controller that ``decides_lookup``);
``("depth", d)``: having drafted d levels (0: none yet), draft one more? (a bool); ``("size", d)``: d levels
drafted, how many nodes to verify? (an integer, the controller's answer before the engine's caps)."""


@dataclass(frozen=True)
class Plan:
    """What ``cycle_rules`` decided for a cycle."""

    kind: Kind
    depth: int = 0
    """Draft levels of a speculative cycle (0 otherwise)."""
    size: int = 0
    """The nodes a speculative cycle's controller asked to verify (before ``engine.tree.clamp_verify``)."""
    proposed: int = 0
    """Tokens a lookup cycle's proposal holds."""
    catch_up: int = 0
    """Tokens a catch-up cycle runs on the draft."""


def shares_its_step(load: LoadState | None) -> bool:
    """Whether a cycle under ``load`` shares its step with other requests' work (others decoding, or prompts
    being prefilled or waiting): then the draft's catch-up goes in chunks (``EngineConfig.
    draft_catch_up_tokens``). Alone (None) or the only request with nothing waiting: no."""
    return load is not None and load.requests + load.waiting > 1


def draft_budget(max_depth: int, remaining: int, room: int) -> int:
    """Drafted tokens a cycle may add: min(``EngineConfig.max_depth``, tokens left to generate - 1, context
    room - 1), so that a cycle's accepted tokens and its recovered/bonus token fit both."""
    return min(max_depth, remaining - 1, room - 1)


def tree_cap(width: int | None, max_tree_nodes: int) -> int:
    """The deepest a request's cycles may draft by the tree-node cap (``EngineConfig.max_tree_nodes``): the
    depth of a width-``width`` tree within it (``engine.tree.depth_limit``); 0 without a controller (None)."""
    return 0 if width is None else depth_limit(width, max_tree_nodes)


def cycle_cap(budget: int, tree_depth: int) -> int:
    """A cycle's depth cap (what ``cycle_rules`` gets as ``cap``): its ``draft_budget`` and the request's
    ``tree_cap``, whichever is lower."""
    return min(budget, tree_depth)


def lookup_cap(budget: int, max_verify: int, lookup: LookupConfig) -> int:
    """The most tokens a cycle's context lookup may propose: min(its ``draft_budget``, ``EngineConfig.
    max_verify``, the longest proposal of ``lookup``'s rules)."""
    return min(budget, max_verify, lookup.most_tokens)


def cycle_rules(
    cap: int,
    load: LoadState | None,
    lookup: LookupConfig | None,
    controlled: bool,
    depth_zero: bool,
    behind: int,
    catch_up: int,
    gate: bool = False,
) -> Generator[Question, bool | int, Plan]:
    """One cycle's decisions (module docstring), as a generator of its ``Question``s; returns the ``Plan``.

    ``cap``: the cycle's depth cap (``draft_budget`` and the tree-node cap); ``load``: the step's load (None:
    alone); ``lookup``: the engine's context lookup (None: off); ``controlled``: a controller (or an agent)
    decides the cycle (False: autoregressive decoding); ``depth_zero``: it is asked at depth 0; ``behind``:
    the tokens the draft has not run (the prompt, if its lazy prefill has not run, and its pending tokens);
    ``catch_up``: ``EngineConfig.draft_catch_up_tokens``; ``gate``: the controller decides context lookup
    (``Controller.decides_lookup``: asked at every load, the load limit aside)."""
    gate = gate and controlled
    if lookup is not None and (gate or lookup.runs_at(load)):
        proposed = yield ("lookup", 0)
        if proposed and (not gate or (yield ("use_lookup", int(proposed)))):
            return Plan("lookup", proposed=int(proposed))
    if not controlled or cap < 1:
        return Plan("autoregressive")
    if depth_zero and not (yield ("depth", 0)):
        return Plan("autoregressive")  # the controller switched speculation off for this cycle
    if shares_its_step(load) and behind > catch_up:
        return Plan("catch_up", catch_up=catch_up)
    depth = 1
    while depth < cap and (yield ("depth", depth)):
        depth += 1
    size = yield ("size", depth)
    return Plan("speculative", depth=depth, size=int(size))


class CyclePlan:
    """``cycle_rules`` in progress, for a driver that asks the controller itself (the live engine): ``question``
    is the question pending (None once decided), ``plan`` the decision once made."""

    def __init__(self, rules: Generator[Question, bool | int, Plan], controller: Controller | None):
        self.rules, self.controller = rules, controller
        self.question: Question | None = None
        self.plan: Plan | None = None
        self.reply(None)

    def reply(self, value: bool | int | None) -> None:
        """Answer the pending question (None: start) and move to the next one, or to the plan."""
        try:
            self.question = self.rules.send(value)
        except StopIteration as stop:
            self.question, self.plan = None, stop.value

    @property
    def drafting(self) -> bool:
        """Whether the pending question is one of a speculative cycle (asked after drafting starts)."""
        return (
            self.question is not None
            and self.question != ("depth", 0)
            and self.question[0] not in ("lookup", "use_lookup")
        )

    def ask(self, state: DraftState) -> bool | int:
        """Ask the controller the pending depth, size or use-lookup question in ``state``, checked (``ask``);
        the plan moves on with the answer, which is returned."""
        kind = self.question[0]
        value = ask(self.controller, kind, state)
        self.reply(value)
        return value


def ask(
    controller: Controller, kind: Literal["depth", "size", "use_lookup"], state: DraftState
) -> bool | int:
    """A controller's answer to a question, checked as the engine checks it: ``"depth"``: draft one more level
    (a bool; asked at depth 0 of a controller that does not decide depth 0, it drafts without being asked);
    ``"size"``: nodes to verify (an integer); ``"use_lookup"``: verify the context lookup's proposal of
    ``state.lookup_proposed`` tokens (a bool). A bad answer is a ``ControllerError``."""
    if kind == "use_lookup":
        return decision(controller.use_lookup(state), controller, "use_lookup")
    if kind == "depth":
        if state.depth == 0 and not controller.decides_depth_zero:
            return True
        return decision(controller.should_continue(state), controller)
    return verify_size(controller.num_to_verify(state), controller)


def answer(
    controller: Controller | None, message: tuple[str, DraftState] | tuple[str, CycleRecord]
) -> bool | int | None:
    """A controller's reply to a message of a replayed cycle (``envs.replay.Message``): its checked answer to
    a ``"depth"``, ``"size"`` or ``"use_lookup"`` question (``ask``); a ``"cycle"`` is observed (a lookup cycle, no controller's
    decision, is not) and answered with None. A None controller only gets cycles (autoregressive decoding)."""
    kind, payload = message
    if kind == "cycle":
        if controller is not None and not payload.lookup:
            controller.observe(payload)
        return None
    return ask(controller, kind, payload)


@dataclass
class DraftLag:
    """What the draft is behind by, counted (replay has no caches; live it is ``len(tokens) - draft_len``):
    ``prompt_left`` prompt tokens it has not run (its prefill is lazy) and ``pending`` committed tokens since."""

    prompt_left: int
    pending: int = 1

    @property
    def behind(self) -> int:
        return self.prompt_left + self.pending

    def commit(self, record: CycleRecord, pending_after: int = 0) -> None:
        """The cycle of ``record`` was committed: a lookup cycle or an autoregressive step leaves its tokens
        pending; a catch-up cycle's chunk ran the prompt's first tokens, then pending ones (never the last
        committed); a speculative cycle ran the prompt and leaves ``pending_after`` pending (the accepted
        nodes the draft never ran plus the recovered/bonus token)."""
        if record.lookup:
            self.pending += record.emitted
        elif record.depth == 0:
            if record.catch_up:
                from_prompt = min(record.catch_up, self.prompt_left)
                self.prompt_left -= from_prompt
                self.pending -= record.catch_up - from_prompt
            self.pending += 1
        else:
            self.pending, self.prompt_left = pending_after, 0
