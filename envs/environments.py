"""Gymnasium environments for the two decisions (depth: continue/stop; size: how many nodes to verify),
each over either backend (``envs.backends``: exact replay or the live engine).

``DepthEnv`` and ``SizeEnv`` take any backend; the registered ids name theirs (``envs/__init__.py``:
``draftpilot/ReplayDepth-v0`` passes ``backend_kind="replay"``) and refuse the other one with
``WrongBackendError``, so an id in a log says where its numbers came from.

The problems share one episode driver protocol; they differ only in which decision the agent makes and
which one a pluggable ``Controller`` makes (static, analytic or a learned policy: co-adaptive training).
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from engine.control import Controller, StaticController
from engine.costs.observation import (
    DEPTH_OBS_DIM,
    DEPTH_OBS_HIGH,
    SIZE_OBS_DIM,
    SIZE_OBS_HIGH,
    DeviceAtLoad,
    depth_observation,
    device_features,
    size_observation,
)
from engine.costs.speedup_model import SIZE_LADDER
from engine.cycle import answer
from engine.errors import DraftpilotError
from envs.backends import Backend


class WrongBackendError(DraftpilotError, ValueError):
    """An environment id that names one backend was given the other (``draftpilot/LiveDepth-v0`` with a
    ``ReplayBackend``, or ``draftpilot/ReplayDepth-v0`` with a ``LiveBackend``)."""


class NoDecisionError(DraftpilotError, ValueError):
    """Every episode runs to its end without the decision this environment trains (e.g. a size environment
    whose depth controller never drafts)."""


@dataclass(frozen=True)
class EnvConfig:
    """Reward and episode settings shared by all four environments."""

    reward: str = "average"
    """"average": emitted - rho * time per cycle (dense: -rho * t_draft on each continue); "throughput":
    LTD's per-cycle emitted / cycle time, divided by rho (scale only)."""
    rho: float | None = None
    """Initial tokens/s for the average reward (None: a reference static controller's replay throughput)."""
    rho_update: float = 0.0
    """After each episode rho moves this fraction toward the episode's throughput. 0 (default) keeps the
    environment deterministic given its seed; the trainer moves rho between rollouts instead (``set_rho``)."""
    size_ladder: tuple[int, ...] = SIZE_LADDER
    """Verification sizes the size action indexes (capped by the nodes drafted)."""
    depth_zero: bool = False
    """Also decide depth 0 (draft at all this cycle?): the depth agent is asked before the first draft
    step, and "stop" there makes the cycle an autoregressive step."""
    lookup_gate: bool = False
    """The depth agent also decides context lookup (``engine.control.Controller.decides_lookup``): where the
    backend's lookup proposes, it is asked before drafting with the proposal's length in its observation
    (``DraftState.lookup_proposed``), 1 verifying the proposal and 0 going on to its own cycle; the lookup's
    load limit does not apply. In a size environment the depth controller decides, if it ``decides_lookup``."""

    def __post_init__(self) -> None:
        if self.reward not in ("average", "throughput"):
            raise ValueError(f"reward must be 'average' or 'throughput', got {self.reward!r}")


def reference_rho(backend: Backend) -> float:
    """Throughput of a middle-of-the-road static setting on the backend: the starting point for rho."""
    width = backend.width
    return backend.throughput_of(StaticController(depth=4, verify=4 if width == 1 else 8, tree_width=width))


