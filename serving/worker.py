"""The engine thread of the server: one ``BatchedEngine`` driven by one thread, fed by the event loop.

Requests reach the thread as ``Job`` objects through ``EngineWorker.submit`` (thread-safe). The thread admits
waiting jobs while the batch has room (``BatchConfig.max_requests``), runs ``BatchedEngine.step`` while any
job is in flight, and hands every job its committed tokens and its end through the job's asyncio queue
(``loop.call_soon_threadsafe``), so the event loop never waits on the engine and the engine never waits on a
client. Cancellations (a client gone, a stop string met) are applied between steps: the slot and its caches
are freed before the next step.

Refusals are immediate, never a hang: more than ``max_waiting`` jobs waiting for a slot raises ``Overloaded``
(HTTP 429), a worker that drains or has stopped raises ``Unavailable`` (HTTP 503). A request the engine
refuses (``InputError``) ends that job alone with its message (HTTP 400). An error inside a step that is not
one request's own (the engine's ``_guard`` ends those alone) fails the jobs in flight with a 500 and the
worker goes on with a fresh engine: one bad step never takes the server down.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.backends.pair import ModelPair
from engine.batch import BatchConfig, BatchedEngine, BatchRequest
from engine.control import Controller
from engine.errors import DraftpilotError, InputError
from engine.results import CycleRecord, GenerationResult
from engine.sampling import SamplingConfig


class Overloaded(DraftpilotError):
    """Every slot is busy and the waiting line is full (HTTP 429: retry later)."""


class Unavailable(DraftpilotError):
    """The worker is draining for shutdown or has stopped (HTTP 503)."""


@dataclass(frozen=True)
class Tokens:
    """Tokens one step committed for a job, and when (``time.perf_counter``)."""

    ids: tuple[int, ...]
    at: float
    record: CycleRecord | None


@dataclass(frozen=True)
class Finished:
    reason: str
    """``GenerationResult.finish_reason`` ("eos", "stop", "length", "context") or "cancelled"."""
    result: GenerationResult | None
    at: float


@dataclass(frozen=True)
class Failed:
    status: int
    message: str
    at: float


@dataclass(eq=False)
class Job:
    """One request on its way through the worker; created on the event loop that reads ``queue``."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    controller: Controller | None = None
    ignore_eos: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    rid: int | None = None
    cancelled: bool = False

    def push(self, item: Tokens | Finished | Failed) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody reads this job any more
            pass


class EngineWorker:
    """Owns the ``BatchedEngine`` and the thread that steps it (see the module docstring)."""

    def __init__(
        self,
        pair: ModelPair,
        config: BatchConfig,
        max_waiting: int = 64,
        on_step: Callable[[int, float, list], None] | None = None,
    ):
        self.pair, self.config, self.max_waiting = pair, config, max_waiting
        self.engine = BatchedEngine(pair, config)
        self.on_step = on_step
        """Called on the engine thread after each step with (requests in the step, seconds, events)."""
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._cancels: list[Job] = []
        self._jobs: dict[int, Job] = {}
        self._state = "new"
        self._thread = threading.Thread(target=self._loop, name="draftpilot-engine", daemon=True)

    # ------------------------------------------------------------------------------- event-loop side
    def start(self) -> None:
        with self._cond:
            if self._state != "new":
                raise RuntimeError("the worker has already been started")
            self._state = "running"
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._state != "running":
                raise Unavailable("the server is shutting down" if self._state != "new" else "not started")
            if len(self._waiting) >= self.max_waiting:
                raise Overloaded(
                    f"{len(self._jobs)} requests are running and {len(self._waiting)} waiting (the limit, "
                    "--max-waiting): retry later"
                )
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """End ``job`` early (its client left or it met a stop string); it gets ``Finished("cancelled")``."""
        with self._cond:
            if job.cancelled:
                return
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                job.push(Finished("cancelled", None, time.perf_counter()))
            else:
                self._cancels.append(job)
                self._cond.notify()

    def drain(self) -> None:
        """Refuse new jobs from now on; the ones submitted run to their end, then the thread exits."""
        with self._cond:
            if self._state in ("running", "new"):
                self._state = "draining"
            self._cond.notify()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to exit (after ``drain``); True when it has."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> int:
        return len(self._jobs)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def state(self) -> str:
        return self._state

    # ---------------------------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        try:
            while self._turn():
                pass
        finally:
            with self._cond:
                self._state = "stopped"
                leftover = list(self._waiting) + list(self._jobs.values())
                self._waiting.clear()
                self._jobs.clear()
            for job in leftover:
                job.push(Failed(503, "the server stopped", time.perf_counter()))

    def _turn(self) -> bool:
        """One round: apply cancellations, admit, step. False when the thread should exit."""
        with self._cond:
            while not (self._waiting or self._cancels or self._jobs):
                if self._state != "running":
                    return False
                self._cond.wait()
            cancels, self._cancels = self._cancels, []
            admit = []
            while self._waiting and len(self._jobs) + len(admit) < self.config.max_requests:
                admit.append(self._waiting.popleft())
            still_waiting = len(self._waiting)
        self.engine.waiting_outside = still_waiting  # the line the controllers see (``LoadState.waiting``)
        now = time.perf_counter()
        for job in cancels:
            if job.rid is not None and self._jobs.pop(job.rid, None) is job:
                self.engine.cancel(job.rid)
                job.push(Finished("cancelled", None, now))
        for job in admit:
            self._admit(job, now)
        if not self._jobs:
            return True
        started = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception as err:  # not one request's own error: fail the batch, start a fresh engine
            self._fail_all(f"internal error in a batched step: {type(err).__name__}: {err}")
            return True
        took = time.perf_counter() - started
        now = time.perf_counter()
        for event in events:
            job = self._jobs.get(event.rid)
            if job is None:
                continue
            if event.tokens:
                job.push(Tokens(event.tokens, now, event.record))
            if event.finished:
                del self._jobs[event.rid]
                try:
                    result = self.engine.result(event.rid)
                except DraftpilotError as err:
                    job.push(Failed(500, f"the request failed: {err}", now))
                else:
                    job.push(Finished(event.finish_reason, result, now))
        if self.on_step is not None:
            self.on_step(len(events), took, events)
        return True

    def _admit(self, job: Job, now: float) -> None:
        if job.cancelled:
            job.push(Finished("cancelled", None, now))
            return
        try:
            rid = self.engine.add(
                BatchRequest(
                    job.prompt_ids,
                    max_new_tokens=job.max_new_tokens,
                    controller=job.controller,
                    seed=job.seed,
                    sampling=job.sampling,
                    stop_token_ids=job.stop_token_ids,
                    ignore_eos=job.ignore_eos,
                )
            )
        except InputError as err:
            job.push(Failed(400, str(err), now))
            return
        job.rid, job.admitted = rid, now
        self._jobs[rid] = job

    def _fail_all(self, message: str) -> None:
        now = time.perf_counter()
        for job in self._jobs.values():
            job.push(Failed(500, message, now))
        self._jobs.clear()
        self.engine = BatchedEngine(self.pair, self.config)
