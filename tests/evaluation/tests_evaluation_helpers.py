"""Helpers of the evaluation tests: run the CLI with its output captured, the common tiny-pair flags."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

CACHE = "cache"
"""Cache directory (under the session's work directory) shared by train.py and evaluate.py runs."""


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``evaluate.main(argv)`` with stdout and stderr captured."""
    import evaluate

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = evaluate.main(argv)
    return rc, out.getvalue(), err.getvalue()


def tiny_args(workdir: Path, policy: Path, out: str, *extra: str) -> list[str]:
    return [
        "--pair",
        "tiny",
        "--quick",
        "--threads",
        "1",
        "--policy",
        str(policy),
        "--cache-dir",
        str(workdir / CACHE),
        "--out",
        str(workdir / out),
        "--no-progress",
        "--languages",
        "it,en",
        *extra,
    ]


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` imported as a module (the benchmarks are scripts, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    # registered (a dataclass's annotations are resolved through its module) under a name of its own: a
    # script's name may be a package's (llama_cpp)
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
