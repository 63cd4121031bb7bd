"""Exported PPO policies on the inference path: ``policy.pt`` -> ``LearnedController`` (torch only).

File format (``torch.save`` of plain types and tensors, read back with ``weights_only=True``)::

    {"format": "draftpilot-policy", "format_version": 1, "feature_version": engine.costs.features.FEATURE_VERSION,
     "depth": ACTOR, "size": ACTOR, "size_ladder": [1, 2, ...], "tree_width": W, "max_depth": D,
     "depth_zero": bool, "device_features": [6 floats], "pair": str, "profile": JSON str,
     "train_config": JSON str, "metrics": JSON str, "payload_sha256": hex str}
    ACTOR = {"weights": [tensor, ...], "biases": [tensor, ...], "activation": "tanh" | "relu",
             "obs_mean": tensor, "obs_var": tensor, "clip_obs": float, "epsilon": float}

An actor is the MLP that maps the normalised observation to action logits (stable-baselines3's
``mlp_extractor.policy_net`` followed by ``action_net``); decisions are the argmax (deterministic).
Observations come from ``engine.costs.features``: the same functions the environments use in training.

Integrity: ``payload_sha256`` is a SHA-256 over every other entry (tensors by dtype, shape and bytes; the
other values by type and value; ``payload_digest``), computed by ``save_policy``. ``load_policy`` recomputes
it and refuses a file whose payload changed since it was saved (a flipped byte, an edited value). Files
written before the hash existed still load, with a ``PolicyFileWarning`` that they cannot be checked. Every
file is also validated: finite weights and normaliser, a positive normaliser scale, a size ladder of
distinct ascending sizes in [0, 64], 1 <= max_depth <= 127, a tree width >= 1. A policy records the pair it
was trained for (``pair``, and the cost profile's weight format); ``LearnedController.pair_warning`` says when
it runs on another one (decoding stays exact: only its speed is at stake).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.backends.attention import MAX_VERIFY_NODES
from engine.backends.files import atomic_save, load_plain
from engine.backends.pair import ModelPair
from engine.control import Controller, DraftState
from engine.costs.cost_profile import CostProfile
from engine.costs.features import (
    DEPTH_OBS_DIM,
    FEATURE_VERSION,
    NUM_DEVICE_FEATURES,
    SIZE_OBS_DIM,
    DeviceAtLoad,
    depth_observation,
    device_features,
    size_observation,
)
from engine.errors import DraftpilotError, is_int
from engine.lookup import LookupConfig, stored_lookup
from engine.results import CycleRecord

FORMAT = "draftpilot-policy"
FORMAT_VERSION = 1
ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}
HASH_KEY = "payload_sha256"
MAX_POLICY_DEPTH = 127
"""Largest depth cap a policy may carry (the trace format's depth limit: policies train on traces)."""


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
    ):
        """``depth_zero``: the depth actor was trained to decide depth 0 too (draft at all?); policies
        trained without it always draft. ``loads``: the device features at each load (a batched engine
        shows the controller its load, ``DraftState.load``); None: ``device_feats`` whatever the load."""
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


def save_policy(
    path: str | Path,
    depth_actor: Actor,
    size_actor: Actor,
    *,
    size_ladder: Sequence[int],
    tree_width: int,
    max_depth: int,
    device_feats: np.ndarray,
    pair: str,
    profile: dict | None,
    train_config: dict | None = None,
    metrics: dict | None = None,
    depth_zero: bool = False,
) -> Path:
    """Write one standalone policy file (both actors and everything needed to use them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "feature_version": FEATURE_VERSION,
        "depth": depth_actor.to_spec(),
        "size": size_actor.to_spec(),
        "size_ladder": [int(s) for s in size_ladder],
        "tree_width": int(tree_width),
        "max_depth": int(max_depth),
        "depth_zero": bool(depth_zero),
        "device_features": [float(x) for x in np.asarray(device_feats).ravel()],
        "pair": str(pair),
        "profile": json.dumps(profile, default=str),
        "train_config": json.dumps(train_config or {}, default=str),
        "metrics": json.dumps(metrics or {}, default=str),
    }
    _check_fields(payload, "the policy to save")  # never write a file load_policy would refuse
    payload[HASH_KEY] = payload_digest(payload)
    # atomic: never leave a half-written policy where a user would load it
    return atomic_save(path, lambda tmp: torch.save(payload, tmp))


def payload_digest(payload: dict[str, Any]) -> str:
    """SHA-256 (hex) of a policy payload without its ``payload_sha256`` entry: tensors by dtype, shape and
    bytes, other values by type and value, dict entries in key order."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in payload.items() if k != HASH_KEY})
    return digest.hexdigest()


def _feed(digest, obj: Any) -> None:
    if isinstance(obj, dict):
        digest.update(b"{%d;" % len(obj))
        for key in sorted(obj, key=str):
            _feed(digest, str(key))
            _feed(digest, obj[key])
    elif isinstance(obj, (list, tuple)):
        digest.update(b"[%d;" % len(obj))
        for value in obj:
            _feed(digest, value)
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"t{t.dtype}{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        digest.update(b"s%d;" % len(data) + data)
    elif isinstance(obj, bool) or obj is None:
        digest.update(f"c{obj};".encode())
    elif isinstance(obj, int):
        digest.update(f"i{obj};".encode())
    elif isinstance(obj, float):
        digest.update(f"f{obj!r};".encode())  # repr round-trips every float exactly
    else:
        raise PolicyFileError(f"a policy file holds only tensors and plain values, not {type(obj).__name__}")


REQUIRED_KEYS = (
    "depth",
    "size",
    "size_ladder",
    "tree_width",
    "max_depth",
    "device_features",
    "profile",
    "train_config",
    "metrics",
)


