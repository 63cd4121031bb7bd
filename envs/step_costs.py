"""The server replay's step costs fitted to a live server's step log (``serve.py --step-log FILE``,
``serving.step_log``), and a replay run written as such a log.

What is fitted. The replay times a step (``envs.server_costs.charge_step``) as its batched forwards read from the
profile's batch axis (one target forward of every request's root and verified nodes, a draft forward per draft
level), the context terms and per-cycle overheads of the single-sequence tables, the draft's prefill of a
request's first drafting cycle, a step overhead, and the step's prefill chunks from the prefill table. The fit
keeps the single-sequence terms as they are and fits the rest to the logged steps by non-negative least
squares: a target forward as ``a`` a sequence plus ``b`` a row, a draft forward as ``c`` plus ``d`` a sequence
plus ``e`` a row, ``f`` a step (the step overhead: the server's own work a step, the time between steps
included) and the prefill table scaled by ``g``. Each term's feature is what ``charge_step`` charges a logged
step with a table of that term alone (a table linear in sequences and rows is what its interpolation
reproduces exactly), so the fitted profile is the one cost model the replay charges with, not a copy of it: a
step's time is the fit's prediction. ``fit_profile`` writes the fitted terms into a copy of the profile
(``CostProfile.batched``: linear tables and ``step_overhead_s``; the prefill tables scaled; ``meta["step_fit"]``
the terms and the fit's error), which ``envs.server.ServerReplay`` charges with (its step overhead from the
profile when given None).

A logged step's requests are rebuilt as the replay holds them (``LoggedRequest``): each cycle's record, the
prompt length its prefill chunks add up to, and what the draft is behind by (``engine.cycle.DraftLag``, moved
by each cycle as the replay moves it; a drafting chain's accepted nodes past the ones the draft ran stay
pending). A step's seconds are the engine's step plus the gap before it while the server was busy (at most
``max_gap_s``: a longer one is the server waiting for requests). Steps are grouped into levels: runs of steps
that share a request with the step before, each labelled by the most requests the server held in it (in the
batch and waiting), so that a closed loop of N clients is level N (``benchmarks/serve_load.py`` runs its levels
one after another on one server).

``replay_log``: a ``ServerRun``'s steps as step-log lines (the fields the fit reads), so the fit can be checked
on steps whose costs are known.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from scipy.optimize import nnls

from engine.costs.cost_profile import CostProfile
from engine.costs.load_model import batch_table, step_overhead_of
from engine.cycle import DraftLag
from engine.errors import InputError
from engine.results import CycleRecord
from engine.scheduling import CYCLE_FIELDS
from envs.server_costs import charge_step, chunk_prefill_s
from envs.server_runs import ServerRun

TERMS = (
    "step_s",
    "target_per_sequence_s",
    "target_per_row_s",
    "draft_per_forward_s",
    "draft_per_sequence_s",
    "draft_per_row_s",
    "prefill_scale",
)
"""The fitted terms, in the order of the least-squares columns (module docstring)."""

SEQUENCES = (1, 2, 4, 8, 16, 32, 64)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""The grid of a fitted (linear) batch table: sequences, rows per sequence."""

MAX_GAP_S = 0.05
"""A gap between two logged steps up to this long is the server's own time between steps; a longer one is the
server idle (waiting for requests)."""


@dataclass
class LoggedRequest:
    """A request of a logged step as ``charge_step`` reads it (``envs.server_runs.ReplayRequest``'s fields)."""

    rid: tuple[int, int]
    prompt_len: int
    lag: DraftLag
    record: CycleRecord | None = None
    target_rows: int = 0
    drafted: bool = False


@dataclass
class LoggedStep:
    """One step of a step log: its seconds (the gap before it included), its prefill chunks ((start, tokens)
    each), the requests that ran a cycle (their state before it), and its level (module docstring)."""

    seconds: float
    prefill: list[tuple[int, int]]
    running: list[LoggedRequest]
    level: int = 0
    source: str = ""
    chunk_rids: list[tuple[int, int, int]] = field(default_factory=list)
    """The prefill chunks as logged: (request, tokens, start)."""


