"""Exported PPO policies on the inference path: ``policy.pt`` -> ``LearnedController`` (torch only).

File format (``torch.save`` of plain types and tensors, read back with ``weights_only=True``)::

    {"format": "draftpilot-policy", "format_version": 1, "feature_version": engine.features.FEATURE_VERSION,
     "depth": ACTOR, "size": ACTOR, "size_ladder": [1, 2, ...], "tree_width": W, "max_depth": D,
     "device_features": [3 floats], "pair": str, "profile": JSON str, "train_config": JSON str,
     "metrics": JSON str}
    ACTOR = {"weights": [tensor, ...], "biases": [tensor, ...], "activation": "tanh" | "relu",
             "obs_mean": tensor, "obs_var": tensor, "clip_obs": float, "epsilon": float}

An actor is the MLP that maps the normalised observation to action logits (stable-baselines3's
``mlp_extractor.policy_net`` followed by ``action_net``); decisions are the argmax (deterministic).
Observations come from ``engine.features``: the same functions the environments use in training.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.control import Controller, DraftState
from engine.errors import DraftpilotError
from engine.features import (
    DEPTH_OBS_DIM,
    FEATURE_VERSION,
    SIZE_OBS_DIM,
    depth_observation,
    device_features,
    size_observation,
)

FORMAT = "draftpilot-policy"
FORMAT_VERSION = 1
ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}


class PolicyFileError(DraftpilotError, ValueError):
    """A policy file that cannot be used: corrupt, another format, or features this code does not compute."""


class Actor:
    """Normalise, MLP, argmax: the deterministic action of one exported PPO policy."""

    def __init__(self, spec: dict[str, Any], obs_dim: int, num_actions: int, device: str | torch.device = "cpu"):
        try:
            self.weights = [w.to(device, torch.float32) for w in spec["weights"]]
            self.biases = [b.to(device, torch.float32) for b in spec["biases"]]
            self.activation = ACTIVATIONS[spec["activation"]]
            self.activation_name = spec["activation"]
            self.obs_mean = spec["obs_mean"].to(device, torch.float32)
            self.obs_std = torch.sqrt(spec["obs_var"].to(device, torch.float32) + float(spec["epsilon"]))
            self.clip_obs = float(spec["clip_obs"])
        except (KeyError, TypeError, AttributeError) as err:
            raise PolicyFileError(f"actor entry is incomplete or malformed ({err!r})") from err
        dims = [obs_dim] + [w.shape[0] for w in self.weights]
        if (len(self.weights) != len(self.biases) or not self.weights
                or any(w.shape != (o, i) for w, i, o in zip(self.weights, dims, dims[1:]))
                or any(b.shape != (w.shape[0],) for w, b in zip(self.weights, self.biases))
                or dims[-1] != num_actions or self.obs_mean.shape != (obs_dim,) or self.obs_std.shape != (obs_dim,)):
            raise PolicyFileError(f"actor shapes do not fit {obs_dim} observations -> {num_actions} actions "
                                  f"(layers {[tuple(w.shape) for w in self.weights]})")
        self.device = torch.device(device)

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
        return int(torch.argmax(self.logits(obs), dim=-1))

    def to_spec(self) -> dict[str, Any]:
        return {"weights": [w.cpu() for w in self.weights], "biases": [b.cpu() for b in self.biases],
                "activation": self.activation_name, "obs_mean": self.obs_mean.cpu(),
                "obs_var": (self.obs_std.cpu() ** 2), "clip_obs": self.clip_obs, "epsilon": 0.0}


class LearnedController(Controller):
    """Depth (continue/stop) and size (ladder index) from exported PPO actors.

    Either actor may be ``None`` during co-adaptive training; that decision then comes from ``fallback``
    (a baseline controller). Exported files always hold both.
    """

    def __init__(self, depth_actor: Actor | None, size_actor: Actor | None, *, size_ladder: Sequence[int],
                 tree_width: int, max_depth: int, device_feats: np.ndarray, fallback: Controller | None = None,
                 meta: dict[str, Any] | None = None, depth_zero: bool = False):
        """``depth_zero``: the depth actor was trained to decide depth 0 too (draft at all?); policies
        trained without it always draft."""
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
        return bool(self.depth_actor.act(depth_observation(self._capped(state), self.device_feats)))

    def num_to_verify(self, state: DraftState) -> int:
        if self.size_actor is None:
            return self.fallback.num_to_verify(state)
        return self.size_ladder[self.size_actor.act(size_observation(self._capped(state), self.device_feats))]

    def observe(self, record) -> None:
        if self.fallback is not None:
            self.fallback.observe(record)

    def __repr__(self) -> str:
        parts = [f"tree_width={self.tree_width}", f"max_depth={self.max_depth}"]
        if self.meta.get("path"):
            parts.insert(0, repr(str(self.meta["path"])))
        return f"LearnedController({', '.join(parts)})"


def save_policy(path: str | Path, depth_actor: Actor, size_actor: Actor, *, size_ladder: Sequence[int],
                tree_width: int, max_depth: int, device_feats: np.ndarray, pair: str, profile: dict | None,
                train_config: dict | None = None, metrics: dict | None = None, depth_zero: bool = False) -> Path:
    """Write one standalone policy file (both actors and everything needed to use them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "feature_version": FEATURE_VERSION,
        "depth": depth_actor.to_spec(), "size": size_actor.to_spec(), "size_ladder": [int(s) for s in size_ladder],
        "tree_width": int(tree_width), "max_depth": int(max_depth), "depth_zero": bool(depth_zero),
        "device_features": [float(x) for x in np.asarray(device_feats).ravel()], "pair": str(pair),
        "profile": json.dumps(profile, default=str), "train_config": json.dumps(train_config or {}, default=str),
        "metrics": json.dumps(metrics or {}, default=str),
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)  # never leave a half-written policy where a user would load it
    return path


