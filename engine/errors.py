"""The project's error base class: every error this project raises on purpose (bad input, a file it cannot
use, a pair that does not fit) derives from ``DraftpilotError``, so a command line can catch them all,
print one ``error: ...`` line and exit 2, while a bug (anything else) still shows its traceback."""

from __future__ import annotations


class DraftpilotError(Exception):
    """Base class of the project's deliberate errors; the message names what is wrong."""
