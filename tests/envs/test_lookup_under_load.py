"""Context lookup's load limit in the server replay (``LookupConfig.max_requests``, ``envs.server``): applied as
the engine applies it, and tuned where lookup stops paying (``tune_lookup_limit``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.batch_api import BatchConfig
from engine.errors import InputError
from engine.lookup import LookupConfig
from envs.replay import ReplayTrace
from envs.server import ServerReplay, closed_loop, tune_lookup_limit
from tests_envs_helpers import make_synthetic_trace
from tests_helpers import batched_profile

LOOKUP = LookupConfig(min_ngram=1, max_ngram=2, max_tokens=3, long_ngram=0, long_tokens=0)


@pytest.fixture
def traces():
    return [ReplayTrace(make_synthetic_trace(seed, length=40, width=1, max_depth=4)) for seed in range(4)]


def _cycles(sim: ServerReplay, n: int) -> list[tuple]:
    run = sim.run(closed_loop(n, len(sim.traces)), lambda: None)
    return [(r.rid, rec.lookup, rec.emitted) for r in run.requests for rec in r.records]


def test_the_replay_looks_up_only_within_the_load_limit(traces):
    profile = batched_profile()
    free = ServerReplay(traces, profile, LOOKUP, BatchConfig(max_requests=8))
    within = ServerReplay(traces, profile, replace(LOOKUP, max_requests=2), BatchConfig(max_requests=8))
    below = ServerReplay(traces, profile, replace(LOOKUP, max_requests=1), BatchConfig(max_requests=8))
    assert sum(c[1] for c in _cycles(free, 2)) >= 10  # the test's premise: lookup proposes under load
    assert _cycles(within, 2) == _cycles(free, 2)  # a limit the load never passes changes nothing
    assert _cycles(below, 1) == _cycles(free, 1)  # one request: within any limit
    limited = _cycles(below, 4)
    assert sum(c[1] for c in limited) < sum(c[1] for c in _cycles(free, 4)) / 2
    assert sum(c[2] for c in limited) == sum(c[2] for c in _cycles(free, 4))  # the same tokens, other cycles


@pytest.mark.parametrize("row_s, limit", [(0.0, 0), (0.001, 4), (0.002, 2), (0.004, 1)])
def test_the_tuned_limit_is_where_lookup_stops_paying(traces, row_s, limit):
    """Free extra rows: lookup pays at every load (no limit); the dearer a row of the batched forward, the
    lower the load from which lookup's rejected rows cost more than the steps it saves."""
    sim = ServerReplay(traces, batched_profile(row_s=row_s), LOOKUP, BatchConfig(max_requests=8))
    got, ratios = tune_lookup_limit(sim, (1, 2, 4, 8))
    assert got == limit, ratios
    for n, ratio in ratios.items():
        assert (ratio >= 1.0) == (limit == 0 or n <= limit) or n == min(ratios), ratios


def test_tuning_needs_lookup(traces):
    with pytest.raises(InputError, match="context lookup"):
        tune_lookup_limit(ServerReplay(traces, batched_profile(), None, BatchConfig(max_requests=8)), (1, 2))