def load_policy(path: str | Path, device: str | torch.device = "cpu", profile=None) -> LearnedController:
    """A ``LearnedController`` from an exported ``policy.pt``.

    ``profile`` (a ``CostProfile``) replaces the device features stored at training time, so a policy can
    be conditioned on the device it runs on; by default it sees the training device's features.
    Raises ``FileNotFoundError`` or ``PolicyFileError`` (corrupt file, other format, other feature spec).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no policy file at {path}: train one with `python train.py`")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds for a corrupt file
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise PolicyFileError(f"{path} is not a readable policy file ({type(err).__name__}: {first})") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PolicyFileError(f"{path} is not a draftpilot policy file")
    if data.get("format_version") != FORMAT_VERSION:
        raise PolicyFileError(f"{path} has policy format version {data.get('format_version')!r}; this code "
                              f"reads version {FORMAT_VERSION}")
    if data.get("feature_version") != FEATURE_VERSION:
        raise PolicyFileError(f"{path} was trained on observation features version {data.get('feature_version')!r} "
                              f"but this code computes version {FEATURE_VERSION}: retrain it with `python train.py`")
    try:
        ladder = [int(s) for s in data["size_ladder"]]
        width, max_depth = int(data["tree_width"]), int(data["max_depth"])
        depth_zero = bool(data.get("depth_zero", False))  # files written before depth 0 existed: always draft
        feats = np.asarray(data["device_features"], dtype=np.float32)
        meta = {key: json.loads(data[key]) for key in ("profile", "train_config", "metrics")}
    except (KeyError, TypeError, ValueError) as err:
        raise PolicyFileError(f"{path} is missing or has malformed metadata ({err!r})") from err
    depth = Actor(data["depth"], DEPTH_OBS_DIM, 2, device)
    size = Actor(data["size"], SIZE_OBS_DIM, len(ladder), device)
    if profile is not None:
        feats = device_features(profile, width)
    meta.update(pair=data.get("pair"), path=str(path))
    return LearnedController(depth, size, size_ladder=ladder, tree_width=width, max_depth=max_depth,
                             device_feats=feats, meta=meta, depth_zero=depth_zero)