class _DecisionEnv(gym.Env):
    metadata = {"render_modes": []}
    decision = ""  # "depth" or "size": the backend message the agent answers

    @property
    def decisions(self) -> tuple[str, ...]:
        """The backend messages the agent answers."""
        return (self.decision,)

    @property
    def _gate(self) -> bool:
        """Whether the episodes ask ``use_lookup`` questions (``EnvConfig.lookup_gate``)."""
        return False

    def __init__(
        self,
        backend: Backend,
        other: Controller,
        config: EnvConfig | None = None,
        backend_kind: str | None = None,
    ):
        kind = getattr(backend, "kind", None)
        if backend_kind is not None and kind != backend_kind:
            env_id = f"draftpilot/{backend_kind.capitalize()}{self.decision.capitalize()}-v0"
            other_id = f"draftpilot/{str(kind).capitalize()}{self.decision.capitalize()}-v0"
            raise WrongBackendError(
                f"{env_id} runs on a {backend_kind} backend, got a {type(backend).__name__} (kind {kind!r})"
                + (f": make {other_id} for it" if kind in ("replay", "live") else "")
            )
        if other.tree_width != backend.width:
            raise ValueError(
                f"controller tree_width {other.tree_width} != backend tree width {backend.width}"
            )
        self.backend, self.profile, self.other = backend, backend.profile, other
        self.config = config or EnvConfig()
        self.width = backend.width
        self.device = device_features(self.profile, self.width)
        self.loads = DeviceAtLoad(self.profile, self.width, alone=self.device)
        self.rho = float(self.config.rho or reference_rho(backend))
        self._loop = None
        self._kind = self.decision  # the kind of the decision pending (the depth agent's: "use_lookup" too)
        self.last_result = None
        """The live engine's GenerationResult of the last finished episode (None in replay)."""

    # --------------------------------------------------------------------------------------- episode
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        index = (options or {}).get("episode")
        first = int(self.np_random.integers(self.backend.num_episodes) if index is None else index)
        # an episode can hold no decision at all (EOS at once, a budget of one or two tokens): skip it
        for k in range(self.backend.num_episodes):
            self.episode_index = (first + k) % self.backend.num_episodes
            self.close()  # an unfinished live request must release its engine thread
            self._draw_profile()
            kwargs = {} if self.profile is self.backend.profile else {"profile": self.profile}
            if self._gate:
                kwargs["gate"] = True
            self._loop = self.backend.new_episode(
                self.episode_index, self.np_random, depth_zero=self.config.depth_zero, **kwargs
            )
            self.other.reset()
            self.ep_tokens, self.ep_seconds, self._continues = 0, 0.0, 0
            obs, _, terminated, info = self._advance(None)
            if not terminated:
                return obs, info
        raise NoDecisionError(f"no episode of this backend has a {self.decision} decision to make")

    def _draw_profile(self) -> None:
        """A backend with a profile mix (randomised training) gives every episode its own cost profile: the
        times, the dense draft-step credit and the device features all follow it, and so does the other
        decision's controller when it observes device features (a learned one in co-adaptive training)."""
        sample = getattr(self.backend, "sample_profile", None)
        if sample is None or getattr(self.backend, "profiles", None) is None:
            return
        self.profile = sample(self.np_random)
        self.device = device_features(self.profile, self.width)
        self.loads = DeviceAtLoad(self.profile, self.width, alone=self.device)
        if hasattr(self.other, "device_feats"):
            self.other.device_feats = self.device
        if getattr(self.other, "loads", None) is not None:
            self.other.loads = self.loads

    def step(self, action):
        if self._loop is None:
            raise RuntimeError("call reset() before step()")
        reply, reward = self._act(action)
        obs, more, terminated, info = self._advance(reply)
        return obs, float(reward + more), terminated, False, info

    def _advance(self, reply):
        """Run the driver until the agent's next decision; returns (obs, reward earned, terminated, info)."""
        reward, info = 0.0, {}
        while True:
            try:
                kind, payload = self._loop.send(reply)
            except StopIteration:
                self.last_result, self._loop = getattr(self._loop, "result", None), None
                info.update(
                    episode_tokens=self.ep_tokens,
                    episode_s=self.ep_seconds,
                    episode_tokens_per_s=self.ep_tokens / max(self.ep_seconds, 1e-12),
                    rho=self.rho,
                )
                if self.config.rho_update and self.ep_seconds > 0:
                    self.rho += self.config.rho_update * (self.ep_tokens / self.ep_seconds - self.rho)
                return np.zeros(self.observation_space.shape, np.float32), reward, True, info
            if kind in self.decisions:
                self._kind, self._state = kind, payload
                return self._observe(payload), reward, False, info
            if kind == "cycle":
                reward += self._cycle_reward(payload)
                self.ep_tokens += payload.emitted
                self.ep_seconds += payload.total_s - payload.controller_s
                info = {
                    "accepted": payload.accepted,
                    "emitted": payload.emitted,
                    "depth": payload.depth,
                    "num_verified": payload.num_verified,
                    "cycle_s": payload.total_s - payload.controller_s,
                }
            # the other decision's controller answers and observes as in the engine (``engine.cycle.answer``:
            # at depth 0 only a controller that decides depth 0 is asked; a lookup cycle is not observed)
            reply = answer(self.other, (kind, payload))

    @property
    def decision_kind(self) -> str:
        """The kind of the decision the agent is asked now: ``decision``, or ``"use_lookup"`` (a depth agent
        that decides context lookup, ``EnvConfig.lookup_gate``)."""
        return self._kind

    @property
    def decision_state(self):
        """The ``DraftState`` of the decision the agent is asked now (the observation is made from it)."""
        return self._state

    def set_rho(self, rho: float) -> None:
        """The average reward's tokens/s (the trainer moves it toward the policy's throughput)."""
        self.rho = float(rho)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
        self._loop = None

    def _cycle_reward(self, rec) -> float:
        # controller time is excluded: live, it includes the agent's own thinking; the policy-call cost of
        # a deployed policy is measured separately
        seconds = rec.total_s - rec.controller_s
        if self.config.reward == "throughput":
            return rec.emitted / max(seconds, 1e-12) / self.rho
        return rec.emitted - self.rho * (seconds - self._charged_draft(rec))

    def _charged_draft(self, rec) -> float:
        return 0.0


