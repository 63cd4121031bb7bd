"""Controllers that decide draft depth and verification size (static now; heuristic, analytic and
learned ones plug into the same ``engine.Controller`` seam)."""

from policies.static import StaticController

__all__ = ["StaticController"]
