"""Run configs refuse values that would fail only after models load (or, worse, train or evaluate on
nonsense): a re-probe found train.py accepting --eval-every 0, a NaN cost profile and a PPO gamma of 2, and
--threads -1 ending in a traceback (issue 14)."""

from __future__ import annotations

import json
import math

import pytest

from engine.costs.cost_profile import CostProfile, load_profile_arg
from engine.costs.profile_io import ProfileError
from engine.errors import InputError
from evaluation.config import EvalConfig
from training.ppo_config import PPOConfig
from training.train_config import TrainConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("eval_every", 0),
        ("threads", -1),
        ("seed", -1),
        ("seed", 2**64),
        ("temperature", math.nan),
        ("temperature", -0.5),
        ("max_depth", 100_000),
        ("tree_width", 200),
        ("long_train_prompts", -1),
        ("long_val_prompts", -2),
    ],
)
def test_train_config_refuses(field, value):
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        TrainConfig(pair="tiny", **{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("gamma_size", 2.0),
        ("gamma_depth", 0.0),
        ("gae_lambda", -0.1),
        ("clip_range", 0.0),
        ("ent_coef", math.nan),
        ("rho_smoothing", 1.5),
    ],
)
def test_ppo_config_refuses(field, value):
    with pytest.raises(ValueError, match=field):
        PPOConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value", [("seed", -1), ("threads", -1), ("max_depth", 1000), ("tree_width", 300)]
)
def test_eval_config_refuses(field, value):
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        EvalConfig(pair="tiny", **{field: value})


def _profile_dict() -> dict:
    return {
        "contexts": [16, 64],
        "widths": [1],
        "draft_step_table": [[1e-3, 2e-3]],
        "sizes": [0, 1],
        "verify_table": [[1e-3, 1e-3], [2e-3, 2e-3]],
        "version": 1,
    }


def test_a_profile_with_nan_overheads_is_refused(tmp_path):
    CostProfile(**_profile_dict())  # control
    for key in ("overhead_base_s", "ar_overhead_s", "policy_call_s"):
        with pytest.raises(ProfileError, match=key):
            CostProfile(**{**_profile_dict(), key: math.nan})
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**_profile_dict(), "overhead_base_s": float("nan")}))
    with pytest.raises(InputError, match="--profile.*overhead_base_s"):
        load_profile_arg(path)
    with pytest.raises(InputError, match="--profile.*is a directory"):
        load_profile_arg(tmp_path)