@dataclass
class StepFit:
    """The fitted terms (``TERMS``: seconds, the prefill scale a factor), the profile fitted from, and per step
    its seconds, what the fitted profile charges it and what the base profile charges it."""

    terms: dict[str, float]
    steps: list[LoggedStep]
    seconds: np.ndarray
    fitted: np.ndarray
    before: np.ndarray
    fitted_terms: tuple[str, ...] = ()
    """The terms the log's steps inform (a log without drafting leaves the draft's terms at the base table's)."""
    profile: CostProfile | None = None
    levels: list[dict] = field(default_factory=list)


def logged_steps(
    lines: Sequence[dict],
    max_gap_s: float = MAX_GAP_S,
    source: str = "",
    levels: Sequence[tuple[int, int]] | None = None,
    skip: int = 0,
) -> list[LoggedStep]:
    """The steps of a step log's ``lines`` (``serving.step_log.read_step_log``) as the replay charges them
    (module docstring). ``levels``: (level, requests) of each level in the order the server admitted them,
    after ``skip`` requests (a warm-up: level 0): a step's level is its first request's (default: the runs of
    steps that share a request, each labelled by the most requests the server held in it)."""
    prompt: dict[tuple[int, int], int] = {}
    lags: dict[tuple[int, int], DraftLag] = {}
    steps: list[LoggedStep] = []
    previous_end, previous_ids = None, set()
    level_start = 0
    for line in lines:
        engine = int(line.get("engine", 0))
        chunks = []
        for rid, take, start in line.get("prefill", []):
            key = (engine, int(rid))
            prompt[key] = int(start) + int(take)
            chunks.append((int(start), int(take)))
        running = []
        for cycle in line.get("cycles", []):
            key = (engine, int(cycle[0]))
            values = dict(zip(CYCLE_FIELDS, cycle[1:]))
            rec = CycleRecord(
                int(values["context"]), int(values["depth"]), int(values["drafted"]),
                int(values["verified"]), int(values["accepted"]), int(values["emitted"]),
                lookup=bool(values["lookup"]), catch_up=int(values["catch_up"]),
            )  # fmt: skip
            length = prompt.get(key, int(values["context"]))
            lag = lags.setdefault(key, DraftLag(length))
            running.append(LoggedRequest(key, length, copy.copy(lag), rec))
            lag.commit(rec, pending_after(rec))
        seconds = float(line["s"])
        end = float(line.get("t", 0.0))
        if previous_end is not None:
            gap = end - seconds - previous_end
            if 0 < gap <= max_gap_s:
                seconds += gap
        previous_end = end
        ids = {r.rid for r in running} | {(engine, int(c[0])) for c in line.get("prefill", [])}
        if steps and not ids & previous_ids:
            _label(steps[level_start:])
            level_start = len(steps)
        previous_ids = ids | {(engine, int(r)) for r in line.get("finished", [])}
        held = int(line.get("requests", len(ids))) + int(line.get("waiting", 0))
        logged = [tuple(int(x) for x in c) for c in line.get("prefill", [])]
        steps.append(LoggedStep(seconds, chunks, running, held, source, logged))
    _label(steps[level_start:])
    if levels is not None:
        bounds = np.cumsum([skip] + [int(n) for _, n in levels])
        labels = [0] + [int(level) for level, _ in levels] + [-1]
        for step in steps:
            rids = [r.rid[1] for r in step.running] + [rid for rid, _, _ in step.chunk_rids]
            step.level = labels[int(np.searchsorted(bounds, min(rids), side="right"))] if rids else -1
    return steps


def _label(steps: list[LoggedStep]) -> None:
    """Every step of a level gets the most requests the server held in it."""
    most = max((s.level for s in steps), default=0)
    for s in steps:
        s.level = most


def pending_after(rec: CycleRecord) -> int:
    """What a drafting cycle leaves the draft behind by (``envs.replay.ReplayTrace.pending_after`` for a chain:
    the accepted nodes past the first depth - 1, which the draft ran, plus the recovered/bonus token)."""
    if rec.depth <= 0:
        return 0
    return rec.accepted - min(rec.accepted, rec.depth - 1) + 1


class StepCharger:
    """What ``charge_step`` reads of a server replay: the profile, a batch table, its context, the tree width and
    the step overhead."""

    def __init__(self, profile: CostProfile, table: CostProfile, width: int, step_overhead_s: float):
        self.profile, self.table, self.width = profile, table, width
        self.context = int(table.batched["context"])
        self.step_overhead_s = step_overhead_s


