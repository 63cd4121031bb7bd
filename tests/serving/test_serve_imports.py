"""The server is on the inference path: importing ``serve.py`` and ``serving/*`` (and what ``serve.py`` uses
for --policy and --profile: the policy loader, the controllers, the profile and table readers) loads no
training code, checked in a fresh interpreter's ``sys.modules`` (``tests/test_layering.py`` checks the import
statements; this catches what they pull in transitively)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests_serving_helpers import ROOT

TRAINING = ("stable_baselines3", "gymnasium", "training")
SERVER = """
import serve
import serving.app, serving.worker, serving.text, serving.metrics
from serving.app import create_app
serve.build_parser()
from policies.learned import load_policy  # what controller_factory imports for --policy
from policies.analytic import AnalyticController  # --policy analytic
from policies.static import BatchSizeTableController, read_batch_size_table  # --policy table:FILE
from policies.learned_controller import stored_profile
from engine.costs.cost_profile import load_profile_arg  # --profile
from policies.static import read_batch_size_table  # the table file
"""
CONTROL = "import envs, training.ppo"


@pytest.fixture(scope="module")
def loaded():
    """Which of ``TRAINING`` a fresh interpreter has in ``sys.modules`` after the server's imports, then
    after the training modules' (the negative control; one interpreter: each start imports torch)."""
    show = f"print(json.dumps([m for m in {TRAINING!r} if m in sys.modules]))"
    code = "\n".join(["import json, sys", SERVER, show, CONTROL, show])
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    server, control = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    return {"server": server, "control": control}


def test_the_server_imports_no_training_code(loaded):
    assert loaded["server"] == []


def test_negative_control_training_modules_are_seen(loaded):
    assert loaded["control"] == list(TRAINING)
