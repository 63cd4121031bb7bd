"""Episode backends: where the cycles of an episode come from.

Both speak the protocol of ``envs.replay.replay_cycles`` (``Episode``): ``send(reply)`` returns the next
message (``envs.replay.Message``: ``("depth", DraftState)``, ``("size", DraftState)`` or ``("cycle",
CycleRecord)``) and raises ``StopIteration`` when the request is finished. The environments answer the
messages; apart from the environment id checking ``Backend.kind``, they never know which backend they
drive.

* ``ReplayBackend``: exact replay of recorded traces; times from a cost profile.
* ``LiveBackend``: the real engine on real models; times are the engine's device-synchronised clocks.
  The engine's loop calls its controller, so the engine runs in a worker thread whose controller hands
  each question to the environment and waits for the answer (one request at a time).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np

from engine.control import Controller, DraftState
from engine.costs.cost_profile import CostProfile
from engine.engine import SpeculativeEngine
from engine.lookup import LookupConfig
from engine.results import CycleRecord
from envs.profiles import PerturbedProfile, ProfileMix
from envs.replay import (
    Message,
    ReplayTrace,
    Reply,
    charge_times,
    replay_cycles,
    replay_generate,
    throughput,
)


class Episode(Protocol):
    """One request driven message by message (a ``replay_cycles`` generator, or a ``LiveLoop``)."""

    def send(self, reply: Reply, /) -> Message:
        """Answer the last message (None to start) and return the next; ``StopIteration`` at the end."""
        ...

    def close(self) -> None:
        """Abandon the request (a live one releases its engine thread)."""
        ...


class Backend(Protocol):
    """What the environments (``envs.environments``) drive."""

    kind: Literal["replay", "live"]
    """Which backend this is: the environment ids name it (``draftpilot/Replay*`` or ``draftpilot/Live*``)."""
    width: int
    """Tree width W of every episode."""
    num_episodes: int
    profile: CostProfile | None
    """Cost profile (replay: the times; live: device features and optional recharging)."""

    def new_episode(
        self, index: int, rng: np.random.Generator, depth_zero: bool = False, gate: bool = False
    ) -> Episode:
        """Episode ``index``; ``depth_zero``: the agent decides depth 0; ``gate``: it decides context lookup
        (``engine.control.Controller.decides_lookup``)."""
        ...

    def throughput_of(self, controller: Controller | None) -> float:
        """Decode tokens per second of ``controller`` (None: autoregressive) over every episode."""
        ...


class ReplayBackend:
    """Exact replay of recorded traces, times from a cost profile."""

    kind = "replay"

    def __init__(
        self,
        traces: Sequence[ReplayTrace],
        profile: CostProfile,
        profiles: ProfileMix | None = None,
        lookup: LookupConfig | None = None,
    ):
        """``profiles``: draw each episode's cost profile from this mix (``sample_profile``) instead of
        ``profile``, which stays the one ``throughput_of`` and the environments' rho refer to. ``lookup``: the
        engine's context lookup (``EngineConfig.lookup``): its cycles happen in every episode unasked."""
        if not traces:
            raise ValueError("no traces: record some with `python -m envs.record_traces`")
        widths = {rt.width for rt in traces}
        if len(widths) != 1:
            raise ValueError(f"traces of one tree width expected, got widths {sorted(widths)}")
        self.traces, self.profile = list(traces), profile
        self.profiles = profiles
        self.lookup = lookup
        self.width = self.traces[0].width
        self.num_episodes = len(self.traces)

    def __deepcopy__(self, memo):
        return self  # read-only after construction; gymnasium deep-copies make() kwargs

    def sample_profile(self, rng: np.random.Generator) -> CostProfile | PerturbedProfile:
        """The cost profile of the next episode: ``profile``, or a draw from the mix."""
        return self.profile if self.profiles is None else self.profiles.sample(rng)

    def new_episode(
        self,
        index: int,
        rng: np.random.Generator,
        depth_zero: bool = False,
        profile: CostProfile | PerturbedProfile | None = None,
        gate: bool = False,
    ) -> Episode:
        return replay_cycles(
            self.traces[index],
            profile or self.profile,
            None,
            depth_zero=depth_zero,
            lookup=self.lookup,
            gate=gate,
        )

    def throughput_of(self, controller: Controller | None) -> float:
        return throughput(
            [replay_generate(rt, controller, self.profile, lookup=self.lookup) for rt in self.traces]
        )


class _Abort(Exception):
    """Unwinds the engine thread when an episode is abandoned (reset or close mid-request)."""


