"""``serve.py --step-log FILE``: every batched step the server runs, one JSON line each, as the engine planned
it (``BatchedEngine.last_step``, an ``engine.scheduling.StepPlan``) and as long as it took, so the batch cost
model and the server replay can be fitted or checked against real steps under real load.

A line: ``t`` (seconds since the log opened, at the step's end), ``s`` (the step's seconds: ``BatchedEngine.step``
on the engine thread), ``requests`` (in the batch during the step: those still in it and those that ended in it), ``waiting`` (in the server's line, outside the batch),
``prefill`` ([request, prompt tokens, the position the chunk starts at] of each prefill chunk), ``cycles``
([request, context, depth, drafted, verified, accepted, emitted, lookup, catch-up, forward seconds] of each
request that ran a cycle: ``engine.scheduling.CYCLE_FIELDS`` after the request), ``rows`` (the target rows of the step's cycles: each cycle's root plus the nodes it
verified) and ``finished`` (requests that ended in the step). Request numbers are the engine's, in admission
order (a rebuilt engine, after a failed step, numbers from 0 again: ``engine`` counts the rebuilds).

Writing a line costs a few microseconds on the engine thread; the file is line-buffered, so a reader sees
every finished step."""

from __future__ import annotations

import json
import time
from pathlib import Path


class StepLog:
    """Appends a line per step to ``path`` (created, or truncated); ``close`` when the server stops."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = open(self.path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - open until close()
        self.start = time.perf_counter()
        self.engines: set[int] = set()

    def record(self, engine, seconds: float, events: list) -> None:
        """One step of ``engine`` (a ``BatchedEngine`` just stepped), ``seconds`` long, its ``events``."""
        plan = engine.last_step
        if plan is None:
            return
        self.engines.add(id(engine))
        cycles = [
            [
                rid,
                rec.context_len,
                rec.depth,
                rec.num_drafted,
                rec.num_verified,
                rec.accepted,
                rec.emitted,
                bool(rec.lookup),
                rec.catch_up,
                round(rec.forward_s, 6),
            ]
            for rid, rec in plan.cycles
        ]
        line = {
            "t": round(time.perf_counter() - self.start, 6),
            "s": round(seconds, 6),
            "engine": len(self.engines) - 1,
            "requests": len(set(engine.requests) | {event.rid for event in events if event.finished}),
            "waiting": engine.waiting_outside,
            "prefill": [list(chunk) for chunk in plan.prefill],
            "cycles": cycles,
            "rows": sum(1 + rec.num_verified for _, rec in plan.cycles),
            "finished": [event.rid for event in events if event.finished],
        }
        self.file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()


def read_step_log(path: str | Path) -> list[dict]:
    """The lines of a step log (a last line cut short by a crash is left out)."""
    lines = []
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines
