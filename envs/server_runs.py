"""What a server replay (``envs.server``) runs and what it measures: ``Arrivals`` (a closed loop of clients,
or Poisson arrivals whose rate changes), one replayed request's state (``ReplayRequest``) and ``ServerRun``
(the requests and steps of a run: system tokens/s, inter-token latencies, time to first token)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.control import Controller
from engine.cycle import DraftLag
from engine.errors import InputError
from engine.load import LoadState
from engine.results import CycleRecord
from engine.scheduling import StepPlan
from envs.replay import Message, ReplayTrace, Reply


@dataclass(frozen=True)
class Arrivals:
    """When requests arrive: a closed loop of ``concurrency`` clients (each sends its next request when its
    last one finishes), or Poisson arrivals whose rate changes at the given times (``rates``: (from second,
    requests per second) pieces, the first from 0). ``requests``: how many in all."""

    concurrency: int = 0
    rates: tuple[tuple[float, float], ...] = ()
    requests: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency > 0) == bool(self.rates):
            raise InputError("Arrivals needs exactly one of concurrency (closed loop) and rates (Poisson)")
        if self.requests < 1:
            raise InputError(f"Arrivals.requests must be >= 1, got {self.requests}")
        if self.rates and (
            self.rates[0][0] != 0
            or any(r < 0 for _, r in self.rates)
            or not any(r > 0 for _, r in self.rates)
        ):
            raise InputError(f"Poisson rates must start at 0 and hold a positive rate, got {self.rates}")

    @classmethod
    def closed(cls, concurrency: int, requests: int | None = None, seed: int = 0) -> Arrivals:
        return cls(concurrency=concurrency, requests=requests or 2 * concurrency, seed=seed)

    @classmethod
    def poisson(cls, rates: Sequence[tuple[float, float]], requests: int, seed: int = 0) -> Arrivals:
        return cls(rates=tuple((float(a), float(b)) for a, b in rates), requests=requests, seed=seed)

    @property
    def label(self) -> str:
        if self.concurrency:
            return f"N={self.concurrency}"
        return "poisson " + ",".join(f"{r:g}/s@{t:g}s" for t, r in self.rates)

    def poisson_times(self) -> list[float]:
        """The arrival times of a Poisson run (piecewise constant rate, thinning-free: exponential gaps
        drawn at the rate in force)."""
        rng = np.random.default_rng(self.seed)
        out, now = [], 0.0
        pieces = list(self.rates) + [(float("inf"), 0.0)]
        while len(out) < self.requests:
            i = max(k for k, (start, _) in enumerate(pieces) if start <= now)
            rate, end = pieces[i][1], pieces[i + 1][0]
            if rate <= 0:
                now = end
                continue
            gap = float(rng.exponential(1.0 / rate))
            if now + gap > end:
                now = end
                continue
            now += gap
            out.append(now)
        return out


@dataclass
class ReplayRequest:
    """One replayed request's state in a server replay (its trace, arrival, controller, cycle loop and
    progress); ``rid``: its number in the order the run makes requests (-1: the external request of an episode)."""

    rid: int
    trace: ReplayTrace
    arrival: float
    controller: Controller | None
    external: bool = False
    depth_zero: bool = False
    gate: bool = False
    """The external request's agent decides context lookup (``Controller.decides_lookup``)."""
    loop: Generator[Message, Reply, None] | None = None
    admitted: float | None = None
    prefilled: bool = False
    filled: int = 0  # prompt tokens prefilled so far
    cached: int | None = None
    """Prompt tokens it took from the prefix cache (None: not looked up yet, its prefill has not started)."""
    done: bool = False
    t: int = 0  # position in the trajectory (tokens committed after the first)
    lag: DraftLag | None = None
    """What the draft is behind by (set at its start: the draft's prefill is lazy), as its ``replay_cycles``
    counts it: updated when the loop resumes after a cycle, so a step is timed with its cycles' lags before."""
    load: LoadState | None = None
    record: CycleRecord | None = None
    want: int | None = None
    target_rows: int = 0
    drafted: bool = False
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    records: list[CycleRecord] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return self.trace.trace.prompt_len


@dataclass
class ServerRun:
    """What one server replay measured."""

    arrivals: Arrivals
    requests: list[ReplayRequest]
    steps: list[tuple[float, int, int]]
    """(step seconds, requests in the step, target rows) per step."""
    start: float
    end: float
    plans: list[StepPlan] = field(default_factory=list)
    """What each step ran (``engine.scheduling.StepPlan``; requests by ``ReplayRequest.rid``), as the live
    engine's ``BatchedEngine.last_step``."""

    @property
    def tokens(self) -> int:
        return sum(len(r.token_times) for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        span = self.end - self.start
        return self.tokens / span if span > 0 else float("nan")

    def itl(self) -> np.ndarray:
        """Inter-token latencies (s) of every request: the gaps between the steps that committed its tokens,
        each spread over the tokens of the later step (as a streaming client sees them)."""
        gaps = []
        for r in self.requests:
            times = np.asarray(r.token_times)
            steps, counts = np.unique(times, return_counts=True)
            for a, b, n in zip(steps, steps[1:], counts[1:]):
                gaps += [(b - a) / n] * int(n)
        return np.asarray(gaps) if gaps else np.zeros(1)

    def ttft(self) -> np.ndarray:
        return np.asarray([r.first_token - r.arrival for r in self.requests if r.first_token is not None])

    def summary(self) -> dict:
        itl, ttft = self.itl(), self.ttft()
        decided = [rec for r in self.requests for rec in r.records if not rec.lookup]
        return {
            "arrivals": self.arrivals.label,
            "tokens_per_s": self.tokens_per_s,
            "requests": len(self.requests),
            "tokens": self.tokens,
            "seconds": self.end - self.start,
            "mean_batch": float(np.mean([s[1] for s in self.steps])) if self.steps else 0.0,
            "itl_p50_ms": 1e3 * float(np.percentile(itl, 50)),
            "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)),
            "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else float("nan"),
            "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else float("nan"),
            "drafting_share": float(np.mean([rec.depth > 0 for rec in decided])) if decided else 0.0,
            "mean_depth": float(np.mean([rec.depth for rec in decided])) if decided else 0.0,
        }
