"""Fault isolation in the batched engine (``engine.batch``, module docstring "Fault isolation"): one request's
failure (a bug in its controller, an allocation failure in its prefill or in a shared forward, non-finite
probabilities, a failure building its result) ends that request alone; the others decode exactly the tokens
they decode alone, and the engine goes on admitting requests. A shared forward that fails for everyone, alone
too, raises ``EngineFailed``."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.backends.models import load_pair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest, EngineFailed, RequestFailed
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.errors import DraftpilotError
from engine.sampling import NonFiniteLogitsError, SamplingConfig

pytestmark = pytest.mark.usefixtures("single_thread")

KQUANT = bool(shutil.which("c++"))
N = 14
OTHERS = [  # (prompt, controller) of the requests that must not notice the fault
    ("def main():", lambda: None),
    ("x", lambda: StaticController(1)),
    ("import numpy as np\n", lambda: StaticController(2, 4, 2)),
]
CULPRIT = "The quick brown fox"


@pytest.fixture(scope="module", params=["float32"] + (["kquant"] if KQUANT else []))
def pair(request):
    return load_pair("tiny", weights=request.param, device="cpu")


@pytest.fixture(scope="module")
def alone(pair):
    return [SpeculativeEngine(pair).generate(p, N, c()).tokens for p, c in OTHERS]


class Bomb(StaticController):
    """A controller with a bug: ``should_continue`` raises after ``after`` calls."""

    def __init__(self, after: int):
        super().__init__(3)
        self.after, self.calls = after, 0

    def should_continue(self, state):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("controller bug\nsecond line")
        return super().should_continue(state)


def _run(pair, culprit: BatchRequest, arm=None, record=None):
    """The three OTHERS and ``culprit`` decoded together (the culprit added second); ``arm(batch, rid)``
    runs after the step that prefilled the culprit. {rid: tokens or the exception}, rids in order."""
    batch = BatchedEngine(pair, BatchConfig(max_requests=4, max_rows=64))
    if record is not None:  # every logits tensor handed to each request's cycle, in order
        advance = batch._advance

        def recording(slot, answer):
            if isinstance(answer, torch.Tensor):
                record.setdefault(slot.rid, []).append(answer.clone())
            advance(slot, answer)

        batch._advance = recording
    requests = [BatchRequest(p, N, c()) for p, c in OTHERS]
    rids = [batch.add(requests[0]), batch.add(culprit)] + [batch.add(r) for r in requests[1:]]
    out, armed = {}, arm is None
    while batch.active or batch.pending:
        events = batch.step()
        if not armed and rids[1] in batch.active:
            arm(batch, rids[1])
            armed = True
        for ev in events:
            if ev.finished:
                try:
                    out[ev.rid] = batch.result(ev.rid).tokens
                except DraftpilotError as err:
                    assert ev.finish_reason == "error"
                    out[ev.rid] = err
    return batch, rids, out


def _arm_forward_alloc(batch, rid):
    """From now on, every append to the culprit's target cache fails to allocate."""

    def boom(*args, **kwargs):
        raise MemoryError("injected: cannot allocate the KV buffer")

    for layer in batch._slots[rid].req.target_cache.layers:
        layer.reserve = boom


def _arm_result(batch, rid):
    real = batch.engine.request_result
    culprit = batch._slots[rid].req

    def result(req, *args):
        if req is culprit:
            raise KeyError("injected: the result could not be built")
        return real(req, *args)

    batch.engine.request_result = result


def _overflowing() -> SamplingConfig:
    """A sampler at temperature 1e-40, set past ``SamplingConfig``'s rule that makes such temperatures greedy
    (as a sampler bug would): its probabilities overflow to NaN."""
    sampling = SamplingConfig(temperature=1.0)
    object.__setattr__(sampling, "temperature", 1e-40)
    return sampling


FAULTS = {
    # name: (the culprit's request, arm, the error result raises, its cause)
    "controller": (lambda: BatchRequest(CULPRIT, N, Bomb(after=3)), None, RequestFailed, RuntimeError),
    "forward-alloc": (lambda: BatchRequest(CULPRIT, N, StaticController(3)), _arm_forward_alloc, RequestFailed, MemoryError),
    "non-finite": (
        lambda: BatchRequest(CULPRIT, N, StaticController(2), sampling=_overflowing()),
        None,
        NonFiniteLogitsError,
        None,
    ),
    "result": (lambda: BatchRequest(CULPRIT, N, StaticController(2)), _arm_result, RequestFailed, KeyError),
}  # fmt: skip


