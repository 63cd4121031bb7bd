"""The observation the learned policy and the environments see: the features of the depth and size decisions
(docs/design.md section 5).

One function per decision, used by the gymnasium environments (live and replay) and by exported
learned controllers on the inference path, so training and deployment see identical numbers. Every
feature is a function of the ``DraftState`` (itself a function of the committed prefix) and of a few
constants describing the device's cost profile. Float32, clipped to finite bounds: [0, ``DEPTH_OBS_HIGH``]
and [0, ``SIZE_OBS_HIGH``] (the environments' Box bounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.control import DraftState
from engine.costs.cost_profile import CostProfile
from engine.costs.load_model import LoadedProfiles, per_load
from engine.costs.speedup_model import next_level_probs, relative_speedups, verify_curve
from engine.results import CycleRecord

FEATURE_VERSION = 7
"""2: the history features gained the draft lag (version 1 policies cannot see it; retrain them).
3: the common part gained the request's sampling temperature (one policy serves greedy and sampled
decoding; version 2 policies were trained for one temperature: retrain them).
4: the device features gained the start of the verification curve (root only, 2 and 4 nodes, over one
node): chains verify 1-8 nodes, and a device whose first rows are cheap (int8) looked like one whose are
not through verify(16) and verify(64) alone (a randomised policy never drafted there: 0.86x a policy
trained on it).
5: both decisions gained the cost model's estimates (``cost_model_features``): the speedup over an
autoregressive step that verifying now would give at each size, and (depth) after one more level. With the
tiled kquant kernels verification became cheap and the analytic controller beat the learned one (1.061x vs
1.020x the best static on validation); the policy now starts from the model's numbers and learns where
they are wrong, instead of rebuilding them from probabilities and cost constants.
6: the common part gained the load (``load_features``: requests in the step, waiting, the other requests'
rows and drafting, the arrival rate), and the device features (so the cost model's estimates too) are those
of the profile at the request's load (``engine.costs.load_model``): drafting that pays alone loses when every
drafted row competes with another request's row, and a policy that cannot see the load cannot tell.
7: the common part gained the request's own signals (``request_features``): the tokens context lookup proposes
now (set where the policy decides lookup, ``engine.control.Controller.use_lookup``), lookup's and the draft's
acceptance in this request so far, and the share of its recent cycles lookup served. On input-grounded work
(edits of given code, questions over a given document) acceptance differs between requests and within one
answer; a policy that sees only the load features learns a per-load rule."""
MAX_WIDTH = 8
"""Frontier entries observed by the depth policy (wider frontiers are cut, narrower padded with 0)."""
MAX_NODES = 64
"""Node entries observed by the size policy."""
HISTORY = 16
"""Cycles the history features look back over."""
NUM_DEVICE_FEATURES = 6
DEPTH_SCALE, NODES_SCALE, LOG_CONTEXT_SCALE = 16.0, 64.0, float(np.log(32768.0))
MAX_LAG = 128
"""Draft lag (tokens) beyond which the lag feature saturates."""
NUM_HISTORY_FEATURES = 5
MAX_TEMPERATURE = 2.0
"""Temperatures above this are observed as this (the feature saturates)."""
NUM_STATE_FEATURES = 4
"""depth, depth cap, log context, temperature."""
NUM_LOAD_FEATURES = 5
"""requests, waiting, other rows, other drafting, arrival rate (``load_features``)."""
NUM_REQUEST_FEATURES = 4
"""lookup's proposal now, lookup's and the draft's acceptance, lookup's share of cycles (``request_features``)."""
MAX_PROPOSAL = 8
"""Lookup proposals longer than this are observed as this."""
LOAD_REQUESTS_SCALE, LOAD_ROWS_SCALE, LOAD_RATE_SCALE = 4.0, 64.0, 16.0
MODEL_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
"""Verification sizes at which the size observation holds the cost model's speedup."""
MAX_MODEL_SPEEDUP = 8.0
"""Speedups above this are observed as this."""


def device_features(profile: CostProfile, tree_width: int, context: int = 512) -> np.ndarray:
    """[6] cost-profile constants a policy can condition on, each relative to verifying one node (root + 1
    rows): one draft step of width ``tree_width`` (the article's c); verifying 16 and 64 nodes (how fast
    verification grows: g); verifying the root alone (an autoregressive step), 2 and 4 nodes (where chains
    live: what the first verified rows cost)."""
    if profile is None:
        return np.zeros(NUM_DEVICE_FEATURES, dtype=np.float32)
    base = profile.verify_s(1, context)
    feats = [
        profile.draft_step_s(tree_width, context) / base,
        profile.verify_s(16, context) / base,
        profile.verify_s(64, context) / base,
        profile.verify_s(0, context) / base,
        profile.verify_s(2, context) / base,
        profile.verify_s(4, context) / base,
    ]
    return np.clip(np.asarray(feats, dtype=np.float32), 0.0, 64.0)


def history_features(history: Sequence[CycleRecord]) -> np.ndarray:
    """[5]: EMA of accepted length (decay 0.7 over the drafting cycles among the last 16 cycles), last
    accepted, last depth, last verified size, and the draft lag, each scaled to about [0, 1].

    The draft lag is the tokens committed by autoregressive steps since the last drafting cycle (all of
    them when none drafted yet): the draft model has not seen them, so the next drafting cycle first runs
    the draft over all of them (a catch-up forward whose cost grows with the lag). Without it a policy
    cannot tell "drafting now is cheap" (right after a drafting cycle) from "drafting now pays a long
    catch-up" (after a run of autoregressive steps)."""
    lag = 0
    for r in reversed(history):  # stops at MAX_LAG: the feature saturates there (this runs every cycle)
        if r.depth > 0 or lag >= MAX_LAG:
            break
        lag += r.emitted
    lag_feature = min(lag, MAX_LAG) / MAX_LAG
    recent = [r for r in history[-HISTORY:] if r.depth > 0]
    if not recent:
        return np.asarray([0.0, 0.0, 0.0, 0.0, lag_feature], dtype=np.float32)
    ema = recent[0].accepted
    for r in recent[1:]:
        ema = 0.7 * ema + 0.3 * r.accepted
    last = recent[-1]
    return np.asarray(
        [
            ema / DEPTH_SCALE,
            last.accepted / DEPTH_SCALE,
            last.depth / DEPTH_SCALE,
            last.num_verified / NODES_SCALE,
            lag_feature,
        ],
        dtype=np.float32,
    )


_SIZES = np.asarray(MODEL_SIZES)
_curves: dict[bytes, np.ndarray] = {}


def _verify_table(device: np.ndarray) -> np.ndarray:
    """The verification cost over one node's at 0..max(MODEL_SIZES) nodes, read from the device features
    (``speedup_model.verify_curve`` through their points: the root alone, 1, 2, 4, 16 and 64 nodes), computed
    once per device (this runs every decision)."""
    key = device.tobytes()
    table = _curves.get(key)
    if table is None:
        if len(_curves) > 64:
            _curves.clear()
        known = np.asarray([device[3], 1.0, device[4], device[5], device[1], device[2]], dtype=np.float64)
        table = _curves[key] = verify_curve(known, np.arange(MODEL_SIZES[-1] + 1, dtype=np.float64))
    return table


def _speedups(path_probs: np.ndarray, depth: int, device: np.ndarray) -> np.ndarray:
    """[len(MODEL_SIZES)] the cost model's speedup over an autoregressive step of verifying the best V nodes
    now (``policies.analytic`` without its online calibration and the overhead), from the device features:
    ``speedup_model.relative_speedups`` in units of verifying one node. ``path_probs`` sorted best first."""
    if device[3] <= 0:  # no profile: no model
        return np.zeros(len(MODEL_SIZES))
    return relative_speedups(
        path_probs, depth, _SIZES, float(device[0]), _verify_table(device), float(device[3])
    )


def cost_model_features(state: DraftState, device: np.ndarray) -> tuple[np.ndarray, float, float]:
    """The cost model's estimates for ``state`` (``policies.analytic``'s, uncalibrated, from the device
    features alone): the speedup over autoregressive decoding of verifying now at each of ``MODEL_SIZES``,
    the best of them, and the best after drafting one more level (the next level's path probabilities
    predicted as the analytic controller does for its best children: each frontier node's best child
    shares the last step's conditional probability)."""
    probs = np.exp(np.asarray(state.node_scores, dtype=np.float64))  # sorted best first (DraftState)
    now = _speedups(probs, state.depth, device)
    best_now = float(now.max()) if state.depth > 0 else 1.0
    if state.depth == 0 or not len(state.step_probs):  # before the first draft step: no prediction
        best_next = 0.0
    else:
        frontier = np.exp(np.asarray(state.frontier_scores, dtype=np.float64))
        nxt = next_level_probs(probs, frontier, state.step_probs)
        best_next = float(_speedups(nxt, state.depth + 1, device).max())
    return (
        np.clip(now, 0.0, MAX_MODEL_SPEEDUP).astype(np.float32),
        min(max(best_now, 0.0), MAX_MODEL_SPEEDUP),
        min(max(best_next, 0.0), MAX_MODEL_SPEEDUP),
    )


def _padded(values: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.float32)
    n = min(len(values), size)
    out[:n] = values[:n]
    return out


_ALONE = np.zeros(NUM_LOAD_FEATURES, dtype=np.float32)


def load_features(load) -> np.ndarray:
    """[5] the load of the step (``engine.load.LoadState``; None: alone, all 0): log2 of the requests in the
    step and log2(1 + waiting), each over 4; the other requests' target rows over 64 and their drafting count
    over 16; the arrival rate (requests/s) over 16, saturating at 1."""
    if load is None:
        return _ALONE
    return np.asarray(
        [
            np.log2(max(load.requests, 1)) / LOAD_REQUESTS_SCALE,
            np.log2(1 + max(load.waiting, 0)) / LOAD_REQUESTS_SCALE,
            min(max(load.other_rows, 0) / LOAD_ROWS_SCALE, 4.0),
            min(max(load.other_drafting, 0) / 16.0, 4.0),
            min(max(float(load.arrival_rate), 0.0) / LOAD_RATE_SCALE, 1.0),
        ],
        dtype=np.float32,
    )


def request_features(state: DraftState) -> np.ndarray:
    """[4] the request's own signals over its last ``HISTORY`` cycles: the tokens context lookup proposes in
    this state (``DraftState.lookup_proposed`` over ``MAX_PROPOSAL``; 0 but where lookup is the question);
    lookup's per-token acceptance (accepted over verified in its lookup cycles; 0 without any); the draft's
    (the same over its drafting cycles); the share of those cycles that were lookup cycles."""
    lookup_acc = lookup_ver = draft_acc = draft_ver = 0
    lookups = 0
    recent = state.history[-HISTORY:]
    for r in recent:
        if r.lookup:
            lookups += 1
            lookup_acc += r.accepted
            lookup_ver += r.num_verified
        elif r.depth > 0:
            draft_acc += r.accepted
            draft_ver += r.num_verified
    return np.asarray(
        [
            min(max(int(state.lookup_proposed), 0), MAX_PROPOSAL) / MAX_PROPOSAL,
            lookup_acc / lookup_ver if lookup_ver else 0.0,
            draft_acc / draft_ver if draft_ver else 0.0,
            lookups / HISTORY,
        ],
        dtype=np.float32,
    )


def _common(state: DraftState, device: np.ndarray) -> np.ndarray:
    return np.concatenate(
        [
            np.asarray(
                [
                    state.depth / DEPTH_SCALE,
                    state.max_depth / DEPTH_SCALE,
                    np.log(max(state.context_len, 1)) / LOG_CONTEXT_SCALE,
                    min(float(state.temperature), MAX_TEMPERATURE),
                ],
                dtype=np.float32,
            ),
            history_features(state.history),
            device.astype(np.float32),
            load_features(state.load),
            request_features(state),
        ]
    )


def depth_observation(state: DraftState, device: np.ndarray) -> np.ndarray:
    """Depth decision (continue/stop): path probabilities exp(score) of the frontier (sorted), the last
    step's conditional probabilities (sorted), the cost model's best speedup now and after one more level,
    then depth, cap, context, temperature, history and device features."""
    frontier = np.exp(np.asarray(state.frontier_scores, dtype=np.float32))
    step = np.sort(np.asarray(state.step_probs, dtype=np.float32))[::-1]
    _, now, nxt = cost_model_features(state, device)
    obs = np.concatenate(
        [_padded(frontier, MAX_WIDTH), _padded(step, MAX_WIDTH), [now, nxt], _common(state, device)]
    )
    return np.clip(obs, 0.0, DEPTH_OBS_HIGH).astype(np.float32)


def size_observation(state: DraftState, device: np.ndarray) -> np.ndarray:
    """Size decision: path probabilities exp(score) of the top-64 nodes (sorted), their running sum
    (expected accepted tokens if that many are verified, scaled), the cost model's speedup at each of
    ``MODEL_SIZES``, then the common features."""
    nodes = _padded(np.exp(np.asarray(state.node_scores, dtype=np.float32)), MAX_NODES)
    expected = np.cumsum(nodes) / NODES_SCALE
    speedups, _, _ = cost_model_features(state, device)
    obs = np.concatenate([nodes, expected[[0, 1, 3, 7, 15, 31, 63]], speedups, _common(state, device)])
    return np.clip(obs, 0.0, SIZE_OBS_HIGH).astype(np.float32)


NUM_COMMON_FEATURES = (
    NUM_STATE_FEATURES + NUM_HISTORY_FEATURES + NUM_DEVICE_FEATURES + NUM_LOAD_FEATURES + NUM_REQUEST_FEATURES
)
DEPTH_OBS_DIM = 2 * MAX_WIDTH + 2 + NUM_COMMON_FEATURES
SIZE_OBS_DIM = MAX_NODES + 7 + len(MODEL_SIZES) + NUM_COMMON_FEATURES
DEPTH_OBS_HIGH = SIZE_OBS_HIGH = 64.0


class DeviceAtLoad:
    """The device features a request sees at its load: ``device_features`` of the profile at that load
    (``engine.costs.load_model.LoadedProfiles``), computed once per load key; alone, or without a batch axis
    in the profile, ``alone`` (the features of the profile itself, or the ones a policy file carries)."""

    def __init__(self, profile: Any, tree_width: int, alone: np.ndarray | None = None, size: int = 512):
        self.profiles = LoadedProfiles(profile) if profile is not None else None
        self.tree_width = int(tree_width)
        self.alone = (
            np.asarray(alone, dtype=np.float32)
            if alone is not None
            else device_features(profile, self.tree_width)
        )
        self.size = size
        self._cache: dict[tuple, np.ndarray] = {}

    @property
    def available(self) -> bool:
        """Whether the features follow the load (the profile has a batch axis)."""
        return self.profiles is not None and self.profiles.available

    def at(self, load) -> np.ndarray:
        if load is None or not self.available or load.alone:
            return self.alone
        return per_load(
            self._cache, load, self.size, lambda: device_features(self.profiles.at(load), self.tree_width)
        )
