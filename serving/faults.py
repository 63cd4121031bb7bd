"""Fault injection for the server's tests (not a user feature): with the environment variable
``DRAFTPILOT_FAULTS`` set, ``serve.py`` runs a ``FaultyEngine`` that makes the requests whose prompt (decoded
to text) contains a marker fail in a chosen way, so a test can check, on a real server process, that such a
request ends alone with a 500 and the others are untouched. Unset (always, outside tests) nothing changes.

``DRAFTPILOT_FAULTS`` is a comma-separated list of ``kind=marker``:

* ``controller``: the request's controller raises ``RuntimeError`` in ``should_continue`` at its eighth call
  (a bug in a controller);
* ``alloc``: every append to the request's target KV cache after its prefill raises ``MemoryError`` (an
  allocation failure inside the shared batched forward);
* ``nan``: the request samples at temperature 1e-40 (set past ``SamplingConfig``'s rule that makes it
  greedy, as a sampler bug would), whose probabilities overflow to NaN;
* ``slow``: every step the request takes part in lasts ``SLOW_STEP_S`` longer (not a failure: a request whose
  duration does not depend on the machine's speed, for tests that act while it runs).

For example ``DRAFTPILOT_FAULTS="controller=@@ctl@@,alloc=@@oom@@,nan=@@nan@@"``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from engine.backends.pair import ModelPair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest
from engine.control import StaticController
from engine.errors import InputError
from engine.sampling import SamplingConfig

FAULTS_ENV = "DRAFTPILOT_FAULTS"
KINDS = ("controller", "alloc", "nan", "slow")
SLOW_STEP_S = 0.005
"""What a ``slow`` request adds to every step it takes part in."""


class FailingController(StaticController):
    """A static depth-3 chain controller whose ``should_continue`` raises at its eighth call (after two or three cycles)."""

    def __init__(self) -> None:
        super().__init__(3)
        self.calls = 0

    def should_continue(self, state) -> bool:
        self.calls += 1
        if self.calls >= 8:
            raise RuntimeError("injected fault: the controller failed")
        return super().should_continue(state)


def parse_faults(spec: str) -> dict[str, str]:
    """``kind=marker,...`` -> {marker: kind}; an ``InputError`` naming the bad part."""
    faults = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, sep, marker = part.partition("=")
        if not sep or kind not in KINDS or not marker:
            raise InputError(f"{FAULTS_ENV}: {part!r} is not KIND=MARKER with KIND one of {', '.join(KINDS)}")
        faults[marker] = kind
    return faults


def faulty_engine_factory(spec: str) -> Callable[[ModelPair, BatchConfig], BatchedEngine]:
    """An ``EngineWorker.engine_factory`` building ``FaultyEngine``s for ``spec`` (``DRAFTPILOT_FAULTS``)."""
    faults = parse_faults(spec)
    return lambda pair, config: FaultyEngine(pair, config, faults)


class FaultyEngine(BatchedEngine):
    """A ``BatchedEngine`` that injects the faults of the module docstring into the marked requests."""

    def __init__(self, pair: ModelPair, config: BatchConfig, faults: dict[str, str]):
        super().__init__(pair, config)
        self.faults = faults
        self._alloc: set[int] = set()
        self._slow: set[int] = set()

    def add(self, request: BatchRequest) -> int:
        prompt = request.prompt
        text = prompt if isinstance(prompt, str) else self.pair.tokenizer.decode(list(prompt))
        kinds = {kind for marker, kind in self.faults.items() if marker in text}
        if "controller" in kinds:
            request = dataclasses.replace(request, controller=FailingController())
        if "nan" in kinds:  # past SamplingConfig's rule that makes such temperatures greedy: a sampler bug
            sampling = SamplingConfig(temperature=1.0)
            object.__setattr__(sampling, "temperature", 1e-40)
            request = dataclasses.replace(request, sampling=sampling)
        rid = super().add(request)
        if "alloc" in kinds:
            self._alloc.add(rid)
        if "slow" in kinds:
            self._slow.add(rid)
        return rid

    def step(self):
        self._arm()
        events = super().step()
        self._forget()
        if any(event.rid in self._slow for event in events):
            time.sleep(SLOW_STEP_S)
        return events

    def cancel(self, rid: int) -> None:
        super().cancel(rid)
        self._forget()

    def _arm(self) -> None:
        """Make the target cache of each ``alloc`` request that is prefilled fail its next append: its
        prefill ran in an earlier step, its cycles start in this one."""
        for rid in sorted(self._alloc):
            state = self.state_of(rid)
            if state is not None:
                for layer in state.target_cache.layers:
                    layer.reserve = _fail_allocation

    def _forget(self) -> None:
        """Drop the requests that left the batch (finished, failed or cancelled)."""
        inside = set(self.requests)
        self._alloc &= inside
        self._slow &= inside


def _fail_allocation(*args, **kwargs):
    raise MemoryError("injected fault: the KV buffer could not be allocated")
