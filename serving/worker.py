"""The engine thread of the server: one ``BatchedEngine`` driven by one thread, fed by the event loop.

Requests reach the thread as ``Job`` objects through ``EngineWorker.submit`` (thread-safe). The thread admits
waiting jobs while the batch has room (``BatchConfig.max_requests``), runs ``BatchedEngine.step`` while any
job is in flight, and hands every job its committed tokens and its end through the job's asyncio queue
(``loop.call_soon_threadsafe``), so the event loop never waits on the engine and the engine never waits on a
client. Cancellations (a client gone, a stop string met) are applied between steps: the slot and its caches
are freed before the next step.

Refusals are immediate, never a hang: more than ``max_waiting`` jobs waiting for a slot raises ``Overloaded``
(HTTP 429), a worker that drains or has stopped raises ``Unavailable`` (HTTP 503). A request the engine
refuses (``InputError``, a KV reservation past the whole ``BatchConfig.max_kv_bytes`` included) ends that job
alone with its message (HTTP 400); one whose reservation does not fit next to the running ones' now
(``MemoryFull``) stays at the head of the line until memory frees.

The thread survives every exception. A request's own failure ends that job alone with a 500 and a one-line
reason (the engine's ``_guard``; so does an error admitting it or posting its output); an error in the step
hook (``on_step``) is reported on stderr (each distinct one once) and affects no job. Only a step that raises (``EngineFailed``: a
shared forward failed for every request, alone too; or a bug outside any request's work) fails the jobs in
flight with a 500, and the worker goes on with a fresh engine: one bad step never takes the server down.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from engine.backends.pair import ModelPair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest, CapacityError, one_line
from engine.control import Controller
from engine.errors import DraftpilotError, InputError
from engine.results import CycleRecord, GenerationResult
from engine.sampling import SamplingConfig

T = TypeVar("T")


def off_main_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` run in a thread of its own that exits when it returns (its exception re-raised here).

    What loads the models for the engine thread runs here, not on the main thread: torch's CPU kernels fork
    OpenMP teams, one per thread that runs them, and a team outlives its work while its thread lives. A main
    thread that loaded (or warmed) the models keeps a team for good, so the engine thread's team makes the
    process hold more OpenMP threads than cores; libgomp then stops spinning between parallel regions and
    wakes its threads through the kernel at every one, a few hundred times a step (measured on a 2-core
    EPYC: 40-48 ms a decoding step where the same step took 26-31 ms on a single thread,
    docs/results/2026-12-05-chunked-prefill.md). A thread that exits takes its team with it."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn(*args)))
        except BaseException as err:  # noqa: BLE001 - handed to the caller as it is
            box.append((False, err))

    thread = threading.Thread(target=run, name="draftpilot-load")
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


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
    cached_tokens: int = 0
    """Prompt tokens the request took from the prefix cache (``usage.prompt_tokens_details.cached_tokens``)."""


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
        engine_factory: Callable[[ModelPair, BatchConfig], BatchedEngine] = BatchedEngine,
    ):
        self.pair, self.config, self.max_waiting = pair, config, max_waiting
        self.engine_factory = engine_factory
        """Builds the engine (at start and after a failed step); ``serving.faults`` swaps in its test engine."""
        self.engine = engine_factory(pair, config)
        self.on_step = on_step
        """Called on the engine thread after each step with (requests in the step, seconds, events)."""
        self.kv_reserved = 0
        """KV bytes the admitted requests reserve, as of the last round (``BatchedEngine.kv_reserved``)."""
        self.kv_allocated = 0
        """KV bytes their caches hold, as of the last round (``BatchedEngine.kv_allocated``)."""
        self.prefix: dict[str, int] = {}
        """The prefix cache's figures as of the last round (``ServerMetrics.prefix_cache``); empty without one."""
        self._hook_errors: set[str] = set()
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
            while True:
                try:
                    if not self._turn():
                        break
                except Exception as err:  # noqa: BLE001 - a bug of the worker's own: fail the jobs, go on
                    self._fail_all(f"internal error in the engine thread: {one_line(err)}")
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
                self._drop(job.rid)
                _push(job, Finished("cancelled", None, now))
        for i, job in enumerate(admit):
            if not self._admit(job, now):  # its KV reservation does not fit now: it and those after it wait
                with self._cond:
                    self._waiting.extendleft(reversed(admit[i:]))
                break
        if not self._jobs:
            self._account()
            return True
        started = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception as err:  # noqa: BLE001 - not one request's own error: fail the batch, fresh engine
            self._fail_all(f"internal error in a batched step: {one_line(err)}")
            return True
        took = time.perf_counter() - started
        now = time.perf_counter()
        for event in events:
            job = self._jobs.get(event.rid)
            if job is None:
                continue
            try:
                self._post(job, event, now)
            except Exception as err:  # noqa: BLE001 - this job's output could not be posted: it ends alone
                self._jobs.pop(event.rid, None)
                self._drop(event.rid)
                _push(job, Failed(500, f"internal error posting the request's output: {one_line(err)}", now))
        self._account()
        if self.on_step is not None:
            try:
                self.on_step(len(events), took, events)
            except Exception as err:  # noqa: BLE001 - the hook's failure is no request's
                message = one_line(err)
                if message not in self._hook_errors:  # each distinct failure once, not once a step
                    self._hook_errors.add(message)
                    print(f"draftpilot: the step hook failed: {message}", file=sys.stderr, flush=True)
        return True

    def _post(self, job: Job, event, now: float) -> None:
        """Hand ``job`` what one step did for it: its tokens, and its end."""
        if event.tokens:
            job.push(Tokens(event.tokens, now, event.record, event.cached_tokens))
        if event.finished:
            del self._jobs[event.rid]
            try:
                result = self.engine.result(event.rid)
            except DraftpilotError as err:
                reason = " ".join(str(err).split())
                if not reason.startswith("the request failed"):
                    reason = f"the request failed: {reason}"
                job.push(Failed(500, reason, now))
            else:
                job.push(Finished(event.finish_reason, result, now))

    def _drop(self, rid: int) -> None:
        """Free request ``rid`` in the engine (running, or finished and not collected), if it is there."""
        try:
            self.engine.cancel(rid)
        except InputError:
            pass

    def _account(self) -> None:
        self.kv_reserved, self.kv_allocated = self.engine.kv_reserved, self.engine.kv_allocated()
        prefix = self.engine.prefix
        if prefix is not None:
            stats = prefix.stats
            self.prefix = {
                "queries": stats.queries,
                "query_tokens": stats.query_tokens,
                "hit_tokens": stats.hit_tokens,
                "draft_hit_tokens": stats.draft_hit_tokens,
                "evictions": prefix.evictions,
                "bytes": prefix.bytes,
                "max_bytes": prefix.max_bytes,
            }

    def _admit(self, job: Job, now: float) -> bool:
        """Add ``job`` to the engine, or end it (cancelled, refused, failed); False: it does not fit now
        (``MemoryFull``, a full batch) and goes back to the line."""
        if job.cancelled:
            _push(job, Finished("cancelled", None, now))
            return True
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
        except CapacityError as err:
            if self._jobs:
                return False
            # nothing runs, so nothing will free: not a wait but an inconsistency, reported, never a hang
            _push(job, Failed(500, f"the request cannot be admitted: {one_line(err)}", now))
            return True
        except InputError as err:
            _push(job, Failed(400, str(err), now))
            return True
        except Exception as err:  # noqa: BLE001 - this job's admission failed: it ends alone
            _push(job, Failed(500, f"the request could not be admitted: {one_line(err)}", now))
            return True
        job.rid, job.admitted = rid, now
        self._jobs[rid] = job
        return True

    def _fail_all(self, message: str) -> None:
        """Fail every job in flight with ``message`` (HTTP 500) and go on with a fresh engine."""
        now = time.perf_counter()
        for job in self._jobs.values():
            _push(job, Failed(500, message, now))
        self._jobs.clear()
        try:
            self.engine = self.engine_factory(self.pair, self.config)
        except Exception as err:  # noqa: BLE001 - keep the old one: its slots were for the jobs just failed
            print(f"draftpilot: could not rebuild the engine: {one_line(err)}", file=sys.stderr, flush=True)
            for rid in self.engine.requests:
                self._drop(rid)
        self._account()


def _push(job: Job, item: Tokens | Finished | Failed) -> None:
    """``job.push`` that never raises (a job whose queue cannot take items any more is gone)."""
    try:
        job.push(item)
    except Exception:  # noqa: BLE001, S110 - nobody can be told
        pass
