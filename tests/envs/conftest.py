"""Fixtures for environment tests that need no model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests_envs_helpers (synthetic traces, linear profile)

from tests_envs_helpers import LinearProfile, make_synthetic_trace  # noqa: E402


@pytest.fixture
def linear_profile():
    return LinearProfile()


@pytest.fixture
def synthetic_traces():
    return [make_synthetic_trace(seed) for seed in range(4)]
