"""Server replay: many recorded requests decoded together, step by step, as ``engine.batch.BatchedEngine``
decodes them, under an arrival process; each step's time from the cost profile's batch axis.

A step here is the batched engine's step: waiting requests are admitted while the batch has room
(``max_requests``), every request prefilled before the step runs one cycle (``envs.replay.replay_cycles``,
each request's controller asked as the engine asks it, with the step's ``LoadState``: ``engine.load``,
computed as the engine computes it); the verification rows are granted under ``max_rows`` by the engine's own
``grant_rows``; then the step's forwards are timed: each draft level one batched draft forward of every
request still drafting (the first level its pending tokens, later levels its frontier), one batched target
forward of every request's root and granted nodes, the step's prefill chunks, and each request's per-cycle
overhead. Prefills as the engine schedules them: chunks of the waiting prompts in admission order, up to
``max_prefill_tokens`` tokens a step and ``MAX_ROWWISE_ROWS`` of one prompt (``chunked``, the native decoder's
rule; else whole prompts while they fit, at least one a step), each chunk charged the profile's prefill time of
its tokens at its offset (``engine.scheduling.plan_prefills``, the engine's own rule) (``prefill_s(end) - prefill_s(start)``: the chunks of a prompt add up to its whole
prefill); a prompt's last chunk gives its first token, and it decodes from the next step on.
Every request's decision changes the step time of all of them.

The draft catches up as the engine's does (``EngineConfig.draft_catch_up_tokens``, ``draft_catch_up_tokens``
here): in a step shared with other requests' work (``engine.cycle.shares_its_step``), a cycle that would draft while the draft is behind by more than C tokens
(the prompt it has not run plus its pending tokens) is a catch-up cycle (``replay_cycles`` makes it: an
autoregressive step whose record has ``catch_up`` = C), its C tokens charged as that request's rows of the
step's level-1 draft forward (where the live engine runs them, next to the other requests' first draft step),
at the chunk's own context. A request's first drafting cycle pays the draft's prefill of the prompt tokens the
catch-ups left (the whole prompt when none ran: alone, as before), as the profile's prefill difference
(with the draft minus without) over those tokens.

Each cycle record gets the request's *charge* of its step (``engine.costs.load_model.split_forward``: its
marginal rows plus an equal share of the rest, the prefills and the context terms), so the records of all
requests add up to the steps' times; the run's system throughput is every decoded token (first tokens
included) over the time from the first arrival to the last finish.

What replay leaves out: the live engine's Python between forwards beyond the measured per-cycle overhead,
lookup proposals cut by the row cap (a lookup proposes at most 4 tokens, so 8 requests never reach the
64-row cap), the live engine's separate draft forward of a prompt's last part (charged here as prefill, next to
the level-1 rows; live it is one more draft forward of the step), a catch-up chunk of more than
``MAX_ROWWISE_ROWS`` tokens (live a forward alone, here rows of the batched one), and timing noise. ``python benchmarks/server_replay.py`` compares controllers on it; the live
counterpart is ``benchmarks/serve_load.py``.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import numpy as np

from engine.batch_api import BatchConfig
from engine.control import Controller, StaticController
from engine.costs.cost_profile import CostProfile
from engine.costs.load_model import batch_table, step_overhead_of
from engine.costs.profile_io import ProfileError
from engine.cycle import DraftLag, answer
from engine.errors import InputError, is_int
from engine.load import LoadTracker
from engine.lookup import LookupConfig
from engine.prefix_cache import PrefixCache
from engine.results import CycleRecord
from engine.scheduling import StepPlan, grant_rows, plan_prefills, prefill_budget, row_budget, step_load
from envs.backends import ReplayBackend
from envs.replay import Message, ReplayTrace, Reply, replay_cycles
from envs.server_costs import charge_step, chunk_prefill_s
from envs.server_runs import Arrivals, ReplayRequest, ServerRun


class ServerReplay:
    """The batched engine's steps over recorded requests (module docstring). ``profile``: a cost profile
    with a batch axis (``CostProfile.batched``); the single-sequence tables give the context terms, the
    overhead and the prefills. ``lookup``: the engine's context lookup (None: off). ``config``: the batched
    engine's ``BatchConfig`` replayed (default: its defaults): ``max_requests``, ``max_rows``, the prefill
    budgets and ``engine.draft_catch_up_tokens`` (its ``engine.lookup`` is ``lookup`` here, so it must be
    None; the engine's depth and verify caps are the traces', ``envs.replay.ReplayTrace``).
    ``step_overhead_s``: what a live server's step costs beyond them (None: the profile's batch axis says,
    ``engine.costs.load_model.step_overhead_of``: a fitted one holds it, else 0). ``chunked``: prompts prefilled in chunks
    (``BatchedEngine.chunked``). ``prefix_cache_tokens``: the prefix cache's size in prompt positions."""

    def __init__(
        self,
        traces: Sequence[ReplayTrace],
        profile: CostProfile,
        lookup: LookupConfig | None = None,
        config: BatchConfig | None = None,
        *,
        step_overhead_s: float | None = 0.0,
        chunked: bool = True,
        prefix_cache_tokens: int = 0,
    ):
        if not traces:
            raise InputError("a server replay needs traces")
        config = config if config is not None else BatchConfig()
        if not isinstance(config, BatchConfig):
            raise InputError(f"config must be an engine.batch.BatchConfig, got {config!r}")
        if config.engine.lookup is not None:
            raise InputError(
                "a server replay's context lookup is its lookup argument, not config.engine.lookup"
            )
        self.config = config
        """The batched engine's configuration replayed (its scheduling: ``engine.scheduling``)."""
        self.table = batch_table(profile)
        if self.table is None:
            raise ProfileError(
                "the server replay needs the cost profile's batch axis: measure it with "
                "`python -m engine.costs.measure_costs --batch-axis`"
            )
        self.traces, self.profile, self.lookup = list(traces), profile, lookup
        if not is_int(prefix_cache_tokens) or prefix_cache_tokens < 0:
            raise InputError(
                f"prefix_cache_tokens must be an integer >= 0 (0: off), got {prefix_cache_tokens!r}"
            )
        self.prefix_cache_tokens = prefix_cache_tokens
        """Prompt positions the run's prefix cache holds (target and draft each; 0: none). A run starts with an
        empty one; a request's prompt is keyed by its trace's prompt (``_prompt_key``), so the same prompt
        replayed again hits, as the live engine's cache makes it."""
        self.chunked = bool(chunked)
        """Prompts prefilled in chunks (the native decoder's engine), else whole (module docstring)."""
        if step_overhead_s is None:  # the profile's own: a batch axis fitted to a step log has one
            step_overhead_s = step_overhead_of(profile)
        self.step_overhead_s = float(step_overhead_s)
        """Seconds every decoding step costs beyond its forwards and the per-cycle overheads of the profile (the
        server's own work a step: its event loop, the step's Python, the time between steps), split equally
        among the step's requests."""
        self.width = self.traces[0].width
        self.context = int(self.table.batched["context"])

    def with_lookup(self, lookup: LookupConfig | None) -> ServerReplay:
        """The same server replay with another context lookup setting (None: none)."""
        other = copy.copy(self)
        other.lookup = lookup
        return other

    # ----------------------------------------------------------------------------------------- runs
    def run(
        self,
        arrivals: Arrivals,
        make_controller: Callable[[], Controller | None],
        order: Sequence[int] | None = None,
    ) -> ServerRun:
        """Decode ``arrivals.requests`` requests (the traces in ``order``, cycling; default: in turn) with a
        fresh ``make_controller()`` each (None: autoregressive)."""
        loop = self.steps(arrivals, make_controller, order)
        try:
            message = next(loop)
        except StopIteration as stop:
            return stop.value
        raise InputError(f"a run without an external request was asked {message[0]!r}")

    def steps(
        self,
        arrivals: Arrivals,
        make_controller: Callable[[], Controller | None],
        order: Sequence[int] | None = None,
        external: tuple[int, float, bool, bool] | None = None,
        until_external: bool = False,
        background: bool = True,
    ) -> Generator[Message, Reply, ServerRun]:
        """The run as a generator: it yields only the questions and cycles of the ``external`` request
        (trace index, arrival second, decides depth 0, decides lookup), answered by whoever drives it (an environment), and
        returns the ``ServerRun``. ``until_external``: stop when the external request finishes.
        ``background``: False runs the external request alone (no arrivals)."""
        order = list(order) if order is not None else list(range(len(self.traces)))
        count = arrivals.requests
        closed = arrivals.concurrency > 0
        arrival_times = [0.0] * min(arrivals.concurrency, count) if closed else arrivals.poisson_times()
        requests: list[ReplayRequest] = []
        future: deque[ReplayRequest] = deque()

        def spawn(at: float) -> None:
            i = len(requests)
            req = ReplayRequest(i, self.traces[order[i % len(order)]], at, make_controller())
            requests.append(req)
            future.append(req)

        for at in arrival_times if background else ():
            spawn(at)
        ext: ReplayRequest | None = None
        if external is not None:
            index, at, depth_zero, gate = external
            ext = ReplayRequest(
                -1, self.traces[index], at, None, external=True, depth_zero=depth_zero, gate=gate
            )
        queue: deque[ReplayRequest] = deque()
        batch: list[ReplayRequest] = []
        tracker = LoadTracker()
        prefix = None
        if self.prefix_cache_tokens:
            prefix = PrefixCache((1, 1), self.prefix_cache_tokens, with_kv=False)
        now, last_rows, last_drafting, carry = 0.0, 0, 0, 0.0
        steps: list[tuple[float, int, int]] = []
        plans: list[StepPlan] = []
        start = min([r.arrival for r in requests] + ([ext.arrival] if ext else []))
        while True:
            if ext is not None and ext.admitted is None and ext.arrival <= now and ext not in queue:
                queue.append(ext)
            while future and future[0].arrival <= now:
                queue.append(future.popleft())
            while queue and len(batch) < self.config.max_requests:
                req = queue.popleft()
                req.admitted = now
                batch.append(req)
                tracker.arrived(now)
            if not batch:
                upcoming = [r.arrival for r in future] + (
                    [ext.arrival] if ext is not None and ext.admitted is None else []
                )
                if not upcoming:
                    break
                now = max(now, min(upcoming))
                continue
            step_s = 0.0
            running = [r for r in batch if r.prefilled and not r.done]
            waiting = sum(not r.prefilled for r in batch) + len(queue)
            plan = StepPlan()
            shared = self._prefill_chunks(batch, len(running), prefix, plan)
            rate = tracker.rate(now)
            for req in running:
                req.load = step_load(
                    len(running), waiting, last_rows, req.target_rows, last_drafting, req.drafted, rate
                )
                req.record, req.want = None, None
            for req in running:  # phase A: each up to its size question (or its cycle's end)
                yield from self._until_size(req)
            asking = [r for r in running if r.want is not None]
            fixed = sum(1 + r.record.num_verified for r in running if r.record is not None)
            budget = row_budget(self.config.max_rows, fixed, len(asking))
            for req, granted in zip(asking, grant_rows([r.want for r in asking], budget)):
                kind, rec = req.loop.send(granted)
                req.record = rec
            step_s += shared
            if (
                running
            ):  # the prefill seconds of steps nobody decoded in go to the next decoding step's records
                step_s += charge_step(self, running, shared + carry)
                carry = 0.0
            else:
                carry += shared
            now += step_s
            steps.append((step_s, len(running), sum(r.target_rows for r in running)))
            plan.cycles = [(r.rid, r.record) for r in running]
            plans.append(plan)
            last_rows = sum(r.target_rows for r in running)
            last_drafting = sum(r.drafted for r in running)
            finished_ext = False
            for req in batch:
                if req.prefilled and req.first_token is None:
                    req.first_token = now
                    req.token_times.append(now)
            for req in running:
                rec = req.record
                self._commit(req, rec, now)
                if req.external:
                    yield ("cycle", rec)
                else:
                    answer(req.controller, ("cycle", rec))
                if req.done:
                    req.finished = now
                    finished_ext = finished_ext or req.external
            done = [r for r in batch if r.done]
            for req in done:
                if req.finished is None:  # its first token ended it
                    req.finished = now
                if prefix is not None and req.lag is not None:  # what its draft ran of the prompt
                    ran = req.trace.trace.prompt_len - req.lag.prompt_left
                    prefix.insert(prefix.draft, _prompt_key(req)[:ran], None)
            batch = [r for r in batch if not r.done]
            if closed and background:
                for _ in done:
                    if len(requests) < count and not (ext is not None and _ is ext):
                        spawn(now)
            if until_external and finished_ext:
                break
            if (
                not batch
                and not future
                and not queue
                and (ext is None or ext.done or ext.admitted is not None)
            ):
                break
        members = requests + ([ext] if ext is not None else [])
        end = max([r.finished for r in members if r.finished is not None] + [now])
        return ServerRun(arrivals, members, steps, start, end, plans)

    # ---------------------------------------------------------------------------------- internals
    def _prefill_chunks(
        self, batch: list[ReplayRequest], decoding: int, prefix: PrefixCache | None, plan: StepPlan
    ) -> float:
        """This step's prefill chunks (module docstring), with the engine's budget for ``decoding`` requests
        decoding and its prefix cache rules (``engine.batch``: a prompt's hit is looked up when its prefill
        starts, never its last token; one whose prefix an earlier prompt of the step is computing waits): their
        seconds, each listed in ``plan``; a prompt whose last chunk ran starts."""
        waiting = [req for req in batch if not req.prefilled]
        hits = [
            prefix.target.match(_prompt_key(r), r.trace.trace.prompt_len - 1).length
            if prefix is not None and r.cached is None
            else 0
            for r in waiting
        ]
        left = [req.trace.trace.prompt_len - req.filled - hit for req, hit in zip(waiting, hits)]
        config = self.config
        budget, per_prompt = prefill_budget(decoding, config.max_prefill_tokens, config.idle_prefill_tokens)
        takes = plan_prefills(left, budget, self.chunked, per_prompt)
        if prefix is not None:
            for i in range(1, len(takes)):
                key = waiting[i].trace.trace.prompt_id
                same = [w.trace.trace.prompt_id == key for w in waiting[:i]]
                if (
                    waiting[i].cached is None
                    and any(same)
                    and waiting[i].trace.trace.prompt_len - 1 > hits[i]
                ):
                    takes = takes[:i]
                    break
        seconds = 0.0
        for req, hit, take in zip(waiting, hits, takes):
            if req.cached is None:
                req.cached = req.filled = hit
            end = req.filled + take
            plan.prefill.append((req.rid, take, req.filled))
            seconds += chunk_prefill_s(self.profile, req.filled, take)
            req.filled = end
            if end == req.trace.trace.prompt_len:
                req.prefilled = True
                draft_hit = 0
                if prefix is not None:
                    key = _prompt_key(req)
                    prefix.insert(prefix.target, key, None)
                    draft_hit = prefix.draft.match(key, len(key) - 1).length
                self._start(req, draft_hit)
        return seconds

    def _start(self, req: ReplayRequest, draft_hit: int = 0) -> None:
        ctrl = req.controller
        speculative = req.external or ctrl is not None
        depth_zero = req.depth_zero if req.external else bool(ctrl and ctrl.decides_depth_zero)
        gate = req.gate if req.external else bool(ctrl and ctrl.decides_lookup)
        if ctrl is not None:
            if ctrl.tree_width != self.width:
                raise InputError(f"controller tree_width {ctrl.tree_width} != trace tree_width {self.width}")
            ctrl.reset()
        req.lag = DraftLag(req.trace.trace.prompt_len - draft_hit)
        req.loop = replay_cycles(
            req.trace, None, None, speculative=speculative, depth_zero=depth_zero, lookup=self.lookup,
            load=lambda: req.load, catch_up=self.config.engine.draft_catch_up_tokens, lag=req.lag, gate=gate,
        )  # fmt: skip
        if req.trace.done(0):
            req.done = True

    def _until_size(self, req: ReplayRequest) -> Generator[Message, Reply, None]:
        """Advance ``req``'s cycle to its size question (``req.want``) or its end (``req.record``)."""
        reply: Reply = None
        while True:
            kind, payload = req.loop.send(reply)
            if kind == "cycle":
                req.record = payload
                return
            if req.external:
                reply = yield (kind, payload)
            else:
                reply = answer(req.controller, (kind, payload))
            if kind == "size":
                req.want = req.trace.verified(int(reply), req.trace.num_drafted(req.t, payload.depth))
                return

    def _commit(self, req: ReplayRequest, rec: CycleRecord, now: float) -> None:
        req.t += rec.emitted  # the draft's lag moves when its loop resumes (``replay_cycles``)
        req.records.append(rec)
        req.token_times.extend([now] * rec.emitted)
        if req.trace.done(req.t):
            req.done = True
            try:  # the coroutine ends after its last cycle
                req.loop.send(None)
            except StopIteration:
                pass


