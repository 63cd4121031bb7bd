"""The step costs fitted to a step log (``envs.step_costs``, ``benchmarks/step_costs.py``): on a log whose steps a
server replay timed with known linear costs, the fit recovers those costs and its profile replays the same run
to the same tokens/s; a log whose seconds do not belong to its steps (shuffled) is not fitted (a negative
control); a log without drafting leaves the draft's table as it was. The log-to-replay path: the live batched
engine's step log, read back, gives every step the very requests, records, prompt lengths and draft lags the
replay of the same traces gives, and is charged what the replay charges its step."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from engine.batch_api import BatchConfig
from engine.control import StaticController
from engine.costs.cost_profile import CostProfile
from engine.inputs import EngineConfig
from envs.replay import ReplayTrace
from envs.server import ServerReplay
from envs.server_runs import Arrivals
from envs.step_costs import StepCharger, fit_steps, linear_table, logged_steps, replay_log, step_charge
from tests_envs_helpers import LATE_STARTS, make_synthetic_trace, three_late_starters
from tests_helpers import batched_profile, late_starter

TRUE = {"step": 0.002, "target": (0.025, 0.0, 0.004), "draft": (0.008, 0.001, 0.003)}


def _truth(profile: CostProfile) -> CostProfile:
    """``profile`` with a linear batch axis of the known costs."""
    return replace(profile, batched=linear_table(512, TRUE["target"], TRUE["draft"]))


def _runs(sim: ServerReplay):
    """A mix of loads and kinds of cycles: autoregressive and static chains, at 1, 2 and 4 clients."""
    out = []
    for n, make in (
        (1, lambda: StaticController(2, 2)),
        (2, lambda: None),
        (4, lambda: StaticController(3, 2)),
    ):
        out.append(sim.run(Arrivals.closed(n, 2 * n + 2), make))
    out.append(sim.run(Arrivals.closed(3, 6), lambda: StaticController(1, 1)))
    return out


@pytest.fixture
def traces():
    return [ReplayTrace(make_synthetic_trace(seed, length=40, width=1, max_depth=4)) for seed in range(4)]


def _steps(runs, **kw):
    return [s for i, run in enumerate(runs) for s in logged_steps(replay_log(run), source=f"run{i}", **kw)]


def test_the_fit_recovers_known_costs_and_replays_the_run_they_timed(traces):
    truth = _truth(batched_profile())
    config = BatchConfig(max_requests=3, engine=EngineConfig(draft_catch_up_tokens=6))
    sim = ServerReplay(traces, truth, config=config, step_overhead_s=TRUE["step"])
    runs = _runs(sim)
    # fitted from a profile whose batch axis and prefill are wrong
    wrong = batched_profile(row_s=0.02, draft_row_s=0.0)
    wrong = replace(wrong, prefill_target_s=[t / 2 for t in wrong.prefill_target_s])
    fit = fit_steps(_steps(runs), wrong, step_overhead_s=0.0)
    terms = fit.terms
    # one target forward a step: its 25 ms a forward is the step's, with the step overhead
    assert terms["step_s"] == pytest.approx(TRUE["step"] + TRUE["target"][0], abs=1e-6)
    assert terms["target_per_sequence_s"] == pytest.approx(0.0, abs=1e-6)
    assert terms["target_per_row_s"] == pytest.approx(TRUE["target"][2], abs=1e-6)
    assert terms["draft_per_forward_s"] == pytest.approx(TRUE["draft"][0], abs=1e-6)
    assert terms["draft_per_sequence_s"] == pytest.approx(TRUE["draft"][1], abs=1e-6)
    assert terms["draft_per_row_s"] == pytest.approx(TRUE["draft"][2], abs=1e-6)
    assert terms["prefill_scale"] == pytest.approx(2.0, rel=1e-6)
    assert np.allclose(fit.fitted, fit.seconds, rtol=1e-6)
    assert all(abs(e["fitted_error"]) < 1e-6 for e in fit.levels)
    assert any(abs(e["before_error"]) > 0.05 for e in fit.levels)  # the wrong profile was wrong
    # the fitted profile, written and read back, replays each run to its tokens/s, with its own step overhead
    profile = fit.profile
    assert profile.batched["step_overhead_s"] == pytest.approx(terms["step_s"])
    again = ServerReplay(traces, CostProfile(**json.loads(json.dumps(profile.to_dict()))), config=config, step_overhead_s=None)  # fmt: skip
    for run, replayed in zip(runs, _runs(again)):
        assert replayed.tokens == run.tokens
        assert replayed.tokens_per_s == pytest.approx(run.tokens_per_s, rel=1e-6)


def test_a_log_whose_seconds_are_not_its_steps_is_not_fitted(traces):
    """The negative control: the same steps with their seconds shuffled among them: no set of terms charges
    them (the fitted charges miss the steps by far), and the terms are not the costs the steps ran with."""
    truth = _truth(batched_profile())
    sim = ServerReplay(traces, truth, config=BatchConfig(max_requests=3), step_overhead_s=TRUE["step"])
    steps = _steps(_runs(sim))
    rng = np.random.default_rng(0)
    for step, seconds in zip(steps, rng.permutation([s.seconds for s in steps])):
        step.seconds = float(seconds)
    fit = fit_steps(steps, truth, step_overhead_s=TRUE["step"])
    miss = np.abs(fit.fitted - fit.seconds) / fit.seconds
    assert np.median(miss) > 0.1
    assert fit.terms["target_per_row_s"] != pytest.approx(TRUE["target"][2], rel=0.1)
    # before the fit, the true profile misses the shuffled seconds as much
    assert np.median(np.abs(fit.before - fit.seconds) / fit.seconds) > 0.1


def test_a_log_without_drafting_keeps_the_draft_table(traces):
    truth = _truth(batched_profile())
    sim = ServerReplay(traces, truth, config=BatchConfig(max_requests=3), step_overhead_s=TRUE["step"])
    run = sim.run(Arrivals.closed(3, 8), lambda: None)
    base = batched_profile()
    fit = fit_steps(logged_steps(replay_log(run), levels=[(3, 8)]), base)
    assert not any(name.startswith("draft_") for name in fit.fitted_terms)
    assert fit.profile.batched["draft"] == base.batched["draft"]
    assert fit.terms["target_per_row_s"] + fit.terms["target_per_sequence_s"] == pytest.approx(
        0.004, rel=1e-6
    )
    assert [e["level"] for e in fit.levels] == [3]


def test_a_live_step_log_is_charged_as_the_replay_charges_its_steps(tiny_pair, tmp_path):
    """The live batched engine's steps (three requests, deterministic controllers: catch-up cycles under load,
    then chains; a row cap that cuts verifications), logged as the server logs them and read back: each step
    holds the requests, records, prompt lengths and draft lags of the replay's step of the same traces, and a
    profile charges it exactly what the replay charged."""
    from engine.batch import BatchedEngine
    from engine.batch_api import BatchRequest
    from serving.step_log import StepLog, read_step_log

    new = 16
    ids, rts, config = three_late_starters(tiny_pair, new)
    skips = LATE_STARTS
    batch = BatchedEngine(tiny_pair, config)
    for i, s in zip(ids, skips):
        batch.add(BatchRequest(i, new, late_starter(s, depth=3)))
    log = StepLog(tmp_path / "steps.jsonl")
    while batch.active or batch.pending:
        events = batch.step()
        log.record(batch, 0.01, events)
    log.close()
    live = logged_steps(read_step_log(tmp_path / "steps.jsonl"))
    controllers = iter([late_starter(s, depth=3) for s in skips])
    profile = batched_profile()
    sim = ServerReplay(rts, profile, config=config, chunked=batch.chunked, step_overhead_s=0.003)
    run = sim.run(Arrivals.closed(3, 3), lambda: next(controllers), order=[0, 1, 2])
    replayed = logged_steps(replay_log(run))

    def key(step):
        return step.prefill, [
            (r.rid[1], r.prompt_len, r.lag.prompt_left, r.lag.pending, r.record.depth, r.record.num_verified,
             r.record.emitted, r.record.catch_up, r.record.lookup)
            for r in step.running
        ]  # fmt: skip

    assert [key(s) for s in live] == [key(s) for s in replayed]
    assert any(r.record.catch_up for s in live for r in s.running)
    assert any(r.lag.pending > 1 for s in live for r in s.running if r.record.depth)  # chains left tokens
    charger = StepCharger(profile, profile, 1, 0.003)
    charged = [step_charge(s, charger) for s in live]
    assert charged == pytest.approx([s[0] for s in run.steps], rel=1e-9)
