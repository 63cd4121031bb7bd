"""Controllers that decide draft depth and verification size. All implement ``engine.Controller``; the
engine never imports this package. ``load_policy`` reads an exported PPO policy (torch only: the PPO
training code in ``policies.ppo`` and stable-baselines3 are never imported on the inference path)."""

from policies.analytic import AnalyticController
from policies.goodput import GoodputController
from policies.heuristic import ConfidenceController, HeuristicController
from policies.learned import LearnedController, PolicyFileError, load_policy
from policies.static import BatchSizeTableController, StaticController

__all__ = [
    "AnalyticController",
    "BatchSizeTableController",
    "ConfidenceController",
    "GoodputController",
    "HeuristicController",
    "LearnedController",
    "PolicyFileError",
    "StaticController",
    "load_policy",
]
