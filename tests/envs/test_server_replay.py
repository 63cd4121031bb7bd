"""The server replay (envs.server): the batched engine's steps over recorded requests, exact trajectories,
step times from the batch axis split among the requests, arrivals, the row cap; its training backend; the
per-load table controller and the export files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.batch_api import BatchConfig
from engine.control import StaticController
from engine.costs.profile_io import ProfileError
from engine.errors import InputError
from engine.inputs import EngineConfig
from engine.scheduling import plan_prefills, prefill_budget
from envs.environments import DepthEnv, EnvConfig
from envs.replay import ReplayTrace, replay_generate
from envs.server import ServerReplay, ServerReplayBackend, tune_table
from envs.server_runs import Arrivals
from policies.analytic import AnalyticController
from policies.goodput import GoodputController
from policies.static import BatchSizeTableController, read_batch_size_table
from tests_envs_helpers import LATE_STARTS, make_synthetic_trace, recorded_chains, three_late_starters
from tests_helpers import batched_profile, late_starter, lookup_chooser
from training.export import check_sglang_adaptive_config, sglang_adaptive_config, write_exports
from training.load_training import load_baselines


@pytest.fixture
def traces():
    return [ReplayTrace(make_synthetic_trace(seed, length=40, width=1, max_depth=4)) for seed in range(4)]


def _key(rec):
    return (rec.depth, rec.num_verified, rec.accepted, rec.emitted, rec.lookup)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: StaticController(2, 2),
        lambda p: AnalyticController(p, 1, 4),
        lambda p: GoodputController(p, 4),
    ],
)
def test_alone_every_cycle_is_the_single_request_replay(traces, make):
    profile = batched_profile()
    sim = ServerReplay(traces, profile)
    run = sim.run(Arrivals.closed(1, len(traces)), lambda: make(profile))
    assert [r.trace for r in run.requests] == traces
    for req in run.requests:
        alone = replay_generate(req.trace, make(profile), profile)
        assert [_key(r) for r in req.records] == [_key(r) for r in alone]
        assert len(req.token_times) == len(req.trace.trace.tokens)  # every token, the first one included
    assert max(s[1] for s in run.steps) == 1


def test_under_load_trajectories_are_exact_and_the_charges_add_up_to_the_steps(traces):
    profile = batched_profile()
    sim = ServerReplay(traces, profile, config=BatchConfig(max_requests=3))
    run = sim.run(Arrivals.closed(4, 8), lambda: StaticController(2, 2))
    assert len(run.requests) == 8 and max(s[1] for s in run.steps) == 3  # one client waits
    assert run.tokens == sum(len(r.trace.trace.tokens) for r in run.requests)
    charged = sum(rec.total_s for r in run.requests for rec in r.records)
    assert charged == pytest.approx(sum(s[0] for s in run.steps), rel=1e-9)
    assert run.end > run.start and run.tokens_per_s > 0
    slower = ServerReplay(traces, profile, config=BatchConfig(max_requests=3), step_overhead_s=0.01)
    again = slower.run(Arrivals.closed(4, 8), lambda: StaticController(2, 2))
    assert [_key(r) for q in again.requests for r in q.records] == [
        _key(r) for q in run.requests for r in q.records
    ]
    decoding = [a[0] - b[0] for a, b in zip(again.steps, run.steps) if b[1] > 0]
    assert decoding and np.allclose(decoding, 0.01)  # the server's own work, once a step
    assert sum(rec.total_s for q in again.requests for rec in q.records) == pytest.approx(
        sum(s[0] for s in again.steps)
    )
    summary = run.summary()
    assert summary["mean_depth"] == pytest.approx(2.0, abs=0.3) and summary["itl_p99_ms"] > 0


def test_goodput_drafts_less_under_load_and_replays_exactly(traces):
    """The goodput controller in the server replay: every request's trajectory is its trace's, and it drafts
    shorter chains (on average) at 4 clients than alone; it is a per-load baseline on chain traces only."""
    profile = batched_profile()
    sim = ServerReplay(traces, profile, config=BatchConfig(max_requests=4))
    depth = {}
    for n in (1, 4):
        run = sim.run(Arrivals.closed(n, 8), lambda: GoodputController(profile, 4))
        assert run.tokens == sum(len(r.trace.trace.tokens) for r in run.requests)
        depth[n] = run.summary()["mean_depth"]
    assert depth[4] < depth[1] and depth[1] > 0
    setup = type("Setup", (), {"table": {1: (2, 0.0)}, "concurrencies": (1,)})()
    setup.table_controller = lambda: BatchSizeTableController({1: 2})
    assert "goodput given the load" in load_baselines(setup, profile, 1, 4)
    assert "goodput given the load" not in load_baselines(setup, profile, 2, 4)


def test_extra_rows_cost_more_under_load_so_drafting_pays_less(traces):
    """Where every row of a forward costs as much as a whole step (no weight sharing), drafting loses under
    load; the same drafting alone still pays: the replay sees the load."""
    profile = batched_profile(row_s=0.03)
    sim = ServerReplay(traces, profile)
    ratio = {}
    for n in (1, 4):
        arrivals = Arrivals.closed(n, 2 * n)
        ratio[n] = (
            sim.run(arrivals, lambda: StaticController(3, 3)).tokens_per_s
            / sim.run(arrivals, lambda: None).tokens_per_s
        )
    assert ratio[4] < ratio[1]
    table = tune_table(sim, (1, 4), depths=(0, 1, 3))
    assert table[4][0] <= table[1][0]


def test_the_row_cap_cuts_verifications_not_tokens(traces):
    sim = ServerReplay(traces, batched_profile(), config=BatchConfig(max_requests=2, max_rows=2))
    run = sim.run(Arrivals.closed(2, 4), lambda: StaticController(3, 3))
    two_at_once = [rec for r in run.requests for rec in r.records if rec.depth > 0]
    assert two_at_once and min(rec.num_verified for rec in two_at_once) == 0  # no row left for nodes
    assert run.tokens == sum(len(r.trace.trace.tokens) for r in run.requests)
    with pytest.raises(InputError, match="max_rows"):
        ServerReplay(traces, batched_profile(), config=BatchConfig(max_requests=4, max_rows=2))


def test_poisson_arrivals_follow_their_rate_schedule():
    arrivals = Arrivals.poisson([(0, 1.0), (100, 10.0)], requests=400, seed=3)
    times = np.asarray(arrivals.poisson_times())
    assert len(times) == 400 and np.all(np.diff(times) > 0)
    assert 70 < np.sum(times < 100) < 130  # about 100 in the first 100 s at 1/s
    late = times[times >= 100]
    assert 7 < len(late) / (late[-1] - 100) < 13  # then about 10/s
    with pytest.raises(InputError):
        Arrivals(concurrency=2, rates=((0, 1.0),))
    with pytest.raises(InputError):
        Arrivals.poisson([(5, 1.0)], 3)


def test_a_poisson_run_queues_past_the_batch(traces):
    sim = ServerReplay(traces, batched_profile(), config=BatchConfig(max_requests=2))
    run = sim.run(Arrivals.poisson([(0, 50.0)], 6, seed=0), lambda: None)
    assert len(run.requests) == 6 and max(s[1] for s in run.steps) == 2
    assert max(run.ttft()) > min(run.ttft())  # the later ones waited


def test_the_server_replay_needs_a_batch_axis(traces):
    from engine.costs.cost_profile import CostProfile

    plain = CostProfile(**{**batched_profile().to_dict(), "batched": {}})
    with pytest.raises(ProfileError, match="batch axis"):
        ServerReplay(traces, plain)


def test_training_episodes_decode_among_other_requests(traces):
    profile = batched_profile(row_s=0.03)
    backend = ServerReplayBackend(
        traces, profile, lambda n: lambda: StaticController(1, 1), concurrencies=(1, 4)
    )
    assert backend.scale[1] == pytest.approx(1.0) and backend.scale[4] > 1.0
    env = DepthEnv(backend, StaticController(2, 2), EnvConfig(rho=20.0, depth_zero=True))
    loads, rewards = set(), []
    for seed in range(6):
        env.reset(seed=seed)
        done = False
        while not done:
            state = env.decision_state
            loads.add(state.load.requests if state.load is not None else 1)
            _, reward, done, _, info = env.step(1)
            rewards.append(reward)
        assert info["episode_tokens"] == len(traces[env.episode_index].trace.tokens) - 1
    assert loads >= {1, 4} and np.all(np.isfinite(rewards))


def test_the_batch_size_table_controller_reads_the_load():
    from engine.control import DraftState
    from engine.load import LoadState

    ctrl = BatchSizeTableController({1: 3, 4: 1, 8: 0})
    assert [ctrl.depth_for(n) for n in (1, 3, 4, 7, 8, 16)] == [3, 3, 1, 1, 0, 0]
    alone = DraftState.before_drafting(100, 8, [])
    busy = DraftState.before_drafting(100, 8, [], load=LoadState(requests=9))
    assert ctrl.should_continue(alone) and not ctrl.should_continue(busy)
    for bad in ({}, {2: 1}, {1: -1}, {0: 1}):
        with pytest.raises(InputError):
            BatchSizeTableController(bad)


def test_exports_have_the_formats_vllm_and_sglang_read(tmp_path):
    table = {(1, 1): 3, (2, 3): 1, (4, 256): 0}
    written = write_exports(table, tmp_path)
    # a range without drafting carries 1 in vLLM's file (its 0 still runs the draft model), as in SGLang's
    assert read_batch_size_table(written["vllm"]) == [[1, 1, 3], [2, 3, 1], [4, 256, 1]]
    config = json.loads((tmp_path / "sglang_adaptive_config.json").read_text())
    assert config == {
        "1": {"candidate_steps": [3]},
        "2": {"candidate_steps": [1]},
        "4": {"candidate_steps": [1]},
    }
    check_sglang_adaptive_config(config)
    assert sglang_adaptive_config({(1, 8): 2}) == {"1": {"candidate_steps": [2]}}
    for bad in (
        {},
        {"2": {"candidate_steps": [1]}},
        {"1": {"candidate_steps": [0]}},
        {"1": {"candidate_steps": [3, 1]}},
        {"1": {"steps": [1]}},
        {"1": {}, "x": {}},
    ):
        with pytest.raises(ValueError):
            check_sglang_adaptive_config(bad)
    none = write_exports({(1, 256): 0}, tmp_path / "none")
    assert none["vllm"].startswith("not written") and "tuned table" not in none


def test_the_tuned_per_load_table_is_exported_in_vllms_format(tmp_path):
    """The per-load baseline's table (``tuned``) in vLLM's format, read back as written; not written where it
    drafts at no level (vLLM refuses an all-zero table)."""
    written = write_exports({(1, 256): 0}, tmp_path, tuned={(1, 1): 2, (2, 256): 1})
    assert written["tuned table"] == str(tmp_path / "tuned_batch_size_table.json")
    assert read_batch_size_table(written["tuned table"]) == [[1, 1, 2], [2, 256, 1]]
    assert write_exports({(1, 256): 1}, tmp_path / "none", tuned={(1, 256): 0})["tuned table"].startswith(
        "not written"
    )
    assert not (tmp_path / "none" / "tuned_batch_size_table.json").exists()


def test_a_request_its_first_token_ends_costs_its_prefill_only():
    short = [
        ReplayTrace(make_synthetic_trace(s, length=1, width=1, max_depth=2, max_new_tokens=1))
        for s in range(2)
    ]
    run = ServerReplay(short, batched_profile()).run(Arrivals.closed(2, 2), lambda: StaticController(1, 1))
    assert run.tokens == 2 and all(r.records == [] for r in run.requests)
    assert sum(s[0] for s in run.steps) == pytest.approx(
        2 * batched_profile().prefill_s(10, with_draft=False)
    )


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode():
    """As the engine schedules it (``engine.scheduling.plan_prefills``) with a fixed budget (``idle_prefill_tokens`` =
    ``max_prefill_tokens``): a 150-token prompt admitted behind a short one is prefilled a chunk a step while the
    short one decodes, in ceil(tokens left / budget) steps; whole-prompt
    prefill (``chunked=False``) waits for the next step and takes it whole."""
    import dataclasses

    short = make_synthetic_trace(0, length=60, width=1, max_depth=4)
    long = dataclasses.replace(make_synthetic_trace(1, length=10, width=1, max_depth=4), prompt_len=150)
    assert short.prompt_len + 150 > 64
    for chunked, budget in ((True, 32), (True, 64), (False, 32)):
        sim = ServerReplay([ReplayTrace(short), ReplayTrace(long)], batched_profile(), config=BatchConfig(max_prefill_tokens=budget, idle_prefill_tokens=budget), chunked=chunked)  # fmt: skip
        run = sim.run(Arrivals.closed(2, 2), lambda: StaticController(1, 1))
        first, second = run.requests
        decoded = sorted({t for t in first.token_times if first.first_token < t <= second.first_token})
        first_chunk = min(budget - short.prompt_len, 150) if chunked else 0
        assert len(decoded) == (-(-(150 - first_chunk) // budget) if chunked else 1), (chunked, budget)
    assert plan_prefills([150, 10], 32, True) == [32] and plan_prefills([20, 10, 5], 32, True) == [20, 10, 2]
    assert plan_prefills([150, 10], 32, False) == [150] and plan_prefills([20, 10, 5], 32, False) == [20, 10]
    assert plan_prefills([200], 500, True) == [65]


def _cycle_key(rec):
    return (rec.depth, rec.num_verified, rec.accepted, rec.emitted, rec.lookup, rec.catch_up)


@pytest.mark.parametrize("bound", [6, 16])
def test_the_replay_makes_the_live_batchs_catch_up_cycles(tiny_pair, bound):
    """Two requests decoded together by the live batched engine, each controller holding back (depth 0) for
    a while and then drafting: under load the draft catches up ``draft_catch_up_tokens`` a cycle (catch-up
    cycles, ``CycleRecord.catch_up``), and the server replay of their traces makes the very same cycles, the
    catch-up ones included; alone (one client) neither makes any."""
    from engine.batch import BatchedEngine
    from engine.batch_api import BatchConfig, BatchRequest
    from engine.inputs import EngineConfig

    max_depth, new = 4, 40
    prompts = ["def main():\n    return", "The quick brown fox jumps over"]
    ids, rts = recorded_chains(tiny_pair, prompts, max_depth, new)
    skips = (3, 12)
    config = EngineConfig(max_depth=max_depth, draft_catch_up_tokens=bound)
    batch = BatchedEngine(tiny_pair, BatchConfig(max_requests=2, max_rows=64, engine=config))
    rids = [batch.add(BatchRequest(i, new, late_starter(s, depth=2))) for i, s in zip(ids, skips)]
    live = {}
    while batch.active or batch.pending:
        for ev in batch.step():
            if ev.finished:
                live[ev.rid] = batch.result(ev.rid)
    for rid, rt in zip(rids, rts):
        assert live[rid].tokens == rt.trace.tokens.tolist()
    controllers = iter([late_starter(s, depth=2) for s in skips])
    sim = ServerReplay(rts, batched_profile(), config=BatchConfig(max_requests=2, engine=EngineConfig(draft_catch_up_tokens=bound)), chunked=batch.chunked)  # fmt: skip
    run = sim.run(Arrivals.closed(2, 2), lambda: next(controllers), order=[0, 1])
    for rid, req in zip(rids, run.requests):
        assert [_cycle_key(r) for r in req.records] == [_cycle_key(r) for r in live[rid].cycles], rid
    catch_ups = [rec for req in run.requests for rec in req.records if rec.catch_up]
    assert catch_ups and all(rec.catch_up == bound and rec.depth == 0 for rec in catch_ups)
    assert all(rec.draft_s > 0 for rec in catch_ups)  # charged: the chunk's rows of the step's draft forward
    charged = sum(rec.total_s for r in run.requests for rec in r.records)
    assert charged == pytest.approx(sum(s[0] for s in run.steps), rel=1e-9)
    for rt, skip in zip(rts, skips):  # alone: no catch-up cycle, the single-request replay's cycles
        alone = ServerReplay(
            [rt], batched_profile(), config=BatchConfig(engine=EngineConfig(draft_catch_up_tokens=bound))
        )
        solo = (
            alone.run(Arrivals.closed(1, 1), lambda skip=skip: late_starter(skip, depth=2))
            .requests[0]
            .records
        )
        assert not any(rec.catch_up for rec in solo)
        assert [_cycle_key(r) for r in solo] == [
            _cycle_key(r) for r in replay_generate(rt, late_starter(skip, depth=2))
        ]


def _step_key(plan):
    """A step's plan (``engine.scheduling.StepPlan``): its prefill chunks and each cycle's shape."""
    cycles = [(rid, rec.context_len, *_cycle_key(rec)) for rid, rec in plan.cycles]
    return list(plan.prefill), cycles


def test_the_live_batch_and_its_replay_plan_the_same_steps(tiny_pair):
    """Three requests decoded together by the live batched engine under a row cap that cuts verifications,
    each controller deterministic (holding back for a while, then a static chain: catch-up cycles under
    load), and the server replay of their traces with the same ``BatchConfig`` and the same controllers: step
    by step, the same prefill chunks, the same requests running a cycle, each with the same kind, depth,
    verified rows (granted under the cap), accepted and emitted tokens."""
    from engine.batch import BatchedEngine
    from engine.batch_api import BatchRequest

    new = 32
    ids, rts, config = three_late_starters(tiny_pair, new)
    skips = LATE_STARTS
    batch = BatchedEngine(tiny_pair, config)
    rids = [batch.add(BatchRequest(i, new, late_starter(s, depth=3))) for i, s in zip(ids, skips)]
    assert rids == [0, 1, 2]
    live_steps, live = [], {}
    while batch.active or batch.pending:
        for ev in batch.step():
            if ev.finished:
                live[ev.rid] = batch.result(ev.rid)
        live_steps.append(_step_key(batch.last_step))
    for rid, rt in zip(rids, rts):
        assert live[rid].tokens == rt.trace.tokens.tolist()
    controllers = iter([late_starter(s, depth=3) for s in skips])
    sim = ServerReplay(rts, batched_profile(), config=config, chunked=batch.chunked)
    run = sim.run(Arrivals.closed(3, 3), lambda: next(controllers), order=[0, 1, 2])
    assert [r.rid for r in run.requests] == rids
    replayed = [_step_key(plan) for plan in run.plans]
    assert len(replayed) == len(run.steps)
    assert replayed == live_steps
    assert any(cycles for _, cycles in live_steps)  # cycles ran, the cap cut some and catch-ups happened
    verified = [rec for plan in run.plans for _, rec in plan.cycles if rec.depth]
    assert any(rec.num_verified < rec.depth for rec in verified)
    assert any(rec.catch_up for plan in run.plans for _, rec in plan.cycles)


def test_a_controller_that_decides_lookup_is_asked_at_every_load_live_and_replayed(tiny_pair):
    """Three requests under a lookup whose load limit is one request, each controller deciding lookup itself
    (``decides_lookup``: it takes every other proposal): live and replayed, the same steps; its proposals are
    asked about under load too (the limit is the rule of controllers that do not decide), lookup cycles run
    in steps shared with other requests, declined proposals go on to the controller's own cycle; every
    request's tokens are its tokens alone. The control: the same controllers not deciding lookup run no
    lookup cycle under load."""
    from engine.batch import BatchedEngine
    from engine.batch_api import BatchRequest
    from engine.lookup import LookupConfig

    max_depth, new = 3, 32
    prompts = ["a b a b a b a b a b a b", "x y z x y z x y z x y z", "1 2 3 1 2 3 1 2 3 1 2 3"]
    ids, rts = recorded_chains(tiny_pair, prompts, max_depth, new)
    lookup = LookupConfig(1, 2, 3, 0, 0, max_requests=1)
    config = BatchConfig(max_requests=3, engine=EngineConfig(max_depth=max_depth, lookup=lookup))

    def live(make):
        batch = BatchedEngine(tiny_pair, config)
        ctrls = [make() for _ in ids]
        rids = [batch.add(BatchRequest(i, new, c)) for i, c in zip(ids, ctrls)]
        steps, done = [], {}
        while batch.active or batch.pending:
            for ev in batch.step():
                if ev.finished:
                    done[ev.rid] = batch.result(ev.rid).tokens
            steps.append(_step_key(batch.last_step))
        assert [done[r] for r in rids] == [rt.trace.tokens.tolist() for rt in rts]
        return steps, ctrls

    steps, ctrls = live(lambda: lookup_chooser(2))
    shared = [c for _, cycles in steps if len(cycles) > 1 for c in cycles]
    assert any(c[-2] for c in shared), "lookup cycles in steps shared with other requests"
    asked = [q for c in ctrls for q in c.asked]
    assert any(taken for *_, taken in asked) and not all(taken for *_, taken in asked)
    made = iter([lookup_chooser(2) for _ in ids])
    unset = BatchConfig(max_requests=3, engine=EngineConfig(max_depth=max_depth))  # its lookup is an argument
    sim = ServerReplay(rts, batched_profile(), lookup, config=unset)
    run = sim.run(Arrivals.closed(3, 3), lambda: next(made), order=[0, 1, 2])
    assert [_step_key(plan) for plan in run.plans] == steps
    control, _ = live(lambda: StaticController(2))
    assert not any(c[-2] for _, cycles in control if len(cycles) > 1 for c in cycles)


def test_catch_up_chunks_are_charged_as_draft_rows_and_the_rest_of_the_prompt_as_prefill(traces):
    """A catch-up cycle's chunk costs its rows of the step's level-1 draft forward (so a bigger bound makes
    fewer, dearer catch-up cycles); the first drafting cycle then pays the draft's prefill of what the chunks
    left of the prompt only; the draft's whole prompt prefill where no chunk ran."""
    from envs.server_costs import draft_prefill_s

    profile = batched_profile()
    for plen in (traces[0].trace.prompt_len, 100):
        assert draft_prefill_s(profile, plen, plen) == pytest.approx(
            profile.prefill_s(plen, with_draft=True) - profile.prefill_s(plen, with_draft=False)
        )
    assert draft_prefill_s(profile, 100, 30) == pytest.approx(0.3 * (0.154 - 0.005) / (512 - 16) * 100)
    counts = {}
    for bound in (2, 4, 10**6):
        sim = ServerReplay(
            traces,
            profile,
            config=BatchConfig(max_requests=4, engine=EngineConfig(draft_catch_up_tokens=bound)),
        )
        run = sim.run(Arrivals.closed(4, 4), lambda: late_starter(6, depth=2))
        recs = [rec for r in run.requests for rec in r.records]
        counts[bound] = sum(rec.catch_up > 0 for rec in recs)
        assert sum(rec.total_s for rec in recs) == pytest.approx(sum(s[0] for s in run.steps), rel=1e-9)
        for rec in recs:
            if rec.catch_up:
                assert rec.catch_up == bound and rec.draft_s > 0
    assert counts[2] > counts[4] > counts[10**6] == 0
    with pytest.raises(InputError):
        ServerReplay(traces, profile, config=BatchConfig(engine=EngineConfig(draft_catch_up_tokens=0)))


