"""The project's error base class: every error this project raises on purpose (bad input, a file it cannot
use, a pair that does not fit) derives from ``DraftpilotError``, so a command line can catch them all,
print one ``error: ...`` line and exit 2, while a bug (anything else) still shows its traceback."""

from __future__ import annotations

import numpy as np


class DraftpilotError(Exception):
    """Base class of the project's deliberate errors; the message names what is wrong."""


class InputError(DraftpilotError, ValueError):
    """An argument outside what it may be (wrong type, out of range, a path that cannot be used); the message
    names the argument. Checked at the boundary (``SpeculativeEngine.generate``, the command lines), before
    any model loads or any work starts."""


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool: what an integer argument must be (a float would be truncated)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for naming a bad value in a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