class _BridgeController(Controller):
    def __init__(self, width: int, questions: queue.Queue, answers: queue.Queue):
        self.tree_width = width
        self.questions, self.answers = questions, answers

    def _ask(self, kind: str, payload):
        self.questions.put((kind, payload))
        answer = self.answers.get()
        if answer is _Abort:
            raise _Abort
        return answer

    def should_continue(self, state: DraftState) -> bool:
        return bool(self._ask("depth", state))

    def use_lookup(self, state: DraftState) -> bool:
        return bool(self._ask("use_lookup", state))

    def num_to_verify(self, state: DraftState) -> int:
        return int(self._ask("size", state))

    def observe(self, record: CycleRecord) -> None:
        self._ask("cycle", record)


class LiveLoop:
    """One live request driven message by message (the generator protocol, over a worker thread).

    Why a thread, although a cycle is a generator (``SpeculativeEngine.cycle``): that generator yields only
    its forwards and verification rows; the controller's questions are calls made inside it (``engine.cycle.
    CyclePlan.ask``, between and after draft levels), answered at once. The environment answers a question
    only after ``send`` has returned it, so the call that asked must wait with the cycle's frames alive: the
    engine runs ``generate`` on its own thread, whose controller (``_BridgeController``) hands each question
    over and blocks until the answer comes back. Driving the cycle here instead would need the cycle to yield
    its questions too, a change of the engine's cycle code that every caller (``generate``, ``engine.batch``)
    would share; its timings (``controller_s`` counts the wait for the answer, as it does here) and its
    tokens would have to stay as they are."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        prompt_ids: list[int],
        max_new_tokens: int,
        seed: int,
        width: int,
        recharge_profile: CostProfile | None = None,
        depth_zero: bool = False,
        gate: bool = False,
    ):
        self.questions: queue.Queue = queue.Queue(maxsize=1)
        self.answers: queue.Queue = queue.Queue(maxsize=1)
        controller = _BridgeController(width, self.questions, self.answers)
        controller.decides_depth_zero = depth_zero
        controller.decides_lookup = gate
        self.result = None
        self.recharge_profile, self.width = recharge_profile, width
        self._thread = threading.Thread(
            target=self._run, args=(engine, prompt_ids, max_new_tokens, controller, seed), daemon=True
        )
        self._started = False

    def _run(self, engine, prompt_ids, max_new_tokens, controller, seed) -> None:
        try:
            self.questions.put(
                ("done", engine.generate(prompt_ids, max_new_tokens, controller=controller, seed=seed))
            )
        except _Abort:
            pass
        except BaseException as err:  # noqa: BLE001 - re-raised in the environment's thread
            self.questions.put(("error", err))

    def send(self, reply: Reply, /) -> Message:
        if not self._started:
            self._started = True
            self._thread.start()
        else:
            self.answers.put(reply)
        kind, payload = self.questions.get()
        if kind == "done":
            self.result = payload
            raise StopIteration
        if kind == "error":
            raise payload
        if kind == "cycle" and self.recharge_profile is not None:
            controller_s = payload.controller_s
            charge_times(payload, self.recharge_profile, None, pending=1, width=self.width)
            payload.controller_s = controller_s
        return kind, payload

    def close(self) -> None:
        if self._started and self._thread.is_alive():
            self.answers.put(_Abort)
            self._thread.join(timeout=60)


class LiveBackend:
    """The real engine on real prompts; times from the engine's clocks (or recharged from a profile)."""

    kind = "live"

    def __init__(
        self,
        engine: SpeculativeEngine,
        prompts: Sequence[list[int]],
        tree_width: int,
        max_new_tokens: int = 128,
        profile: CostProfile | None = None,
        timing: str = "wall",
    ):
        """``timing``: "wall" charges the engine's measured times (the point of the live backend);
        "profile" recharges every cycle from ``profile`` so that rewards are deterministic (used to run
        gymnasium's determinism checks, which wall-clock rewards cannot pass)."""
        if not prompts:
            raise ValueError("no prompts for the live backend")
        if timing not in ("wall", "profile") or (timing == "profile" and profile is None):
            raise ValueError("timing must be 'wall', or 'profile' with a profile")
        self.engine, self.prompts, self.width = engine, list(prompts), tree_width
        self.max_new_tokens, self.profile, self.timing = max_new_tokens, profile, timing
        self.num_episodes = len(self.prompts)

    def __deepcopy__(self, memo):
        return self  # shared by design (models, engine); per-episode state lives in each LiveLoop

    def new_episode(
        self, index: int, rng: np.random.Generator, depth_zero: bool = False, gate: bool = False
    ) -> LiveLoop:
        seed = int(rng.integers(2**31))
        return LiveLoop(
            self.engine,
            self.prompts[index],
            self.max_new_tokens,
            seed,
            self.width,
            self.profile if self.timing == "profile" else None,
            depth_zero=depth_zero,
            gate=gate,
        )

    def throughput_of(self, controller: Controller | None) -> float:
        results = [self.engine.generate(p, self.max_new_tokens, controller=controller) for p in self.prompts]
        return throughput([r.cycles for r in results])  # the cycles emit every token after the first