class DepthEnv(_DecisionEnv):
    """Depth decision.

    Description: one step per draft step of the speculative engine: after each step the agent says
    whether to draft one more level; the verification size comes from a pluggable controller. Replay
    backend: the trajectory and every cycle's outcome are exact (recorded traces), times come from a cost
    profile; live backend: the real engine and its clocks.

    Action Space: ``Discrete(2)``: 0 = stop drafting and verify, 1 = draft one more level (the engine
    stops by itself at its depth cap).

    Observation Space: ``Box(0, 64, (DEPTH_OBS_DIM,), float32)``: ``engine.costs.observation.depth_observation``
    (frontier path probabilities, last-step probabilities, depth, cap, log context, history, device).

    Rewards: "average": -rho * t_draft_step for each continue, emitted - rho * (rest of the cycle time) at
    the end of each cycle (sum over a cycle: emitted - rho * T_cycle); "throughput": emitted / T_cycle / rho
    at the end of each cycle (LTD).

    Episode End: terminated when the request is finished (EOS, token budget or context limit; in replay:
    the recorded trajectory is fully committed); never truncated.
    """

    decision = "depth"

    @property
    def decisions(self) -> tuple[str, ...]:
        return ("depth", "use_lookup") if self.config.lookup_gate else ("depth",)

    @property
    def _gate(self) -> bool:
        return self.config.lookup_gate

    def __init__(
        self,
        backend: Backend,
        size_controller: Controller,
        config: EnvConfig | None = None,
        backend_kind: str | None = None,
    ):
        super().__init__(backend, size_controller, config, backend_kind)
        self.observation_space = gym.spaces.Box(0.0, DEPTH_OBS_HIGH, (DEPTH_OBS_DIM,), np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def _observe(self, state):
        return depth_observation(state, self.loads.at(state.load))

    def _act(self, action):
        go = bool(int(action))
        reward = 0.0
        if self._kind == "use_lookup":  # verify the lookup's proposal? (no draft step to charge)
            return go, reward
        if go:
            self._continues += 1
            if self.config.reward == "average":
                reward = -self.rho * self._step_s()
        return go, reward

    def _step_s(self) -> float:
        return self.profile.draft_step_s(self.width, self._state.context_len) if self.profile else 0.0

    def _charged_draft(self, rec) -> float:
        charged = self._continues * self._step_s() if self.profile else 0.0
        self._continues = 0
        return charged


class SizeEnv(_DecisionEnv):
    """Size decision (replay or live backend, as for ``DepthEnv``).

    Description: one step per cycle: after drafting (depth from a pluggable controller) the agent picks
    how many of the drafted nodes (top by score) the target verifies.

    Action Space: ``Discrete(len(size_ladder))``: index into the size ladder (1, 2, 3, 4, 6, 8, 12, 16,
    24, 32, 48, 64 by default), capped by the number of nodes drafted.

    Observation Space: ``Box(0, 64, (SIZE_OBS_DIM,), float32)``: ``engine.costs.observation.size_observation``
    (top-64 node path probabilities, their running sums, depth, cap, log context, history, device).

    Rewards: "average": emitted - rho * T_cycle; "throughput": emitted / T_cycle / rho (LTD).

    Episode End: terminated when the request is finished; never truncated.
    """

    decision = "size"

    @property
    def _gate(self) -> bool:
        return self.config.lookup_gate and self.other.decides_lookup

    def __init__(
        self,
        backend: Backend,
        depth_controller: Controller,
        config: EnvConfig | None = None,
        backend_kind: str | None = None,
    ):
        super().__init__(backend, depth_controller, config, backend_kind)
        self.observation_space = gym.spaces.Box(0.0, SIZE_OBS_HIGH, (SIZE_OBS_DIM,), np.float32)
        self.action_space = gym.spaces.Discrete(len(self.config.size_ladder))

    def _observe(self, state):
        return size_observation(state, self.loads.at(state.load))

    def _act(self, action):
        return self.config.size_ladder[int(action)], 0.0
