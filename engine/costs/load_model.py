"""What one request's choices cost the server at a given load: the cost profile's batch axis made into the
replay interface of a profile (``LoadedProfile``), and the rule that splits one batched step's time among
the requests in it (``split_forward``), shared by the server replay (``envs.server``) and the cost model of
the load-aware controllers.

Why marginal costs. A server maximises the tokens of all its requests per second. One request's verified
rows and draft steps lengthen the forwards every request in the step waits on, so the time a choice costs is
what it adds to those forwards: the marginal cost of its rows in the batched forward (``T(S, R) - T(S, R -
r)``), plus an equal share of the rest (the part no single choice changes). Alone, this is the request's own
forward time; with 8 requests in the step, verifying 4 more rows costs what 4 more rows cost a 12-row
forward, and a draft step taken while no other request drafts costs a whole draft forward.

``LoadedProfile(base, load)`` answers ``verify_s``, ``draft_step_s``, ``draft_chunk_s`` (and the rest of the
replay interface) with the base profile's figure plus what the load changes: ``charge(load) - charge(alone)``,
both read from the batch table (``CostProfile.batched``, measured at one context by
``python -m engine.costs.measure_costs --batch-axis``). So alone it is the base profile itself, the context
dependence stays the base profile's, and a perturbed profile (``envs.profiles``) keeps its perturbations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine.costs.cost_profile import CostProfile
from engine.costs.profile_io import ProfileError
from engine.load import LoadState


def batch_table(profile: Any) -> CostProfile | None:
    """The ``CostProfile`` holding the batch axis behind ``profile`` (itself, or the measured profile a
    perturbed or loaded one wraps); None when there is none."""
    seen = 0
    while profile is not None and seen < 8:
        if isinstance(profile, CostProfile):
            return profile if profile.batched else None
        profile = getattr(profile, "base", None)
        seen += 1
    return None


def step_overhead_of(profile: Any) -> float:
    """Seconds a live server's step costs beyond its forwards and per-cycle overheads, as the batch axis behind
    ``profile`` holds it (``batched["step_overhead_s"]``: a batch axis fitted to a step log,
    ``envs.step_costs``); 0 when it holds none."""
    table = batch_table(profile)
    return float(table.batched.get("step_overhead_s", 0.0)) if table is not None else 0.0


def forward_s(table: CostProfile, model: str, sequences: int, rows: int) -> float:
    """One batched forward of ``model`` carrying ``sequences`` sequences and ``rows`` rows (0 for none)."""
    if sequences <= 0 or rows <= 0:
        return 0.0
    return table.batched_forward_s(model, sequences, max(rows, sequences))


def split_forward(
    table: CostProfile, model: str, rows: Sequence[int], baseline: Sequence[int] | None = None
) -> tuple[float, list[float]]:
    """(time of the forward carrying every request's ``rows``, each request's charge): its marginal cost,
    ``T(all) - T(all but what it adds over baseline)``, plus an equal share of what the marginal costs leave.
    ``baseline[i]``: the rows request i would put in without its choice (1 for a target forward: its root; 0
    for a draft forward). The charges add up to the time."""
    rows = [int(r) for r in rows]
    if not rows:
        return 0.0, []
    base = [0] * len(rows) if baseline is None else [int(b) for b in baseline]
    sequences, total = len(rows), sum(rows)
    time = forward_s(table, model, sequences, total)
    marginal = []
    for r, b in zip(rows, base):
        extra = r - b
        if extra <= 0:
            marginal.append(0.0)
            continue
        without = total - extra
        seqs = sequences - (1 if b == 0 else 0)
        marginal.append(time - forward_s(table, model, seqs, without))
    rest = (time - sum(marginal)) / sequences
    return time, [m + rest for m in marginal]


class LoadedProfile:
    """``base`` seen by one request at ``load``: each forward it takes part in charged as ``split_forward``
    charges it (module docstring). The replay interface of ``CostProfile``: what ``envs.replay``,
    ``engine.costs.observation`` and ``policies.analytic`` call."""

    def __init__(self, base: Any, load: LoadState, table: CostProfile | None = None):
        self.base = base
        self.load = load
        self.table = table if table is not None else batch_table(base)
        if self.table is None:
            raise ProfileError(
                "a load-aware cost model needs the profile's batch axis: measure it with "
                "`python -m engine.costs.measure_costs --batch-axis`"
            )
        self._target: dict[int, float] = {}
        self._draft: dict[int, float] = {}

    @property
    def meta(self) -> dict:
        return {**getattr(self.base, "meta", {}), "load": self.load.key()}

    # ------------------------------------------------------------------------ what the load changes
    def target_delta(self, rows: int) -> float:
        """This request's charge for ``rows`` target rows at the load minus its charge alone."""
        out = self._target.get(rows)
        if out is None:
            load, table = self.load, self.table
            others = max(load.requests - 1, 0)
            other_rows = max(load.other_rows, others)  # every other request has its root row at least
            per_other = [other_rows // others + (i < other_rows % others) for i in range(others)]
            _, charges = split_forward(table, "target", [rows] + per_other, [1] * (others + 1))
            _, alone = split_forward(table, "target", [rows], [1])
            out = self._target[rows] = charges[0] - alone[0]
        return out

    def draft_delta(self, rows: int) -> float:
        """This request's charge for a draft forward of ``rows`` rows at the load minus alone (the others
        that drafted in the last step each put one row into every draft forward: chains)."""
        out = self._draft.get(rows)
        if out is None:
            n = max(self.load.other_drafting, 0)
            _, charges = split_forward(self.table, "draft", [rows] + [1] * n, [0] + [1] * n)
            _, alone = split_forward(self.table, "draft", [rows])
            out = self._draft[rows] = charges[0] - alone[0]
        return out

    # ------------------------------------------------------------------------ the replay interface
    def draft_step_s(self, width: int, context: int) -> float:
        return _at_least_some(self.base.draft_step_s(width, context), self.draft_delta(width))

    def draft_chunk_s(self, num_pending: int, context: int) -> float:
        return _at_least_some(self.base.draft_chunk_s(num_pending, context), self.draft_delta(num_pending))

    def draft_chunk_curve(self, max_pending: int, context: int) -> np.ndarray:
        return np.asarray([self.draft_chunk_s(p, context) for p in range(1, max_pending + 1)], np.float64)

    def verify_s(self, num_nodes: int, context: int, chain: bool = False) -> float:
        rows = 1 + max(int(num_nodes), 0)
        return _at_least_some(self.base.verify_s(num_nodes, context, chain), self.target_delta(rows))

    def overhead_s(self, num_nodes: int, depth: int = 1, tree_width: int = 1) -> float:
        return self.base.overhead_s(num_nodes, depth, tree_width)

    def prefill_s(self, prompt_len: int, with_draft: bool = True) -> float:
        return self.base.prefill_s(prompt_len, with_draft)

    def noise_scale(self, rng: np.random.Generator) -> float:
        scale = getattr(self.base, "noise_scale", None)
        return scale(rng) if scale is not None else 1.0


class LoadedProfiles:
    """``LoadedProfile``s of one base profile, one per load key, made once (the controllers ask every
    decision)."""

    def __init__(self, base: Any, size: int = 512):
        self.base = base
        self.table = batch_table(base)
        self.size = size
        self._cache: dict[tuple, LoadedProfile] = {}

    @property
    def available(self) -> bool:
        """Whether the base profile has a batch axis (else ``at`` returns the base itself)."""
        return self.table is not None

    def at(self, load: LoadState | None) -> Any:
        """The profile a request sees at ``load`` (the base itself alone or without a batch axis)."""
        if load is None or self.table is None or load.alone:
            return self.base
        return per_load(self._cache, load, self.size, lambda: LoadedProfile(self.base, load, self.table))


MIN_LOADED_SHARE = 0.05
"""A cost at a load is at least this share of the cost alone: the charges come from differences of measured
cells, and a noisy table can make them negative (a request whose forward costs nothing would divide by zero
in the device features and make no sense to a controller)."""


def _at_least_some(alone: float, delta: float) -> float:
    return max(alone + delta, MIN_LOADED_SHARE * alone)


def per_load(cache: dict, load: LoadState, size: int, make: Callable[[], Any]) -> Any:
    """``cache[load.key()]``, made by ``make()`` the first time; the cache is emptied when it holds ``size``
    entries (the controllers ask every decision, the loads seen are few)."""
    key = load.key()
    out = cache.get(key)
    if out is None:
        if len(cache) >= size:
            cache.clear()
        out = cache[key] = make()
    return out
