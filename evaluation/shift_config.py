"""The shift evaluation's config and slices (``python evaluate.py shift``, ``evaluation.shift``): ``ShiftConfig``, the
axes and their slices (language, task family, temperature, length), which prompt falls in which slice, and the
output directory check."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.cli import ModelConfig, check_output_dir
from engine.errors import InputError
from engine.lookup import resolve_lookup
from envs.prompts import LANGUAGES

TASK_FAMILIES = {"code": ("code",), "math": ("math",), "prose": ("explanation", "rewrite", "qa")}
"""Task family of each suite task (code vs prose, with math apart: formulas are neither)."""
AXES = ("language", "task", "temperature", "length")
LENGTH_SLICES = ("short", "long")
"""Slices of the length axis: the suite (``--max-new-tokens``, short requests) and the long suite
(``prompts/long.jsonl``: ~1.3-2.2k-token contexts, ``--long-max-new-tokens`` answers)."""
LIVE_CONTROLLERS = ("autoregressive", "learned")


@dataclass
class ShiftConfig(ModelConfig):
    """One shift evaluation; the model fields come from ``engine.cli.ModelConfig``."""

    policy: str | None = None
    """Exported learned policy (policy.pt; trained across temperatures for the temperature axis); none: the
    newest runs/*/policy.pt."""
    out: str | None = None
    """Output directory (shift.md, shift.json, shift.png); none: runs/shift-<timestamp>."""
    axes: str = "language,task,temperature,length"
    """Comma list of the axes to evaluate (language, task, temperature, length)."""
    temperatures: str = "0,0.7,1"
    """Slices of the temperature axis (the language and task axes are greedy)."""
    max_new_tokens: int = 128
    """Tokens per trace and live run."""
    tune_prompts_per_language: int | None = None
    """Greedy tune prompts per language (none: the whole tune split, 8 per language in the built-in suite)."""
    test_prompts_per_language: int | None = None
    """Greedy test prompts per language (none: the whole test split, 12 per language)."""
    sampled_tune_prompts_per_language: int = 4
    """Tune prompts per language of every temperature slice (the first of the tune split)."""
    sampled_test_prompts_per_language: int = 6
    """Test prompts per language of every temperature slice."""
    long_suite: str | None = None
    """JSONL suite of the length axis's long slice (none: the built-in prompts/long.jsonl, 2 tune and 3
    test prompts per language with ~1.3-2.2k-token contexts)."""
    long_max_new_tokens: int = 512
    """Tokens per trace and live run of the long slice."""
    long_tune_prompts_per_language: int | None = None
    """Long-suite tune prompts per language (none: all)."""
    long_test_prompts_per_language: int | None = None
    """Long-suite test prompts per language (none: all)."""
    live: bool = True
    """Confirm live: every diagonal cell, the worst off-diagonal cell of each axis, every (0 -> T) cell."""
    live_prompts_per_slice: int = 4
    """Test prompts of a slice run live (spread over its languages)."""
    profile: str | None = None
    """Cost profile JSON; none: the cached one for this pair/device/format (measured on first use)."""
    bootstrap: int = 2000
    """Bootstrap resamples (over prompts) of every interval."""
    seed: int = 0
    """Seed of the sampled traces (sample 0) and of the live runs and the bootstrap."""
    lookup: str = "auto"
    """Context lookup drafting on the engine of every controller, in replay and live ("off", "on", MIN-MAX:K,
    MIN-MAX:K+L:J; engine.lookup; "auto": the setting the policy was trained with, train.py --lookup): "autoregressive" is then
    lookup alone, every static is tuned with it and the oracle plans around its cycles."""
    cache_dir: str = "runs/cache"
    """Where profiles and traces are cached (shared with train.py and evaluate.py)."""
    progress: bool = True
    """Progress bars."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (
            "max_new_tokens",
            "sampled_tune_prompts_per_language",
            "sampled_test_prompts_per_language",
            "long_max_new_tokens",
            "live_prompts_per_slice",
            "bootstrap",
        ):
            if getattr(self, name) < 1:
                raise InputError(
                    f"{name} (--{name.replace('_', '-')}) must be >= 1, got {getattr(self, name)}"
                )
        for name in (
            "tune_prompts_per_language",
            "test_prompts_per_language",
            "long_tune_prompts_per_language",
            "long_test_prompts_per_language",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {value}")
        self.axis_list()
        self.temperature_list()
        resolve_lookup(self.lookup)  # a bad setting fails before any model loads

    def axis_list(self) -> list[str]:
        axes = [a.strip() for a in self.axes.split(",") if a.strip()]
        bad = [a for a in axes if a not in AXES]
        if bad or not axes:
            raise InputError(f"--axes: expected a comma list of {', '.join(AXES)}, got {self.axes!r}")
        return axes

    def temperature_list(self) -> list[float]:
        try:
            temps = [float(t) for t in self.temperatures.split(",") if t.strip()]
        except ValueError:
            temps = []
        if not temps or not all(np.isfinite(t) and t >= 0 for t in temps) or len(set(temps)) != len(temps):
            raise InputError(
                f"--temperatures: expected distinct finite numbers >= 0, comma separated, got {self.temperatures!r}"
            )
        return temps


# ------------------------------------------------------------------------------------------- slices
def task_family(item: dict) -> str:
    task = item.get("task", "")
    for family, tasks in TASK_FAMILIES.items():
        if task in tasks:
            return family
    return "other"


def slice_names(axis: str, prompts: Sequence[dict], temperatures: Sequence[float]) -> list[str]:
    if axis == "language":
        present = {p.get("language") for p in prompts}
        return [lang for lang in LANGUAGES if lang in present] + sorted(
            {lang for lang in present if lang not in LANGUAGES and lang}
        )
    if axis == "task":
        present = {task_family(p) for p in prompts}
        return [f for f in (*TASK_FAMILIES, "other") if f in present]
    if axis == "length":
        return list(LENGTH_SLICES)
    return [temperature_name(t) for t in temperatures]


def temperature_name(t: float) -> str:
    return f"T{t:g}"


def in_slice(axis: str, name: str, item: dict) -> bool:
    if axis == "language":
        return item.get("language") == name
    if axis == "task":
        return task_family(item) == name
    return True


def check_out(config: ShiftConfig) -> Path:
    out = Path(config.out or f"runs/shift-{time.strftime('%Y%m%d-%H%M%S')}")
    return check_output_dir(out)
