"""Exported PPO policies on the inference path: ``policy.pt`` -> ``LearnedController`` (torch only).

File format (``torch.save`` of plain types and tensors, read back with ``weights_only=True``)::

    {"format": "draftpilot-policy", "format_version": 1, "feature_version": engine.costs.observation.FEATURE_VERSION,
     "depth": ACTOR, "size": ACTOR, "size_ladder": [1, 2, ...], "tree_width": W, "max_depth": D,
     "depth_zero": bool, "lookup_gate": bool, "device_features": [6 floats], "pair": str, "profile": JSON str,
     "train_config": JSON str, "metrics": JSON str, "payload_sha256": hex str}
    ACTOR = {"weights": [tensor, ...], "biases": [tensor, ...], "activation": "tanh" | "relu",
             "obs_mean": tensor, "obs_var": tensor, "clip_obs": float, "epsilon": float}

An actor is the MLP that maps the normalised observation to action logits (stable-baselines3's
``mlp_extractor.policy_net`` followed by ``action_net``); decisions are the argmax (deterministic).
Observations come from ``engine.costs.observation``: the same functions the environments use in training.

Integrity: ``payload_sha256`` is a SHA-256 over every other entry (tensors by dtype, shape and bytes; the
other values by type and value; ``payload_digest``), computed by ``save_policy``. ``load_policy`` recomputes
it and refuses a file whose payload changed since it was saved (a flipped byte, an edited value). Files
written before the hash existed still load, with a ``PolicyFileWarning`` that they cannot be checked. Every
file is also validated: finite weights and normaliser, a positive normaliser scale, a size ladder of
distinct ascending sizes in [0, 64], 1 <= max_depth <= 127, a tree width >= 1. A policy records the pair it
was trained for (``pair``, and the cost profile's weight format); ``LearnedController.pair_warning`` says when
it runs on another one (decoding stays exact: only its speed is at stake). The controller, its actors and the
file's errors are ``policies.learned_controller``'s.
"""

from __future__ import annotations

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
from engine.costs.cost_profile import CostProfile
from engine.costs.observation import (
    DEPTH_OBS_DIM,
    FEATURE_VERSION,
    NUM_DEVICE_FEATURES,
    SIZE_OBS_DIM,
    DeviceAtLoad,
    device_features,
)
from engine.errors import is_int
from policies.learned_controller import (
    Actor,
    LearnedController,
    PolicyFileError,
    PolicyFileWarning,
    stored_profile,
)

FORMAT = "draftpilot-policy"
FORMAT_VERSION = 1
HASH_KEY = "payload_sha256"
MAX_POLICY_DEPTH = 127
"""Largest depth cap a policy may carry (the trace format's depth limit: policies train on traces)."""


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
    lookup_gate: bool = False,
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
        "lookup_gate": bool(lookup_gate),
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
    for key in ("depth_zero", "lookup_gate"):
        if not isinstance(data.get(key, False), bool):
            raise PolicyFileError(f"{where}: {key} must be a bool, got {data[key]!r}")
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
        lookup_gate = bool(data.get("lookup_gate", False))  # trained to decide context lookup
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
        lookup_gate=lookup_gate,
    )
    if pair is not None and (message := controller.pair_warning(pair)):
        warnings.warn(message, PolicyFileWarning, stacklevel=2)
    return controller