def _check_fields(data: dict[str, Any], where: str) -> None:
    """Types and ranges of the non-actor entries (``PolicyFileError`` naming the entry)."""
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise PolicyFileError(f"{where} is missing or has malformed metadata (missing {', '.join(missing)})")
    ladder = data["size_ladder"]
    if (
        not isinstance(ladder, (list, tuple))
        or not ladder
        or not all(is_int(s) for s in ladder)
        or any(not 0 <= s <= MAX_VERIFY_NODES for s in ladder)
        or list(ladder) != sorted(set(ladder))
    ):
        raise PolicyFileError(
            f"{where}: size_ladder must be distinct ascending integers in [0, {MAX_VERIFY_NODES}], "
            f"got {str(ladder)[:80]}"
        )
    for key, low, high in (("tree_width", 1, None), ("max_depth", 1, MAX_POLICY_DEPTH)):
        value = data[key]
        if not is_int(value) or value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise PolicyFileError(f"{where}: {key} must be an integer {bound}, got {value!r}")
    if not isinstance(data.get("depth_zero", False), bool):
        raise PolicyFileError(f"{where}: depth_zero must be a bool, got {data['depth_zero']!r}")
    feats = data["device_features"]
    if (
        not isinstance(feats, (list, tuple))
        or len(feats) != NUM_DEVICE_FEATURES
        or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in feats
        )
    ):
        raise PolicyFileError(
            f"{where}: device_features must be {NUM_DEVICE_FEATURES} finite numbers, got {str(feats)[:80]}"
        )
    if not isinstance(data.get("pair", ""), str):
        raise PolicyFileError(f"{where}: pair must be a string, got {data['pair']!r}")


def load_policy(
    path: str | Path,
    device: str | torch.device = "cpu",
    profile: CostProfile | None = None,
    pair: ModelPair | None = None,
) -> LearnedController:
    """A ``LearnedController`` from an exported ``policy.pt``.

    ``profile`` (a ``CostProfile``) replaces the device features stored at training time, so a policy can
    be conditioned on the device it runs on; by default it sees the training device's features.
    ``pair`` (a ``ModelPair``, optional): warn (``PolicyFileWarning``) when the policy was trained for another.
    Raises ``FileNotFoundError`` or ``PolicyFileError`` (corrupt or modified file, other format, other feature
    spec, values out of range); a file without a payload hash (older exports) loads with a
    ``PolicyFileWarning``.
    """
    path = Path(path)
    if path.is_dir():
        hint = f" (did you mean {path / 'policy.pt'}?)" if (path / "policy.pt").is_file() else ""
        raise IsADirectoryError(f"{path} is a directory, not a policy file{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"no policy file at {path}: train one with `python train.py`")
    try:
        data = load_plain(path)
    except ValueError as err:
        raise PolicyFileError(f"{path} is not a readable policy file: {err}") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PolicyFileError(f"{path} is not a draftpilot policy file")
    if data.get("format_version") != FORMAT_VERSION:
        raise PolicyFileError(
            f"{path} has policy format version {data.get('format_version')!r}; this code "
            f"reads version {FORMAT_VERSION}"
        )
    if data.get("feature_version") != FEATURE_VERSION:
        raise PolicyFileError(
            f"{path} was trained on observation features version {data.get('feature_version')!r} "
            f"but this code computes version {FEATURE_VERSION}: retrain it with `python train.py`"
        )
    if HASH_KEY in data:
        try:
            actual = payload_digest(data)
        except PolicyFileError as err:
            raise PolicyFileError(f"{path}: {err}") from None
        if data[HASH_KEY] != actual:
            raise PolicyFileError(
                f"{path} fails its integrity check (payload sha256 {actual[:12]}..., saved "
                f"{str(data[HASH_KEY])[:12]}...): it was modified or corrupted after it was saved"
            )
    else:
        warnings.warn(
            f"{path} has no payload hash (exported before policy files carried one), so it cannot be "
            "checked for corruption; its values are still validated",
            PolicyFileWarning,
            stacklevel=2,
        )
    _check_fields(data, str(path))
    try:
        ladder = [int(s) for s in data["size_ladder"]]
        width, max_depth = int(data["tree_width"]), int(data["max_depth"])
        depth_zero = bool(data.get("depth_zero", False))  # files written before depth 0 existed: always draft
        feats = np.asarray(data["device_features"], dtype=np.float32)
        meta = {key: json.loads(data[key]) for key in ("profile", "train_config", "metrics")}
    except (KeyError, TypeError, ValueError) as err:
        raise PolicyFileError(f"{path} is missing or has malformed metadata ({err!r})") from err
    try:
        depth = Actor(data["depth"], DEPTH_OBS_DIM, 2, device)
        size = Actor(data["size"], SIZE_OBS_DIM, len(ladder), device)
    except PolicyFileError as err:
        raise PolicyFileError(f"{path}: {err}") from None
    if profile is not None:
        feats = device_features(profile, width)
    else:
        profile = stored_profile(meta.get("profile"))
    loads = DeviceAtLoad(profile, width, alone=feats) if profile is not None else None
    meta.update(pair=data.get("pair"), path=str(path))
    controller = LearnedController(
        depth,
        size,
        size_ladder=ladder,
        tree_width=width,
        max_depth=max_depth,
        device_feats=feats,
        meta=meta,
        depth_zero=depth_zero,
        loads=loads if loads is not None and loads.available else None,
    )
    if pair is not None and (message := controller.pair_warning(pair)):
        warnings.warn(message, PolicyFileWarning, stacklevel=2)
    return controller
