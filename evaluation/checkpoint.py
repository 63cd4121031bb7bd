"""Partial evaluations, so that hours of live measurement survive an interruption.

The full evaluation is hours on a CPU. ``OUT/live_runs.partial.json`` holds the static grid search's
result and every prompt measured so far (all controllers of a prompt and repetition are saved together,
as soon as the last of them finishes), plus the learned policy's action log. Running the same command
again resumes: the grid search is not redone and measured prompts are skipped. A prompt's controllers are
always measured together in one sitting, so the paired per-prompt ratios stay paired; the report says how
many sittings a result took. The file is removed once the report is written.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

IGNORED_FIELDS = ("progress", "restart")
"""Config fields that do not change what is measured: they may differ between sittings."""


class Checkpoint:
    """The partial state of one evaluation: ``tuning`` (None until done), ``runs``, the learned policy's
    ``depth_log`` / ``size_log`` and ``sittings`` (one entry per start, the current one last)."""

    def __init__(self, path: Path, config):
        self.path = Path(path)
        self.config = asdict(config)
        self.tuning: dict | None = None
        self.runs: list[dict] = []
        self.depth_log: list[list] = []
        self.size_log: list[list] = []
        self.sittings: list[dict] = []

    @classmethod
    def open(cls, path: str | Path, config) -> Checkpoint:
        """A checkpoint resumed from ``path`` when it holds a partial evaluation with the same config (and
        ``config.restart`` is false), else an empty one. A partial evaluation with a different config is an
        error, never silently overwritten."""
        cp = cls(Path(path), config)
        if cp.path.is_file() and not config.restart:
            try:
                data = json.loads(cp.path.read_text(encoding="utf-8"))
                saved = data["config"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{cp.path} is not a readable partial evaluation ({err}); pass --restart to "
                                 "discard it") from err
            changed = differing_fields(saved, cp.config)
            if changed:
                raise ValueError(f"{cp.path} holds a partial evaluation with a different config ({', '.join(changed)}); "
                                 "repeat its command to resume it, pass --restart to discard it, or choose another "
                                 "--out")
            cp.tuning = data.get("tuning")
            cp.runs = list(data.get("runs", []))
            cp.depth_log = list(data.get("depth_log", []))
            cp.size_log = list(data.get("size_log", []))
            cp.sittings = list(data.get("sittings", []))
        cp.sittings.append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs_before": len(cp.runs)})
        return cp

    @property
    def resumed(self) -> bool:
        return len(self.sittings) > 1

    def save(self) -> None:
        """Write atomically (a kill during the write leaves the previous checkpoint intact)."""
        from evaluation.report import write_json

        data = {"config": self.config, "tuning": self.tuning, "runs": self.runs, "depth_log": self.depth_log,
                "size_log": self.size_log, "sittings": self.sittings}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = write_json(data, self.path.with_name(self.path.name + ".tmp"))
        os.replace(tmp, self.path)


def differing_fields(saved: dict, current: dict) -> list[str]:
    """Config fields (other than ``IGNORED_FIELDS``) whose values differ; floats compare with a tolerance
    (a JSON round trip keeps them, but a user may type 0.70 for 0.7)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if key in IGNORED_FIELDS:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, float) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            continue
        if a != b:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out