def linear_table(context: int, target: tuple[float, float, float], draft: tuple[float, float, float]) -> dict:
    """A batch axis (``CostProfile.batched``) at ``context`` whose forwards cost (per forward, per sequence, per
    row) seconds: target and draft, on the grid ``SEQUENCES`` x ``ROWS``."""
    table: dict[str, Any] = {"context": int(context), "target": [], "draft": []}
    for s in SEQUENCES:
        for r in ROWS:
            for key, (c, a, b) in (("target", target), ("draft", draft)):
                table[key].append([s, s * r, c + a * s + b * s * r])
    return table


def step_charge(step: LoggedStep, charger: StepCharger) -> float:
    """What the replay charges ``step`` with ``charger``'s profile, table and step overhead: its cycles'
    (``charge_step``) and its prefill chunks."""
    prefill = sum(chunk_prefill_s(charger.profile, start, take) for start, take in step.prefill)
    if not step.running:
        return prefill
    running = [copy.copy(r) for r in step.running]
    for r in running:
        r.record = copy.copy(r.record)
    return prefill + charge_step(charger, running, 0.0)


def step_features(
    steps: Sequence[LoggedStep], profile: CostProfile, width: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(what the replay charges each step with every fitted term 0: the single-sequence terms, [steps x
    ``TERMS``] what each term adds at 1 second (the prefill scale: the profile's prefill seconds))."""
    base = batch_table(profile)
    context = int(base.batched["context"]) if base is not None else 512
    zero = (0.0, 0.0, 0.0)

    def table(target=zero, draft=zero) -> CostProfile:
        return replace(profile, batched=linear_table(context, target, draft))

    bases = [
        (table(), 1.0),
        (table(target=(0.0, 1.0, 0.0)), 0.0),
        (table(target=(0.0, 0.0, 1.0)), 0.0),
        (table(draft=(1.0, 0.0, 0.0)), 0.0),
        (table(draft=(0.0, 1.0, 0.0)), 0.0),
        (table(draft=(0.0, 0.0, 1.0)), 0.0),
    ]
    zero_charger = StepCharger(profile, table(), width, 0.0)
    offsets = np.zeros(len(steps))
    columns = np.zeros((len(steps), len(TERMS)))
    for i, step in enumerate(steps):
        prefill = sum(chunk_prefill_s(profile, start, take) for start, take in step.prefill)
        offset = step_charge(step, zero_charger) - prefill
        offsets[i] = offset
        for j, (t, overhead) in enumerate(bases):
            columns[i, j] = step_charge(step, StepCharger(profile, t, width, overhead)) - prefill - offset
        columns[i, len(bases)] = prefill
    return offsets, columns


def fit_steps(
    steps: Sequence[LoggedStep], profile: CostProfile, width: int = 1, step_overhead_s: float | None = None
) -> StepFit:
    """The terms (``TERMS``) that make the replay's charge of ``steps`` closest to their seconds (least squares,
    every term >= 0), and the profile holding them (``fit_profile``). A term no step informs (no draft forward in
    the log) is not fitted: the draft's keep the base table's forwards. ``step_overhead_s``: the base profile's
    step overhead, for the per-step charge before the fit (None: the profile's own)."""
    steps = list(steps)
    if not steps:
        raise InputError("a step log without steps: run serve.py --step-log FILE under load first")
    seconds = np.asarray([s.seconds for s in steps])
    offsets, columns = step_features(steps, profile, width)
    informed = [j for j in range(len(TERMS)) if np.any(np.abs(columns[:, j]) > 0)]
    if not informed:
        raise InputError("no step of the log ran a forward the replay charges")
    coef = np.zeros(len(TERMS))
    coef[informed], _ = nnls(columns[:, informed], seconds - offsets)
    terms = dict(zip(TERMS, (float(c) for c in coef)))
    fitted_terms = tuple(TERMS[j] for j in informed)
    out = fit_profile(profile, terms, fitted_terms)
    fit = charged_steps(steps, profile, out, width, step_overhead_s)
    fit.terms, fit.fitted_terms = terms, fitted_terms
    out.meta["step_fit"] = {
        "terms": terms,
        "fitted_terms": list(fitted_terms),
        "steps": len(steps),
        "levels": fit.levels,
    }
    return fit


def charged_steps(
    steps: Sequence[LoggedStep],
    before: CostProfile,
    fitted: CostProfile,
    width: int = 1,
    step_overhead_s: float | None = None,
) -> StepFit:
    """What ``before`` (charged ``step_overhead_s`` a step; None: its own) and ``fitted`` (its own step overhead)
    charge each of ``steps``, and per level (``level_errors``): to check a fitted profile on another run's log
    (terms left empty)."""
    steps = list(steps)
    if step_overhead_s is None:
        step_overhead_s = step_overhead_of(before)
    before_charger = StepCharger(before, batch_table(before) or fitted, width, step_overhead_s)
    fitted_charger = StepCharger(fitted, batch_table(fitted), width, step_overhead_of(fitted))
    fit = StepFit(
        terms={},
        steps=steps,
        seconds=np.asarray([s.seconds for s in steps]),
        fitted=np.asarray([step_charge(s, fitted_charger) for s in steps]),
        before=np.asarray([step_charge(s, before_charger) for s in steps]),
        profile=fitted,
    )
    fit.levels = level_errors(fit)
    return fit


def fit_profile(
    profile: CostProfile, terms: dict[str, float], fitted_terms: Sequence[str] = TERMS
) -> CostProfile:
    """A copy of ``profile`` charging ``terms``: its batch axis the linear tables of the forwards' terms (the
    draft's left as the base table's when ``fitted_terms`` holds none of them) with ``step_overhead_s``, its
    target prefill table scaled by the prefill scale."""
    base = batch_table(profile)
    if base is None:
        raise InputError("the profile has no batch axis to fit: measure it with --batch-axis")
    context = int(base.batched["context"])
    target = (0.0, terms["target_per_sequence_s"], terms["target_per_row_s"])
    draft = (terms["draft_per_forward_s"], terms["draft_per_sequence_s"], terms["draft_per_row_s"])
    table = linear_table(context, target, draft)
    if not any(name.startswith("draft_") for name in fitted_terms):
        table["draft"] = [list(cell) for cell in base.batched["draft"]]
    table["step_overhead_s"] = terms["step_s"]
    scale = terms["prefill_scale"] if "prefill_scale" in fitted_terms else 1.0
    return replace(
        profile,
        batched=table,
        prefill_target_s=[scale * t for t in profile.prefill_target_s],
        meta=dict(profile.meta),
    )


def level_errors(fit: StepFit) -> list[dict]:
    """Per level (and source log): steps, logged seconds, what the base and the fitted profile charge, and the
    fit's error (charged / logged - 1)."""
    out = []
    keys = sorted({(s.source, s.level) for s in fit.steps})
    for source, level in keys:
        idx = [i for i, s in enumerate(fit.steps) if (s.source, s.level) == (source, level)]
        logged = float(fit.seconds[idx].sum())
        fitted, before = float(fit.fitted[idx].sum()), float(fit.before[idx].sum())
        out.append(
            {
                "log": source,
                "level": level,
                "steps": len(idx),
                "logged_s": logged,
                "before_s": before,
                "fitted_s": fitted,
                "before_error": before / logged - 1 if logged > 0 else float("nan"),
                "fitted_error": fitted / logged - 1 if logged > 0 else float("nan"),
            }
        )
    return out


def replay_log(run: ServerRun) -> list[dict]:
    """The steps of a server replay's ``run`` as step-log lines (``serving.step_log``: ``t``, ``s``,
    ``requests``, ``waiting``, ``prefill``, ``cycles``, ``rows``, ``finished``; forward seconds 0)."""
    lines, now = [], 0.0
    finished_at: dict[int, float] = {r.rid: r.finished for r in run.requests if r.finished is not None}
    for (seconds, _, rows), plan in zip(run.steps, run.plans):
        now += seconds
        cycles = [
            [rid, rec.context_len, rec.depth, rec.num_drafted, rec.num_verified, rec.accepted, rec.emitted,
             bool(rec.lookup), rec.catch_up, 0.0]
            for rid, rec in plan.cycles
        ]  # fmt: skip
        ids = {rid for rid, _ in plan.cycles} | {rid for rid, _, _ in plan.prefill}
        lines.append(
            {
                "t": now,
                "s": seconds,
                "engine": 0,
                "requests": len(ids),
                "waiting": 0,
                "prefill": [list(chunk) for chunk in plan.prefill],
                "cycles": cycles,
                "rows": rows,
                "finished": sorted(rid for rid in ids if finished_at.get(rid) == now),
            }
        )
    return lines
