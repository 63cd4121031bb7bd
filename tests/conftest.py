"""Shared fixtures: the tiny model pair (float64 and float32), a few prompts, and the one statistical
checker every distribution test uses (the correct samplers must pass it, the wrong ones must fail it)."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

_spec = importlib.util.find_spec("engine")
if _spec is None or _spec.origin is None:  # not installed (origin None: only tests/engine, a namespace dir)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from scipy import stats  # noqa: E402

from engine import load_pair  # noqa: E402

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


def tv_bound(exact: Mapping[Hashable, float], num_samples: int, failure_prob: float = FAILURE_PROB) -> float:
    """E[TV] <= sum_i sd(freq_i) / 2 = sum_i sqrt(p_i (1 - p_i) / N) / 2 (Jensen), and TV moves by at most
    1/N when one sample changes, so P(TV > E[TV] + t) <= exp(-2 N t^2) (McDiarmid)."""
    mean_bound = 0.5 * sum(math.sqrt(prob * (1 - prob) / num_samples) for prob in exact.values())
    return mean_bound + math.sqrt(math.log(1 / failure_prob) / (2 * num_samples))


def check_law(samples: Iterable[Hashable], exact: Mapping[Hashable, float]) -> LawCheck:
    """Compare observed outcomes with an exact law (a mapping outcome -> probability summing to 1)."""
    exact = {k: float(v) for k, v in exact.items() if v > 0}
    assert abs(sum(exact.values()) - 1.0) < 1e-9, sum(exact.values())
    counts = Counter(samples)
    num = sum(counts.values())
    impossible = tuple(sorted((k for k in counts if k not in exact), key=repr))
    tv = 0.5 * sum(abs(counts.get(k, 0) / num - exact.get(k, 0.0)) for k in set(exact) | set(counts))

    # chi-square needs expected counts >= 5: keep those cells, pool the rest into one bin
    big = sorted((k for k in exact if exact[k] * num >= 5), key=lambda k: exact[k])
    small = [k for k in exact if exact[k] * num < 5]
    observed = [counts.get(k, 0) for k in big]
    expected = [exact[k] * num for k in big]
    if small:
        observed.append(sum(counts.get(k, 0) for k in small))
        expected.append(sum(exact[k] for k in small) * num)
        if expected[-1] < 5 and len(expected) > 1:  # pooled bin still too small: merge it into the smallest cell
            observed[0] += observed.pop()
            expected[0] += expected.pop()
    if impossible or len(expected) < 2:
        pvalue = 0.0 if impossible else 1.0
    else:
        pvalue = float(stats.chisquare(observed, expected).pvalue)
    return LawCheck(num, pvalue, tv, tv_bound(exact, num), impossible)


@pytest.fixture(scope="session")
def law_check():
    """The checker as a fixture, so every test module uses the same one."""
    return check_law
