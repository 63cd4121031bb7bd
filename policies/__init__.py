"""Controllers that decide draft depth and verification size. All implement ``engine.Controller``; the
engine never imports this package."""

from policies.analytic import AnalyticController
from policies.heuristic import ConfidenceController, HeuristicController
from policies.static import StaticController

__all__ = ["AnalyticController", "ConfidenceController", "HeuristicController", "StaticController"]
