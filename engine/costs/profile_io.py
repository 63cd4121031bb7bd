"""The cost profile file: JSON, one top-level key per line, written atomically and read back with its format
version and required tables checked (``CostProfile.save`` / ``CostProfile.load``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from engine.backends.files import atomic_write
from engine.errors import DraftpilotError

PROFILE_VERSION = 1
REQUIRED_FIELDS = ("contexts", "widths", "draft_step_table", "sizes", "verify_table")
"""The fields every profile file holds (the others have defaults)."""


class ProfileError(DraftpilotError, ValueError):
    """A cost profile file is unreadable, malformed or from another format version."""


def write_profile(data: dict[str, Any], path: str | Path) -> Path:
    """Write ``data`` (a profile's fields) as JSON, atomically (``engine.backends.files.atomic_write``: a kill
    leaves the old file or the new one, never part of one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # one top-level key per line, each value compact: diffable, and tables stay one line per table
    items = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in _plain(data).items()]
    return atomic_write(path, "{\n" + ",\n".join(items) + "\n}\n")


def read_profile(path: str | Path, known: Iterable[str]) -> dict[str, Any]:
    """The fields (among ``known``) of the profile file at ``path``; raises ``FileNotFoundError``,
    ``IsADirectoryError`` or ``ProfileError`` (unreadable, not an object, another version, a required field
    missing)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a cost profile (a .json file)")
    if not path.is_file():
        raise FileNotFoundError(
            f"no cost profile at {path}: measure one with `python -m engine.costs.measure_costs --out {path}`"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProfileError(f"{path} is not a readable cost profile (invalid JSON: {err})") from err
    if not isinstance(data, dict):
        raise ProfileError(f"{path} is not a cost profile (top level is {type(data).__name__})")
    if data.get("version") != PROFILE_VERSION:
        raise ProfileError(
            f"{path} has cost profile format version {data.get('version')!r}; this code "
            f"reads version {PROFILE_VERSION}: measure it again with `python -m engine.costs.measure_costs`"
        )
    missing = [name for name in REQUIRED_FIELDS if name not in data]
    if missing:
        raise ProfileError(f"{path} is not a complete cost profile: missing {missing}")
    known = set(known)
    return {k: v for k, v in data.items() if k in known}


def _plain(obj: Any) -> Any:
    """JSON-ready copy (numpy scalars and arrays to Python)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _plain(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