# ------------------------------------------------------------------------------------ tuning and scores
def closed_loop(concurrency: int, traces: int, seed: int = 0) -> Arrivals:
    """The closed-loop run every comparison uses: ``concurrency`` clients, each request of the traces once
    (at least two per client, so every client's second request meets a busy server)."""
    return Arrivals.closed(concurrency, max(traces, 2 * concurrency), seed)


def tune_table(
    sim: ServerReplay, concurrencies: Sequence[int], depths: Sequence[int] = (0, 1, 2, 3, 4, 6)
) -> dict[int, tuple[int, float]]:
    """The static setting tuned per load level (the vLLM-style table): for each closed-loop concurrency, the
    depth d (verifying the top d nodes: a whole chain; 0: autoregressive) with the most system tokens/s,
    and that figure."""
    out = {}
    for n in concurrencies:
        arrivals = closed_loop(n, len(sim.traces))
        scores = {
            d: sim.run(arrivals, lambda d=d, w=sim.width: StaticController(d, d, w)).tokens_per_s
            for d in depths
        }
        best = max(scores, key=scores.get)
        out[n] = (best, scores[best])
    return out


def tune_lookup_limit(sim: ServerReplay, concurrencies: Sequence[int]) -> tuple[int, dict[int, float]]:
    """The load limit of ``sim``'s context lookup (``LookupConfig.max_requests``), tuned on its traces: at
    each closed-loop concurrency, lookup-only decoding's system tokens/s over plain autoregressive decoding's;
    the limit is the largest concurrency at which, and at every one below it, lookup does not lose (0: it
    never loses, no limit; the smallest concurrency when it loses there already). Returns (limit, n ->
    ratio)."""
    if sim.lookup is None:
        raise InputError("tune_lookup_limit needs a server replay with context lookup")
    looked, plain = sim.with_lookup(sim.lookup.rules), sim.with_lookup(None)
    ratios: dict[int, float] = {}
    for n in sorted(int(c) for c in concurrencies):
        arrivals = closed_loop(n, len(sim.traces))
        with_lookup = looked.run(arrivals, lambda: None).tokens_per_s
        ratios[n] = with_lookup / max(plain.run(arrivals, lambda: None).tokens_per_s, 1e-12)
    levels = sorted(ratios)
    paying = 0
    for n in levels:
        if ratios[n] < 1.0:
            break
        paying = n
    if paying == levels[-1]:
        return 0, ratios
    return max(paying, levels[0]), ratios


