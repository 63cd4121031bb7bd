"""Shared fixtures: the tiny model pair (float64 and float32), a few prompts, and the one statistical
checker every distribution test uses (the correct samplers must pass it, the wrong ones must fail it)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

_spec = importlib.util.find_spec("engine")
if _spec is None or _spec.origin is None:  # not installed (origin None: only tests/engine, a namespace dir)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.backends.models import load_pair  # noqa: E402
from evaluation.exactness import check_law as _check_law  # noqa: E402
from evaluation.exactness import tv_bound  # noqa: E402,F401 - used by law tests through conftest

PROMPTS = ("def main():", "The quick brown fox", "x")


@pytest.fixture(scope="module")
def single_thread():
    """The tiny models are far too small to gain from intra-op threads; on a shared 2-core machine extra
    threads only add contention (measured: ~10x slower generate() calls under load with 2 threads).
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_pair():
    """The tiny pair in float64: greedy tests require bit-identical tokens, so keep rounding out of it."""
    return load_pair("tiny", dtype=torch.float64, device="cpu")


@pytest.fixture(scope="session")
def tiny_pair_f32():
    return load_pair("tiny", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def prompts() -> tuple[str, ...]:
    return PROMPTS


# ------------------------------------------------------------------------------------- law checker
FAILURE_PROB = 1e-6
"""Chance that a correct sampler trips the TV bound (McDiarmid), see ``tv_bound``."""


@dataclass(frozen=True)
class LawCheck:
    """Outcome of comparing samples with an exact law."""

    num_samples: int
    pvalue: float
    """Chi-square goodness of fit (cells with expected count < 5 pooled); 0 if an impossible outcome occurred."""
    tv: float
    """Total variation distance between the empirical and the exact law."""
    tv_bound: float
    """TV a correct sampler stays below with probability >= 1 - FAILURE_PROB at this sample size."""
    impossible: tuple
    """Observed outcomes with exact probability 0."""

    @property
    def agrees(self) -> bool:
        return self.pvalue > 1e-3 and self.tv < self.tv_bound and not self.impossible


def check_law(samples: Iterable[Hashable], exact: Mapping[Hashable, float]) -> LawCheck:
    """Compare observed outcomes with an exact law (a mapping outcome -> probability summing to 1), with the
    product's checker (``evaluation.exactness.check_law``: the report's exactness audit runs the same code)."""
    exact = {k: float(v) for k, v in exact.items() if v > 0}
    assert abs(sum(exact.values()) - 1.0) < 1e-9, sum(exact.values())
    result = _check_law(list(samples), exact)
    return LawCheck(
        result["trials"], result["pvalue"], result["tv"], result["tv_bound"], result["impossible_outcomes"]
    )


@pytest.fixture(scope="session")
def law_check():
    """The checker as a fixture, so every test module uses the same one."""
    return check_law
