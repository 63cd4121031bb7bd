"""What a controller knows of the load a request decodes under (``DraftState.load``).

A request decoded alone (``SpeculativeEngine.generate``) has no load: ``DraftState.load`` is None, which
means the same as ``LoadState.ALONE``. Inside ``engine.batch.BatchedEngine`` (and ``envs.server``, its
replay), every cycle of a request is shown the load of the step it runs in, measured the same way in both:

* ``requests``: requests decoding in this step, this one included;
* ``waiting``: requests admitted but not yet prefilled, plus those the caller reports waiting outside the
  batch (a server's waiting line: ``BatchedEngine.waiting_outside``);
* ``other_rows``: rows the *other* requests put in the last step's target forward (roots and verified
  nodes): what this request's verified rows share a forward with;
* ``other_drafting``: other requests that ran the draft in the last step (a draft forward this request's
  draft steps would share, or run alone when it is 0);
* ``arrival_rate``: requests admitted per second over the last ``LoadTracker.window`` seconds.

The last step's figures, not this step's: requests decide one after another inside a step, so what the
others will do this step is not known when one decides; the last step is, and changes slowly.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadState:
    """The load of the step a cycle runs in (module docstring)."""

    requests: int = 1
    waiting: int = 0
    other_rows: int = 0
    other_drafting: int = 0
    arrival_rate: float = 0.0

    @property
    def alone(self) -> bool:
        """No other request decodes with this one and none waits."""
        return self.requests <= 1 and self.waiting == 0 and self.other_rows == 0

    def key(self) -> tuple[int, int, int, int]:
        """The fields a cost model depends on (``engine.costs.load_model``), for caching per load."""
        return (self.requests, self.waiting, self.other_rows, self.other_drafting)


LoadState.ALONE = LoadState()  # type: ignore[attr-defined]


class LoadTracker:
    """Admissions per second over a sliding window (``LoadState.arrival_rate``), on any clock: the engine's
    wall clock live, the simulated time in replay."""

    def __init__(self, window: float = 10.0):
        if not (math.isfinite(window) and window > 0):
            raise ValueError(f"window must be a positive number of seconds, got {window!r}")
        self.window = float(window)
        self._times: deque[float] = deque()
        self._start: float | None = None

    def arrived(self, now: float) -> None:
        """One request admitted at time ``now``."""
        if self._start is None:
            self._start = now
        self._times.append(now)

    def rate(self, now: float) -> float:
        """Admissions per second in the window ending at ``now`` (over the time since the first admission
        while that is shorter than the window)."""
        while self._times and self._times[0] < now - self.window:
            self._times.popleft()
        if self._start is None:
            return 0.0
        span = min(self.window, max(now - self._start, 1.0))
        return len(self._times) / span