def test_the_prefill_budget_follows_the_load_as_the_engine_s():
    """Nothing decoding: both prompts in the first step (the idle budget); one decoding: a chunk a step."""
    import dataclasses

    short = make_synthetic_trace(0, length=60, width=1, max_depth=4)
    long = dataclasses.replace(make_synthetic_trace(1, length=10, width=1, max_depth=4), prompt_len=150)
    sim = ServerReplay(
        [ReplayTrace(short), ReplayTrace(long)],
        batched_profile(),
        config=BatchConfig(idle_prefill_tokens=512),
    )
    run = sim.run(Arrivals.closed(2, 2), lambda: StaticController(1, 1))
    first, second = run.requests
    assert first.first_token == second.first_token  # one step prefilled both
    assert prefill_budget(0, 16, 512) == (512, 512) and prefill_budget(1, 16, 512) == (65, 65)
    assert prefill_budget(4, 16, 512) == (16, 65) and prefill_budget(3, 16, 16) == (16, 65)


def test_a_replayed_prompt_hits_the_prefix_cache_as_live():
    """With a prefix cache, the same prompt again computes only its last token: its prefill charge is the
    profile's last-token difference, the draft's prefill is skipped too, and the tokens are the same."""
    trace = dataclasses_replace_prompt(make_synthetic_trace(0, length=20, width=1, max_depth=4), 200)
    profile = batched_profile()
    cold = ServerReplay([ReplayTrace(trace)], profile, config=BatchConfig(max_requests=1))
    hot = ServerReplay(
        [ReplayTrace(trace)], profile, config=BatchConfig(max_requests=1), prefix_cache_tokens=10_000
    )
    a = cold.run(Arrivals.closed(1, 3), lambda: StaticController(2, 2))
    b = hot.run(Arrivals.closed(1, 3), lambda: StaticController(2, 2))
    assert [r.cached for r in a.requests] == [0, 0, 0]
    assert [r.cached for r in b.requests] == [0, 199, 199]
    assert a.tokens == b.tokens
    ttft = [[r.first_token - r.admitted for r in run.requests] for run in (a, b)]
    assert ttft[1][0] == pytest.approx(ttft[0][0])
    assert ttft[1][1] < ttft[0][1] / 5 and ttft[1][2] < ttft[0][2] / 5
    assert b.end - b.start < a.end - a.start
    with pytest.raises(InputError, match="prefix_cache_tokens"):
        ServerReplay([ReplayTrace(trace)], profile, prefix_cache_tokens=-1)
    with pytest.raises(InputError, match="idle_prefill_tokens"):
        ServerReplay([ReplayTrace(trace)], profile, config=BatchConfig(idle_prefill_tokens=0))


def dataclasses_replace_prompt(trace, prompt_len: int):
    import dataclasses

    return dataclasses.replace(trace, prompt_len=prompt_len)