@pytest.mark.parametrize("fault", list(FAULTS))
def test_one_failing_request_ends_alone_and_the_others_are_exact(pair, alone, fault):
    make, arm, error, cause = FAULTS[fault]
    batch, rids, out = _run(pair, make(), arm)
    failed = out[rids[1]]
    assert isinstance(failed, error), failed  # the fault did fire (negative control of the injection)
    assert "\n" not in str(failed)
    if cause is not None:
        assert isinstance(failed.__cause__, cause) and type(failed.__cause__).__name__ in str(failed)
    others = [out[r] for r in rids[:1] + rids[2:]]
    assert others == alone
    assert batch.kv_reserved == 0 and batch.kv_allocated() == 0  # every slot freed, the culprit's included
    # the engine keeps serving
    again = batch.add(BatchRequest(OTHERS[2][0], N, OTHERS[2][1]()))
    while batch.active or batch.pending:
        batch.step()
    assert batch.result(again).tokens == alone[2]


def test_an_allocation_failure_at_prefill_ends_that_request_alone(pair, alone, monkeypatch):
    batch = BatchedEngine(pair, BatchConfig(max_requests=4))
    real = batch.engine.prefilled_request

    def prefill(prompt_ids, *args, **kwargs):
        if prompt_ids == batch.engine._prompt_ids(CULPRIT):
            raise RuntimeError("alloc")
        return real(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(batch.engine, "prefilled_request", prefill)
    rids = [batch.add(BatchRequest(p, N, c())) for p, c in OTHERS[:1]]
    rids.insert(1, batch.add(BatchRequest(CULPRIT, N, StaticController(3))))
    rids += [batch.add(BatchRequest(p, N, c())) for p, c in OTHERS[1:]]
    reasons = []
    while batch.active or batch.pending:
        reasons += [ev.finish_reason for ev in batch.step() if ev.rid == rids[1]]
    assert reasons == ["error"]  # its one event: the step its prefill ended in
    with pytest.raises(RequestFailed, match="RuntimeError: alloc"):
        batch.result(rids[1])
    assert [batch.result(r).tokens for r in rids[:1] + rids[2:]] == alone


def test_the_others_get_the_logits_the_shared_forward_would_have_given(pair):
    """A shared forward fails because of one request's rows: the others are retried alone, and every logits
    tensor each of them receives equals the one of a clean run where the culprit decodes normally (bitwise
    on the native decoder, batch invariant; to rounding on float32 products: engine.batch_forward)."""
    clean, faulty = {}, {}
    _, rids, out = _run(pair, BatchRequest(CULPRIT, N, StaticController(3)), None, clean)
    _, rids_f, out_f = _run(pair, BatchRequest(CULPRIT, N, StaticController(3)), _arm_forward_alloc, faulty)
    assert (
        rids == rids_f
        and isinstance(out_f[rids[1]], RequestFailed)
        and not isinstance(out[rids[1]], Exception)
    )
    assert len(faulty[rids[1]]) < len(clean[rids[1]])  # the culprit stopped receiving logits
    native = pair.precision.startswith("kquant")
    for rid in rids[:1] + rids[2:]:
        assert len(clean[rid]) == len(faulty[rid])
        for a, b in zip(clean[rid], faulty[rid]):
            if native:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_shared_forward_failing_for_everyone_raises_engine_failed(pair, monkeypatch):
    import engine.batch as batch_module

    real, broken = batch_module.forward_rows, {"on": False}

    def forward_rows(model, items, device):
        if broken["on"] and model is pair.target:
            raise RuntimeError("the device is gone")
        return real(model, items, device)

    monkeypatch.setattr(batch_module, "forward_rows", forward_rows)
    batch = BatchedEngine(pair, BatchConfig(max_requests=2))
    rids = [batch.add(BatchRequest(p, N)) for p, _ in OTHERS[:2]]
    batch.step()
    broken["on"] = True
    with pytest.raises(EngineFailed, match="shared by 2 requests.*RuntimeError: the device is gone"):
        batch.step()
    for rid in rids:
        with pytest.raises(RequestFailed):
            batch.result(rid)
