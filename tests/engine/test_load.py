"""The load a controller sees (engine.load): None alone, the step's load inside the batched engine, measured
as documented; the cost model at a load (engine.costs.load_model); greedy output whatever the load makes a
controller do."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.models import load_pair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest
from engine.control import DraftState, StaticController
from engine.costs.load_model import MIN_LOADED_SHARE, LoadedProfile, LoadedProfiles, split_forward
from engine.costs.observation import NUM_LOAD_FEATURES, DeviceAtLoad, device_features, load_features
from engine.costs.profile_io import ProfileError
from engine.engine import SpeculativeEngine
from engine.load import LoadState, LoadTracker
from tests_helpers import batched_profile

pytestmark = pytest.mark.usefixtures("single_thread")


class Recording(StaticController):
    """A static chain that records the load of every depth-0 question."""

    def __init__(self, depth):
        super().__init__(depth)
        self.loads = []

    def should_continue(self, state: DraftState) -> bool:
        if state.depth == 0:
            self.loads.append(state.load)
        return super().should_continue(state)


class DraftsOnlyAlone(StaticController):
    """Drafts 3 levels when alone, none in a batch of several: a load-aware rule."""

    def __init__(self):
        super().__init__(3)

    def should_continue(self, state: DraftState) -> bool:
        if state.load is not None and state.load.requests > 1:
            return False
        return super().should_continue(state)


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny", weights="float32", device="cpu")


def test_alone_the_load_is_none(pair):
    ctrl = Recording(2)
    SpeculativeEngine(pair).generate("def main():", 12, ctrl)
    assert ctrl.loads and all(load is None for load in ctrl.loads)


def test_the_batched_engine_shows_each_request_the_step_load(pair):
    batch = BatchedEngine(pair, BatchConfig(max_requests=3, max_rows=64))
    ctrls = [Recording(2) for _ in range(3)]
    rids = [batch.add(BatchRequest(p, 30, c, ignore_eos=True)) for p, c in zip(["ab", "cd", "ef"], ctrls)]
    batch.waiting_outside = 5
    batch.step()  # the prefills (each prompt's chunk in the step's target forward)
    assert all(not ctrl.loads for ctrl in ctrls)
    batch.step()  # the first cycles: nothing known of a last decoding step yet
    first = ctrls[0].loads[0]
    assert first.requests == 3 and first.waiting == 5 and first.other_rows == 0 and first.other_drafting == 0
    assert first.arrival_rate > 0
    batch.step()
    for ctrl in ctrls:  # each of the others put its root and 2 verified nodes in the last target forward
        load = ctrl.loads[-1]
        assert (load.requests, load.other_rows, load.other_drafting) == (3, 6, 2), load
    assert batch.load_of(rids[0]) == ctrls[0].loads[-1]
    batch.waiting_outside = 0
    batch.cancel(rids[1])
    batch.cancel(rids[2])
    batch.step()
    alone = ctrls[0].loads[-1]
    assert (
        alone.requests == 1 and alone.waiting == 0 and alone.other_rows == 6
    )  # the last step still had them
    batch.step()
    assert ctrls[0].loads[-1].alone


def test_a_load_aware_controller_keeps_greedy_output_exact(pair):
    prompts = ["def main():", "The quick brown fox", "x"]
    batch = BatchedEngine(pair, BatchConfig(max_requests=3))
    rids = [batch.add(BatchRequest(p, 24, DraftsOnlyAlone())) for p in prompts]
    out = {}
    while batch.active or batch.pending:
        for ev in batch.step():
            if ev.finished:
                out[ev.rid] = batch.result(ev.rid)
    for rid, prompt in zip(rids, prompts):
        alone = SpeculativeEngine(pair).generate(prompt, 24, DraftsOnlyAlone())
        assert out[rid].tokens == alone.tokens
        assert sum(c.depth > 0 for c in alone.cycles) > 0  # alone it drafts
    assert any(c.depth == 0 and not c.lookup for c in out[rids[0]].cycles)  # in the batch it did not


def test_load_tracker_counts_admissions_in_its_window():
    tracker = LoadTracker(window=10.0)
    assert tracker.rate(0.0) == 0.0
    for t in (0.0, 1.0, 2.0, 3.0):
        tracker.arrived(t)
    assert tracker.rate(4.0) == pytest.approx(4 / 4.0)
    assert tracker.rate(12.5) == pytest.approx(1 / 10.0)  # 0, 1 and 2 left the window
    with pytest.raises(ValueError):
        LoadTracker(window=0)


def test_load_features_are_zero_alone_and_follow_the_load():
    assert not load_features(None).any() and len(load_features(None)) == NUM_LOAD_FEATURES
    assert not load_features(LoadState()).any()
    busy = load_features(LoadState(requests=8, waiting=3, other_rows=14, other_drafting=2, arrival_rate=1.0))
    assert (
        busy[0] == pytest.approx(3 / 4)
        and busy[1] == pytest.approx(2 / 4)
        and busy[2] == pytest.approx(14 / 64)
    )


def test_split_forward_charges_add_up_to_the_forward_and_are_marginal():
    profile = batched_profile()
    time, charges = split_forward(profile, "target", [1, 3, 1], [1, 1, 1])
    assert time == pytest.approx(0.025 + 0.006 * 5)
    assert sum(charges) == pytest.approx(time)
    assert charges[1] - charges[0] == pytest.approx(2 * 0.006)  # its two extra rows, at the marginal row cost
    time, charges = split_forward(profile, "draft", [2])  # alone in a draft forward: all of it
    assert charges == [pytest.approx(time)]


def test_a_loaded_profile_is_the_base_alone_and_charges_marginal_costs_under_load():
    profile = batched_profile()
    loads = LoadedProfiles(profile)
    assert loads.at(None) is profile and loads.at(LoadState()) is profile
    busy = loads.at(LoadState(requests=4, other_rows=3))
    assert isinstance(busy, LoadedProfile)
    # an autoregressive step costs its share of a 4-row forward, far less than its own forward alone
    assert busy.verify_s(0, 512) < profile.verify_s(0, 512) / 2
    # a verified node adds a row's marginal cost, which this table keeps at any batch: as much as alone, so
    # nodes cost as much as alone while the step they save got cheaper; a draft step run while no other
    # request drafts is a whole draft forward, as alone
    assert busy.verify_s(2, 512) - busy.verify_s(0, 512) == pytest.approx(
        profile.verify_s(2, 512) - profile.verify_s(0, 512)
    )
    assert busy.draft_step_s(1, 512) == pytest.approx(profile.draft_step_s(1, 512))
    shared = loads.at(LoadState(requests=4, other_rows=3, other_drafting=3))
    assert shared.draft_step_s(1, 512) < profile.draft_step_s(1, 512)  # three others draft: a row's cost
    with pytest.raises(ProfileError, match="batch axis"):
        LoadedProfile(batched_profile(batched=False), LoadState(requests=2))
    feats = DeviceAtLoad(profile, 1)
    assert (feats.at(None) == device_features(profile, 1)).all()
    assert not (feats.at(LoadState(requests=4, other_rows=3)) == feats.at(None)).all()
    assert not DeviceAtLoad(batched_profile(batched=False), 1).available


def test_a_noisy_batch_table_never_makes_a_loaded_cost_zero():
    """Rows that measured cheaper than fewer rows (noise) give negative charges: the cost at a load keeps a
    floor (``MIN_LOADED_SHARE`` of the cost alone), so the device features stay finite."""
    noisy = batched_profile()
    for name in ("target", "draft"):  # several sequences measured far cheaper than one (noise)
        noisy.batched[name] = [[q, r, t if q == 1 else 0.001] for q, r, t in noisy.batched[name]]
    loaded = LoadedProfile(noisy, LoadState(requests=8, waiting=0, other_rows=40, other_drafting=7))
    for nodes in (0, 1, 4):
        assert loaded.verify_s(nodes, 512) >= MIN_LOADED_SHARE * noisy.verify_s(nodes, 512) > 0
    assert loaded.draft_step_s(1, 512) > 0 and loaded.draft_chunk_s(3, 512) > 0
    assert np.isfinite(device_features(loaded, 1)).all()
