"""Replay is exact: for the same controller, replaying a recorded trace reproduces the live engine's
cycles (depth, verified, accepted, emitted) one for one (greedy, tiny pair in float64)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig
from engine.lookup import LookupConfig
from engine.sampling import SamplingConfig
from envs.record_traces import record_trace
from envs.replay import ReplayTrace, replay_generate
from envs.trace import TraceError
from policies.heuristic import ConfidenceController, HeuristicController

PROMPTS = ("def main():", "The quick brown fox", "Hello, world")
MAX_DEPTH = 6


def _cycles(records):
    return [(r.depth, r.num_verified, r.accepted, r.emitted) for r in records]


@pytest.fixture(scope="module")
def recorded(tiny_pair):
    out = {}
    for width in (1, 3):
        for prompt in PROMPTS:
            ids = tiny_pair.encode(prompt, chat=False)
            trace = record_trace(
                tiny_pair, ids, prompt, SamplingConfig(), MAX_DEPTH, width, max_new_tokens=40
            )
            out[(width, prompt)] = (ids, ReplayTrace(trace, engine_max_depth=MAX_DEPTH))
    return out


class EveryThird(StaticController):
    """Depth 0 (no draft) on every third cycle: replay must skip the same cycles and let the draft catch up
    on the same pending tokens as the engine."""

    def reset(self):
        self.n = 0

    def should_continue(self, state):
        if state.depth == 0:
            self.n += 1
            return self.n % 3 != 0
        return super().should_continue(state)


def _controllers(width):
    grid = [StaticController(d, v, tree_width=width) for d in (0, 1, 2, 4, 6) for v in (1, 2, 3, 5, 8, 64)]
    grid += [EveryThird(2, 3, tree_width=width), EveryThird(4, 8, tree_width=width)]
    grid.append(ConfidenceController(0.3, max_depth=MAX_DEPTH, tree_width=width, max_verify=6))
    if width == 1:
        grid.append(HeuristicController(2, max_depth=MAX_DEPTH))
    return grid


@pytest.mark.parametrize("width", [1, 3])
def test_replay_reproduces_live_cycles(tiny_pair, recorded, width):
    engine = SpeculativeEngine(tiny_pair, SamplingConfig(), EngineConfig(max_depth=MAX_DEPTH))
    compared = accepted_total = 0
    for prompt in PROMPTS:
        ids, rt = recorded[(width, prompt)]
        for ctrl in _controllers(width):
            live = engine.generate(ids, 40, controller=ctrl)
            assert live.tokens == rt.trace.tokens.tolist()
            assert _cycles(replay_generate(rt, ctrl)) == _cycles(live.cycles), (prompt, ctrl)
            compared += len(live.cycles)
            accepted_total += sum(c.accepted for c in live.cycles)
    assert compared > 300 and accepted_total > 100  # many positions, and not a trivially rejecting draft


LOOKUPS = (LookupConfig(1, 2, 4), LookupConfig(2, 3, 8), LookupConfig(3, 3, 1), LookupConfig(1, 1, 1, 3, 5))


def _lookup_cycles(records):
    return [(r.lookup, r.depth, r.num_verified, r.accepted, r.emitted) for r in records]


@pytest.mark.parametrize("width", [1, 3])
def test_replay_reproduces_live_cycles_with_context_lookup(tiny_pair, recorded, width):
    """Lookup cycles (where a proposal is found) and controller cycles (elsewhere) replay one for one, with
    the draft catching up on the lookup's tokens in later controller cycles; no controller (lookup and
    autoregressive steps only) too."""
    compared = lookup_cycles = lookup_accepted = 0
    for lookup in LOOKUPS:
        engine = SpeculativeEngine(
            tiny_pair, SamplingConfig(), EngineConfig(max_depth=MAX_DEPTH, lookup=lookup)
        )
        for prompt in PROMPTS:
            ids, rt = recorded[(width, prompt)]
            for ctrl in [None, *_controllers(width)[::5]]:
                live = engine.generate(ids, 40, controller=ctrl)
                assert live.tokens == rt.trace.tokens.tolist()
                replayed = replay_generate(rt, ctrl, lookup=lookup)
                assert _lookup_cycles(replayed) == _lookup_cycles(live.cycles), (prompt, ctrl, lookup)
                compared += len(live.cycles)
                lookup_cycles += sum(c.lookup for c in live.cycles)
                lookup_accepted += sum(c.accepted for c in live.cycles if c.lookup)
    assert compared > 300 and lookup_cycles > 100 and lookup_accepted > 100


def test_lookup_replay_needs_the_prompt_ids(recorded):
    _, rt = recorded[(1, PROMPTS[0])]
    meta = dict(rt.trace.meta)
    del meta["prompt_ids"]
    bare = ReplayTrace(dataclasses.replace(rt.trace, meta=meta), engine_max_depth=MAX_DEPTH)
    replay_generate(bare, None)  # without lookup the prompt is not needed
    with pytest.raises(TraceError, match="prompt ids"):
        replay_generate(bare, None, lookup=LOOKUPS[0])
