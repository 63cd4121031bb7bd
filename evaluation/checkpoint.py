"""Partial evaluations, so that hours of live measurement survive an interruption, and the checks an output
directory passes before an evaluation writes to it.

The full evaluation is hours on a CPU. ``OUT/live_runs.partial.json`` holds the static grid search's
result and every prompt measured so far (all controllers of a prompt and repetition are saved together,
as soon as the last of them finishes), plus the learned policy's action log. Running the same command
again resumes: the grid search is not redone and measured prompts are skipped. A prompt's controllers are
always measured together in one sitting, so the paired per-prompt ratios stay paired; the report says how
many sittings a result took. The file is removed once the report is written.

What is compared between sittings is ``stored_config``: the config with its paths absolute, the policy
file actually used (the newest ``runs/*/policy.pt`` when none is given) and that file's sha256, so the same
--out given relative or absolute resumes, while a replaced policy file or a newer default policy is
refused. ``prepare_output`` refuses an --out that holds a finished evaluation unless ``--restart`` (which
removes its outputs first); the caller holds the directory's lock (``engine.backends.files.DirectoryLock``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from engine.backends.files import sha256_file
from engine.errors import DraftpilotError
from evaluation.plots import FIGURES
from evaluation.report import write_json

IGNORED_FIELDS = ("progress", "restart", "out")
"""Config fields that do not change what is measured: they may differ between sittings (``out`` is where
the partial evaluation is, so a moved output directory still resumes)."""
PATH_FIELDS = ("cache_dir", "prompts", "profile", "policy")
"""Paths: compared resolved (a partial evaluation written before they were stored absolute still resumes)."""
PARTIAL = "live_runs.partial.json"
FINISHED = ("report.md", "results.json", "exactness.md", "exactness.json")
"""Files of a finished evaluation (full report or exactness audit)."""


class EvaluationOutputError(DraftpilotError, ValueError):
    """An output directory that cannot be used as asked: a finished evaluation without --restart, a partial one
    with another config (or another policy file), or an unreadable partial file."""


def stored_config(config) -> dict:
    """What config.json and a partial evaluation record of an ``EvalConfig``: its fields (paths as given; see
    ``EvalConfig.resolved``) and ``policy_sha256``, the sha256 of the policy file (None without one)."""
    data = asdict(config)
    policy = Path(config.policy) if config.policy else None
    data["policy_sha256"] = sha256_file(policy) if policy is not None and policy.is_file() else None
    return data


def prepare_output(
    out: str | Path, config, *, audit_only: bool = False, clear: bool = True
) -> Checkpoint | None:
    """Check ``out`` before anything is written to it: a finished evaluation there is refused unless
    ``config.restart`` (then, if ``clear``, every output of the earlier evaluation is removed: report,
    results, figures, config, partial file); returns the ``Checkpoint`` of the full evaluation (resumed when
    ``out`` holds a partial one with the same stored config, refused with another), None for the exactness
    audit alone. ``clear=False`` only checks: nothing in ``out`` changes."""
    out = Path(out)
    if config.restart:
        if not clear:
            return None if audit_only else Checkpoint(out / PARTIAL, config)
        for name in (*FINISHED, *FIGURES, "config.json", PARTIAL):
            (out / name).unlink(missing_ok=True)
    else:
        finished = [name for name in FINISHED if (out / name).exists()]
        if finished:
            raise EvaluationOutputError(
                f"{out} already holds a finished evaluation ({', '.join(finished)}): pass "
                "--restart to replace it (its report, results, figures and config are "
                "removed first), or choose another --out"
            )
        if audit_only and (out / PARTIAL).exists():
            raise EvaluationOutputError(
                f"{out} holds a partial evaluation ({PARTIAL}): resume it with its own "
                "command, pass --restart to discard it, or choose another --out"
            )
    return None if audit_only else Checkpoint.open(out / PARTIAL, config)


class Checkpoint:
    """The partial state of one evaluation: ``tuning`` (None until done), ``runs``, the learned policy's
    ``depth_log`` / ``size_log`` and ``sittings`` (one entry per start, the current one last)."""

    def __init__(self, path: Path, config):
        self.path = Path(path)
        self.config = stored_config(config)
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
                if not isinstance(saved, dict):
                    raise TypeError(f"config is a {type(saved).__name__}")
            except (ValueError, KeyError, TypeError) as err:
                raise EvaluationOutputError(
                    f"{cp.path} is not a readable partial evaluation ({err}); pass --restart to discard it"
                ) from err
            changed = differing_fields(saved, cp.config)
            if changed:
                raise EvaluationOutputError(
                    f"{cp.path} holds a partial evaluation with a different config ({', '.join(changed)}){_hint(saved, cp.config)}; "
                    "repeat its command to resume it, pass --restart to discard it, or choose another --out"
                )
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
        data = {
            "config": self.config,
            "tuning": self.tuning,
            "runs": self.runs,
            "depth_log": self.depth_log,
            "size_log": self.size_log,
            "sittings": self.sittings,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(data, self.path)


def differing_fields(saved: dict, current: dict) -> list[str]:
    """Config fields (other than ``IGNORED_FIELDS``) whose values differ; floats compare with a tolerance
    (a JSON round trip keeps them, but a user may type 0.70 for 0.7), tuples as the lists JSON stores them as,
    paths resolved; ``policy_sha256`` only when the saved config has one (files written before it was
    recorded)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if key in IGNORED_FIELDS or (key == "policy_sha256" and key not in saved):
            continue
        a, b = (list(v) if isinstance(v, tuple) else v for v in (saved.get(key), current.get(key)))
        if (
            isinstance(a, float)
            and isinstance(b, (int, float))
            and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
        ):
            continue
        if (
            key in PATH_FIELDS
            and isinstance(a, str)
            and isinstance(b, str)
            and Path(a).resolve() == Path(b).resolve()
        ):
            continue
        if a != b:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def _hint(saved: dict, current: dict) -> str:
    """Why the policy differs, when it does."""
    if differing_fields({"policy": saved.get("policy")}, {"policy": current.get("policy")}):
        return (
            " - the learned policy is another file (without --policy the newest runs/*/policy.pt is used: pass "
            f"--policy {saved.get('policy')} to resume)"
        )
    if "policy_sha256" in saved and saved.get("policy_sha256") != current.get("policy_sha256"):
        return f" - the policy file {current.get('policy')} was replaced since the partial evaluation started"
    return ""
