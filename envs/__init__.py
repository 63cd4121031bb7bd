"""Gymnasium environments (live and exact trace replay) over the engine: not yet implemented."""
