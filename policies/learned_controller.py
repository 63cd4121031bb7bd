"""The learned controller on the inference path (torch only; ``policies.learned`` reads and writes its file):
``Actor`` (an exported PPO actor: the MLP from the normalised observation to action logits, decisions by argmax),
``LearnedController`` (depth and size from the two actors, observations from ``engine.costs.observation``), the
cost profile and context lookup a policy file's metadata carries (``stored_profile``, ``trained_lookup``), and
``PolicyFileError`` / ``PolicyFileWarning``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.backends.pair import ModelPair
from engine.control import Controller, DraftState
from engine.costs.cost_profile import CostProfile
from engine.costs.observation import (
    DeviceAtLoad,
    depth_observation,
    size_observation,
)
from engine.errors import DraftpilotError
from engine.lookup import LookupConfig, stored_lookup
from engine.results import CycleRecord

ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}


class PolicyFileError(DraftpilotError, ValueError):
    """A policy file that cannot be used: corrupt, another format, or features this code does not compute."""


class PolicyFileWarning(UserWarning):
    """A policy file loads, but something about it deserves attention (no integrity hash; another pair)."""


def _check_tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        raise PolicyFileError(
            f"{what} must be a floating-point tensor, got {type(value).__name__}"
            + (f" of {value.dtype}" if isinstance(value, torch.Tensor) else "")
        )
    if not bool(torch.isfinite(value).all()):
        raise PolicyFileError(f"{what} holds NaN or infinite values")
    return value


def _check_number(value: Any, what: str, low: float, low_open: bool = False, inf_ok: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or (math.isinf(value) and not (inf_ok and value > 0))
        or value < low
        or (low_open and value == low)
    ):
        kind = "a number (or inf)" if inf_ok else "a finite number"
        raise PolicyFileError(f"{what} must be {kind} {'>' if low_open else '>='} {low}, got {value!r}")
    return float(value)


class Actor:
    """Normalise, MLP, argmax: the deterministic action of one exported PPO policy."""

    def __init__(
        self, spec: dict[str, Any], obs_dim: int, num_actions: int, device: str | torch.device = "cpu"
    ):
        try:
            weights = [_check_tensor(w, f"actor weight {i}") for i, w in enumerate(spec["weights"])]
            biases = [_check_tensor(b, f"actor bias {i}") for i, b in enumerate(spec["biases"])]
            self.activation = ACTIVATIONS[spec["activation"]]
            self.activation_name = spec["activation"]
            obs_mean = _check_tensor(spec["obs_mean"], "observation mean")
            obs_var = _check_tensor(spec["obs_var"], "observation variance")
            epsilon = _check_number(spec["epsilon"], "normaliser epsilon", 0.0)
            self.clip_obs = _check_number(
                spec["clip_obs"], "clip_obs", 0.0, low_open=True, inf_ok=True
            )  # inf: no clip
        except (KeyError, TypeError, AttributeError) as err:
            raise PolicyFileError(f"actor entry is incomplete or malformed ({err!r})") from err
        if bool((obs_var < 0).any()) or not bool((obs_var.double() + epsilon > 0).all()):
            raise PolicyFileError(
                "observation variance must be >= 0 and variance + epsilon > 0 (the scale divides)"
            )
        self.weights = [w.to(device, torch.float32) for w in weights]
        self.biases = [b.to(device, torch.float32) for b in biases]
        self.obs_mean = obs_mean.to(device, torch.float32)
        self.obs_std = torch.sqrt(obs_var.to(device, torch.float32) + epsilon)
        if not bool(torch.isfinite(self.obs_std).all()) or not bool((self.obs_std > 0).all()):
            raise PolicyFileError(
                "observation scale sqrt(variance + epsilon) is not finite and positive in float32"
            )
        dims = [obs_dim] + [w.shape[0] for w in self.weights]
        if (
            len(self.weights) != len(self.biases)
            or not self.weights
            or any(w.shape != (o, i) for w, i, o in zip(self.weights, dims, dims[1:]))
            or any(b.shape != (w.shape[0],) for w, b in zip(self.weights, self.biases))
            or dims[-1] != num_actions
            or self.obs_mean.shape != (obs_dim,)
            or self.obs_std.shape != (obs_dim,)
        ):
            raise PolicyFileError(
                f"actor shapes do not fit {obs_dim} observations -> {num_actions} actions "
                f"(layers {[tuple(w.shape) for w in self.weights]})"
            )
        self.device = torch.device(device)
        # on the CPU the decision runs in numpy: torch's per-operation dispatch and its thread pool, woken
        # after the native decoder's forward, cost ~15 us and ~130 us a decision inside the engine
        # (benchmarks/policy_overhead.py: 375 -> 230 us a controller call, 1.2% -> 0.8% of cycle time)
        self._numpy = None
        if self.device.type == "cpu":
            self._numpy = (
                [np.ascontiguousarray(w.numpy().T) for w in self.weights],
                [b.numpy() for b in self.biases],
                self.obs_mean.numpy(),
                self.obs_std.numpy(),
                np.tanh if self.activation_name == "tanh" else (lambda v: np.maximum(v, np.float32(0.0))),
            )

    @torch.inference_mode()
    def logits(self, obs: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(obs, dtype=torch.float32, device=self.device)
        x = torch.clamp((x - self.obs_mean) / self.obs_std, -self.clip_obs, self.clip_obs)
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = torch.nn.functional.linear(x, w, b)
            if i < last:
                x = self.activation(x)
        return x

    def act(self, obs: np.ndarray) -> int:
        """The argmax action of ``logits(obs)`` (computed in float32 numpy on the CPU)."""
        if self._numpy is None:
            return int(torch.argmax(self.logits(obs), dim=-1))
        weights, biases, mean, std, activation = self._numpy
        x = np.clip((np.asarray(obs, dtype=np.float32) - mean) / std, -self.clip_obs, self.clip_obs)
        last = len(weights) - 1
        for i, (w, b) in enumerate(zip(weights, biases)):
            x = x @ w + b
            if i < last:
                x = activation(x)
        return int(np.argmax(x))

    def to_spec(self) -> dict[str, Any]:
        return {
            "weights": [w.cpu() for w in self.weights],
            "biases": [b.cpu() for b in self.biases],
            "activation": self.activation_name,
            "obs_mean": self.obs_mean.cpu(),
            "obs_var": (self.obs_std.cpu() ** 2),
            "clip_obs": self.clip_obs,
            "epsilon": 0.0,
        }


def stored_profile(data: Any) -> CostProfile | None:
    """The cost profile a policy file carries (its ``profile`` entry), or None when it carries none or one
    this code cannot read (the policy still runs; only its load-aware device features need it)."""
    if not isinstance(data, dict) or not data.get("contexts"):
        return None
    known = {f.name for f in dataclasses.fields(CostProfile)}
    try:
        return CostProfile(**{k: v for k, v in data.items() if k in known})
    except (TypeError, ValueError, DraftpilotError):
        return None


def trained_lookup(meta: dict | None) -> LookupConfig | None:
    """The context lookup a policy file's metadata says it was trained for: the setting train.py resolved, with
    the load limit it tuned (``metrics["lookup"]``), else the one it was asked for (``train_config["lookup"]``;
    None: none, also for files stored before the setting)."""
    meta = meta or {}
    tuned = (meta.get("metrics") or {}).get("lookup")
    if isinstance(tuned, str):
        return stored_lookup(tuned)
    return stored_lookup((meta.get("train_config") or {}).get("lookup", "off"))


class LearnedController(Controller):
    """Depth (continue/stop) and size (ladder index) from exported PPO actors.

    Either actor may be ``None`` during co-adaptive training; that decision then comes from ``fallback``
    (a baseline controller). Exported files always hold both.
    """

    def __init__(
        self,
        depth_actor: Actor | None,
        size_actor: Actor | None,
        *,
        size_ladder: Sequence[int],
        tree_width: int,
        max_depth: int,
        device_feats: np.ndarray,
        fallback: Controller | None = None,
        meta: dict[str, Any] | None = None,
        depth_zero: bool = False,
        loads: DeviceAtLoad | None = None,
        lookup_gate: bool = False,
    ):
        """``depth_zero``: the depth actor was trained to decide depth 0 too (draft at all?); policies
        trained without it always draft. ``loads``: the device features at each load (a batched engine
        shows the controller its load, ``DraftState.load``); None: ``device_feats`` whatever the load.
        ``lookup_gate``: the depth actor was trained to decide context lookup too (``use_lookup``: its answer
        in the state that shows the proposal's length); without it the engine's lookup rule decides."""
        if (depth_actor is None or size_actor is None) and fallback is None:
            raise ValueError("a LearnedController without both actors needs a fallback controller")
        if fallback is not None and fallback.tree_width != tree_width:
            raise ValueError(f"fallback tree_width {fallback.tree_width} != {tree_width}")
        self.depth_actor, self.size_actor, self.fallback = depth_actor, size_actor, fallback
        self.size_ladder = tuple(int(s) for s in size_ladder)
        self.tree_width, self.max_depth = int(tree_width), int(max_depth)
        self.device_feats = np.asarray(device_feats, dtype=np.float32)
        self.meta = meta or {}
        self.decides_depth_zero = bool(depth_zero)
        self.decides_lookup = bool(lookup_gate) and depth_actor is not None
        self.loads = loads

    def _device(self, state: DraftState) -> np.ndarray:
        if self.loads is None or state.load is None or state.load.alone:
            return self.device_feats
        return self.loads.at(state.load)

    def _capped(self, state: DraftState) -> DraftState:
        # the policy was trained on trees of depth <= max_depth (replay's cap): show it the same cap
        if state.max_depth <= self.max_depth:
            return state
        return dataclasses.replace(state, max_depth=self.max_depth)

    def reset(self) -> None:
        if self.fallback is not None:
            self.fallback.reset()

    def should_continue(self, state: DraftState) -> bool:
        if state.depth >= self.max_depth:
            return False
        if self.depth_actor is None:
            if state.depth == 0 and not self.fallback.decides_depth_zero:
                return True
            return self.fallback.should_continue(state)
        return bool(self.depth_actor.act(depth_observation(self._capped(state), self._device(state))))

    def use_lookup(self, state: DraftState) -> bool:
        if self.depth_actor is None:
            return self.fallback.use_lookup(state)
        return bool(self.depth_actor.act(depth_observation(self._capped(state), self._device(state))))

    def num_to_verify(self, state: DraftState) -> int:
        if self.size_actor is None:
            return self.fallback.num_to_verify(state)
        return self.size_ladder[
            self.size_actor.act(size_observation(self._capped(state), self._device(state)))
        ]

    def observe(self, record: CycleRecord) -> None:
        if self.fallback is not None:
            self.fallback.observe(record)

    @property
    def trained_lookup(self) -> LookupConfig | None:
        """The context lookup the policy was trained for (``train.py --lookup``; None: none, also for files
        stored before the setting): run it on ``SpeculativeEngine(..., EngineConfig(lookup=this))``."""
        return trained_lookup(self.meta)

    def pair_warning(self, pair: ModelPair) -> str | None:
        """A one-line warning when this policy was trained for another pair or weight format than ``pair``
        (a ``ModelPair``) runs; None when they match or the policy does not say. Decoding stays exact either
        way; the policy's depth and size choices were tuned for the acceptance and costs it was trained on."""
        trained = self.meta.get("pair")
        where = f"the policy {self.meta['path']}" if self.meta.get("path") else "the policy"
        tail = "; decoding stays exact, but its decisions were tuned for the other pair (retrain it for this one)"
        if trained and trained != pair.name:
            return f"{where} was trained for pair {trained!r} and runs on {pair.name!r}{tail}"
        profile = self.meta.get("profile")
        precision = (profile.get("meta") or {}).get("dtype") if isinstance(profile, dict) else None
        if trained and precision and precision != pair.precision:
            return f"{where} was trained with {precision} weights and runs with {pair.precision}{tail}"
        return None

    def __repr__(self) -> str:
        parts = [f"tree_width={self.tree_width}", f"max_depth={self.max_depth}"]
        if self.meta.get("path"):
            parts.insert(0, repr(str(self.meta["path"])))
        return f"LearnedController({', '.join(parts)})"