def load_score(
    sim: ServerReplay,
    make_controller: Callable[[], Controller | None],
    concurrencies: Sequence[int],
    reference: Mapping[int, float],
) -> float:
    """Mean over the concurrencies of the system tokens/s with ``make_controller`` for every request, each
    over ``reference[n]`` (autoregressive decoding's): one number for a controller across load levels."""
    ratios = [
        sim.run(closed_loop(n, len(sim.traces)), make_controller).tokens_per_s / reference[n]
        for n in concurrencies
    ]
    return float(np.mean(ratios))


# ------------------------------------------------------------------------------------ training backend
class ServerReplayBackend:
    """Training episodes inside a server replay: one request (the episode's trace) decoded among a closed
    loop of ``n - 1`` other clients, ``n`` drawn per episode from ``concurrencies``; the others run the
    controller ``background(n)`` makes (the per-load static table, say), the episode's request asks its
    questions of the environment. Its cycles carry its charge of every step (module docstring), scaled by
    ``scale[n]`` (the background's system tokens/s at ``n`` over its tokens/s alone), so that tokens per
    second mean the same at every load and one average-reward rho serves all of them (as ``envs.profiles``
    rescales its profiles). The request arrives at a uniformly drawn time of the others' first requests, so
    it meets them at every stage of their decoding. The ``Backend`` protocol of ``envs.backends``."""

    kind = "replay"

    def __init__(
        self,
        traces: Sequence[ReplayTrace],
        profile: CostProfile,
        background: Callable[[int], Callable[[], Controller | None]],
        concurrencies: Sequence[int] = (1, 2, 4, 8),
        profiles=None,
        lookup: LookupConfig | None = None,
        config: BatchConfig | None = None,
        step_overhead_s: float = 0.0,
    ):
        """``lookup``, ``config``, ``step_overhead_s``: the ``ServerReplay``'s."""
        if not traces:
            raise InputError("no traces: record some with `python -m envs.record_traces`")
        self.traces, self.profile, self.profiles, self.lookup = list(traces), profile, profiles, lookup
        self.background, self.concurrencies = background, tuple(int(n) for n in concurrencies)
        self.step_overhead_s = step_overhead_s
        self.width = self.traces[0].width
        self.num_episodes = len(self.traces)
        self.sim = ServerReplay(self.traces, profile, lookup, config, step_overhead_s=step_overhead_s)
        per_request = {}
        self.spans: dict[int, float] = {}
        for n in self.concurrencies:
            run = self.sim.run(closed_loop(n, len(self.traces)), background(n))
            recs = [rec for r in run.requests for rec in r.records]
            per_request[n] = sum(r.emitted for r in recs) / max(sum(r.total_s for r in recs), 1e-12)
            first = [r.finished - r.arrival for r in run.requests[: max(n - 1, 1)] if r.finished is not None]
            self.spans[n] = max(float(np.mean(first)), 0.0) if first else 0.0
        alone = per_request[min(self.concurrencies)]
        # no decoded token to measure by (traces that end at their first token): no rescaling
        self.scale = {
            n: per_request[n] / alone if alone > 0 and per_request[n] > 0 else 1.0 for n in self.concurrencies
        }

    def __deepcopy__(self, memo):
        return self  # read-only after construction; gymnasium deep-copies make() kwargs

    def sample_profile(self, rng: np.random.Generator):
        """The cost profile of the next episode: ``profile``, or a draw from the mix."""
        return self.profile if self.profiles is None else self.profiles.sample(rng)

    def new_episode(
        self,
        index: int,
        rng: np.random.Generator,
        depth_zero: bool = False,
        profile: Any = None,
        gate: bool = False,
    ) -> Generator[Message, Reply, None]:
        n = int(self.concurrencies[int(rng.integers(len(self.concurrencies)))])
        sim = self.sim
        if profile is not None and profile is not self.profile:
            sim = ServerReplay(
                self.traces, profile, self.lookup, self.sim.config, step_overhead_s=self.step_overhead_s
            )
        others = n - 1
        order = [int(i) for i in rng.permutation(len(self.traces))]
        arrival = float(rng.uniform(0.0, self.spans[n])) if others else 0.0
        arrivals = Arrivals.closed(max(others, 1), 4 * max(others, 1), seed=int(rng.integers(2**31)))
        make = self.background(n) if others else (lambda: None)
        steps = sim.steps(
            arrivals,
            make,
            order,
            external=(index, arrival, depth_zero, gate),
            until_external=True,
            background=others > 0,
        )
        return _scaled(steps, self.scale[n])

    def throughput_of(self, controller: Controller | None) -> float:
        """Decode tokens per second of ``controller`` alone over every trace (the average reward's reference
        scale: the episodes' times are rescaled to it)."""
        return ReplayBackend(self.traces, self.profile, lookup=self.lookup).throughput_of(controller)


def _scaled(steps: Generator[Message, Reply, ServerRun], scale: float) -> Generator[Message, Reply, None]:
    """The external request's messages, its cycle times multiplied by ``scale``."""
    reply: Reply = None
    while True:
        try:
            kind, payload = steps.send(reply)
        except StopIteration:
            return
        if kind == "cycle":
            payload.draft_s *= scale
            payload.verify_s *= scale
            payload.overhead_s *= scale
            payload.forward_s *= scale
        reply = yield (kind, payload)


def _prompt_key(req: ReplayRequest) -> list:
    """The ids a request's prompt is cached under in the replay's prefix cache: a trace holds its prompt's length
    and name, not its ids, so (name, position) stands for each token: the same prompt matches whole, two
    prompts share nothing (live, prompts of one chat template share its first tokens: a few milliseconds)."""
    trace = req.trace.trace
    return [(trace.prompt_id, i) for i in range(trace.prompt_len)]
