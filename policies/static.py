"""Fixed depth and verification size: the grid-searched baseline. ``StaticController`` is an engine
primitive (``engine.control``: the cost measurement and the generate command use it, and the engine may not
import policies); it is re-exported here with the other controllers."""

from __future__ import annotations

from engine.control import StaticController

__all__ = ["StaticController"]
