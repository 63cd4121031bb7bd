"""Fixtures of the evaluation tests: one tiny trained policy and one end-to-end ``evaluate.py`` run on the
tiny pair, shared by the whole session (the CLI run covers tuning, live runs, peers, replay, load and the
exactness audit in one go; the tests then check its outputs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests_evaluation_helpers

from tests_evaluation_helpers import CACHE, run_cli, tiny_args  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads; on a shared 2-core machine they only add contention."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("evaluation")


def train_tiny(workdir: Path, name: str, tree_width: int, *extra: str) -> Path:
    """``train.py --pair tiny --quick`` without context lookup (seconds; ``extra``: more flags); its traces and
    profile stay cached."""
    import train

    flags = ["--pair", "tiny", "--quick", "--no-progress", "--cache-dir", str(workdir / CACHE)]
    flags += [
        "--run-dir",
        str(workdir / "runs"),
        "--run-name",
        name,
        "--languages",
        "it,en",
        "--threads",
        "1",
    ]
    assert train.main(flags + ["--tree-width", str(tree_width), "--lookup", "off", *extra]) == 0
    path = workdir / "runs" / name / "policy.pt"
    assert path.is_file()
    return path


@pytest.fixture(scope="session")
def tiny_policy(workdir) -> Path:
    """A tree policy (tree width 4)."""
    return train_tiny(workdir, "p", 4)


@pytest.fixture(scope="session")
def tiny_chain_policy(workdir) -> Path:
    """A chain policy (tree width 1)."""
    return train_tiny(workdir, "chain", 1)


@pytest.fixture(scope="session")
def tiny_batch_one_policy(workdir) -> Path:
    """A chain policy trained without load awareness (``--no-load-aware``: one request at a time)."""
    return train_tiny(workdir, "batch-one", 1, "--no-load-aware")


@pytest.fixture(scope="session")
def evaluated(workdir, tiny_policy) -> dict:
    """The full CLI on the tiny pair: every controller including transformers' peers, the oracle, load with
    2 concurrent requests, the exactness audit with small budgets."""
    argv = tiny_args(
        workdir,
        tiny_policy,
        "eval",
        "--prompts-per-language",
        "2",
        "--max-new-tokens",
        "32",
        "--tune-max-new-tokens",
        "24",
        "--concurrency",
        "2",
        "--samples",
        "30",
        "--law-trials",
        "1500",
        "--bootstrap",
        "300",
    )
    rc, stdout, stderr = run_cli(argv)
    out = workdir / "eval"
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else None
    return {"rc": rc, "stdout": stdout, "stderr": stderr, "out": out, "results": results}
