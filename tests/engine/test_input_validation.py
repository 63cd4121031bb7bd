"""Inputs and caps of the engine (issue 14): a verification never exceeds ``EngineConfig.max_verify`` nodes and
a draft tree never exceeds ``max_tree_nodes`` (so a huge request runs in bounded memory, checked under a memory
limit with a negative control), replay applies the same caps, and bad prompts, seeds, controllers and
controller answers fail at the boundary with one ``DraftpilotError`` naming the argument, leaving the engine
usable."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.attention import MAX_ROWWISE_ROWS, MAX_VERIFY_NODES
from engine.control import Controller, ControllerError, StaticController
from engine.engine import SpeculativeEngine
from engine.errors import DraftpilotError, InputError
from engine.inputs import EngineConfig
from engine.sampling import SamplingConfig
from engine.tree import depth_limit, tree_size
from envs.record_traces import record_trace
from envs.replay import ReplayTrace, replay_generate

pytestmark = pytest.mark.usefixtures("single_thread")
REPO = Path(__file__).resolve().parents[2]
NUM_NEW = 12


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return SpeculativeEngine(tiny_pair)


@pytest.fixture(scope="module")
def reference(engine, prompts):
    """Greedy autoregressive tokens of prompts[0]: what every speculative run must give, and what the engine
    must still give after each refused request."""
    return engine.generate(prompts[0], NUM_NEW).tokens


def still_works(engine, prompts, reference) -> bool:
    return engine.generate(prompts[0], NUM_NEW, StaticController(3)).tokens == reference


# ----------------------------------------------------------------------------------------- the caps
def test_cap_arithmetic():
    assert [tree_size(3, d) for d in range(4)] == [0, 3, 12, 21]
    assert tree_size(1, 7) == 7  # a chain: one node per level
    for width in (1, 2, 4, 16, 181, 272):
        for cap in (1, 10, 100, 32767):
            d = depth_limit(width, cap)
            assert tree_size(width, d) <= cap < tree_size(width, d + 1) or (d == 0 and width > cap)
    # every verification (root + at most MAX_VERIFY_NODES nodes) runs in row-wise attention
    assert EngineConfig().max_verify == MAX_VERIFY_NODES and MAX_VERIFY_NODES + 1 <= MAX_ROWWISE_ROWS


def test_huge_tree_request_is_capped_and_exact(engine, prompts, reference):
    """The issue's probe: StaticController(2, 10**6, tree_width=272) asked for a 74k-node tree and a 74k-node
    verification. The node cap keeps it at depth 1 (272 nodes), the verify cap at 64 nodes; output exact."""
    res = engine.generate(prompts[0], NUM_NEW, StaticController(2, 10**6, tree_width=272))
    assert res.tokens == reference
    spec = [c for c in res.cycles if c.depth > 0]
    assert spec and all(
        c.depth == 1 and c.num_drafted == 272 and c.num_verified == MAX_VERIFY_NODES for c in spec
    )


PROBE = textwrap.dedent("""
    import resource, sys
    limit = 2 * 2**30  # 2 GiB of address space: the 74k x 74k masks need > 5 GiB
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch
    torch.set_num_threads(1)
    from engine.backends.models import load_pair
    from engine.control import StaticController
    from engine.engine import SpeculativeEngine
    from engine.inputs import EngineConfig
    config = EngineConfig()
    if sys.argv[1] == "uncapped":  # negative control: the engine as it was (no node cap, no verify cap)
        import engine.engine as ee
        ee.clamp_verify = lambda n, drafted, cap: min(max(int(n), 0), drafted)
        config = EngineConfig(max_tree_nodes=10**6)
    pair = load_pair("tiny", dtype=torch.float32, device="cpu")
    res = SpeculativeEngine(pair, config=config).generate("def main():", 8, StaticController(2, 10**6, tree_width=272))
    print("done", max(c.num_drafted for c in res.cycles), max(c.num_verified for c in res.cycles))
""")


def _probe(mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )


def test_caps_hold_under_a_memory_limit():
    capped = _probe("capped")
    assert capped.returncode == 0, capped.stderr[-2000:]
    assert "done 272 64" in capped.stdout
    uncapped = _probe("uncapped")  # the same request without the caps cannot run in that memory
    assert uncapped.returncode != 0 and "MemoryError" in uncapped.stderr, (
        uncapped.stdout + uncapped.stderr[-2000:]
    )


class Recorder(StaticController):
    """A static tree that records the depth cap the engine shows it."""

    def reset(self):
        self.caps = []

    def should_continue(self, state):
        self.caps.append(state.max_depth)
        return super().should_continue(state)


def test_smaller_caps_hold_and_are_shown_to_the_controller(tiny_pair, prompts, reference):
    config = EngineConfig(max_verify=3, max_tree_nodes=10)  # width 2: 2 + 4 + 4 = 10 nodes at depth 3
    ctrl = Recorder(6, 100, tree_width=2)
    res = SpeculativeEngine(tiny_pair, config=config).generate(prompts[0], NUM_NEW, ctrl)
    assert res.tokens == reference
    assert all(c.depth <= 3 and c.num_drafted <= 10 and c.num_verified <= 3 for c in res.cycles)
    assert any(c.depth == 3 for c in res.cycles) and any(c.num_verified == 3 for c in res.cycles)
    assert max(ctrl.caps) <= 3


def test_replay_applies_the_same_caps(tiny_pair, prompts):
    """Replay with the engine's caps reproduces the live cycles one for one; without them it does not (the
    negative control: the caps change what is verified)."""
    max_depth, config = 5, EngineConfig(max_depth=5, max_verify=3, max_tree_nodes=10)
    ids = tiny_pair.encode(prompts[0], chat=False)
    trace = record_trace(tiny_pair, ids, "p", SamplingConfig(), max_depth, 2, max_new_tokens=24)
    capped = ReplayTrace(trace, engine_max_depth=max_depth, engine_max_verify=3, engine_max_tree_nodes=10)
    plain = ReplayTrace(trace, engine_max_depth=max_depth)

    def cycles(records):
        return [(r.depth, r.num_drafted, r.num_verified, r.accepted, r.emitted) for r in records]

    ctrl = StaticController(5, 8, tree_width=2)
    live = SpeculativeEngine(tiny_pair, config=config).generate(ids, 24, ctrl)
    assert cycles(replay_generate(capped, ctrl)) == cycles(live.cycles)
    assert cycles(replay_generate(plain, ctrl)) != cycles(live.cycles)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_verify": 0}, "max_verify"),
        ({"max_verify": MAX_VERIFY_NODES + 1}, "max_verify"),
        ({"max_verify": 2.5}, "max_verify"),
        ({"max_verify": True}, "max_verify"),
        ({"max_tree_nodes": 0}, "max_tree_nodes"),
        ({"max_depth": 0}, "max_depth"),
        ({"draft_mode": "beam"}, "draft_mode"),
    ],
)
def test_bad_engine_config(kwargs, match):
    with pytest.raises(InputError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "width, config, match",
    [
        (273, EngineConfig(), r"tree_width 273 exceeds the vocabulary \(272 tokens\)"),
        (10**6, EngineConfig(), "exceeds the vocabulary"),
        (20, EngineConfig(max_tree_nodes=16), "max_tree_nodes=16"),
    ],
)
def test_tree_width_beyond_vocab_or_node_cap(tiny_pair, prompts, reference, width, config, match):
    engine = SpeculativeEngine(tiny_pair, config=config)
    with pytest.raises(ControllerError, match=match):
        engine.generate(prompts[0], 5, StaticController(2, 4, tree_width=width))
    assert still_works(engine, prompts, reference)


# ---------------------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize(
    "prompt, match",
    [
        ([1.0, 2.0], "integers"),
        ([65, 66.7], "integers"),
        ([1, None], "integers"),
        ([[1, 2, 3]], "integers"),
        ([True, 5], "integers"),
        (torch.tensor([1.0, 2.0]), "dtype"),
        (torch.tensor([True, False]), "dtype"),
        (np.array([1.5, 2.0]), "dtype"),
        (torch.tensor([[1, 2], [3, 4]]), r"shape \(2, 2\)"),
        (torch.ones(1, 1, 3, dtype=torch.long), "shape"),
        (torch.tensor(5), "shape"),
        (None, "NoneType"),
        ({1: 2}, "dict"),
        (b"abc", "bytes"),
        (3, "int"),
    ],
)
def test_bad_prompts(engine, prompts, reference, prompt, match):
    with pytest.raises(InputError, match=match) as info:
        engine.generate(prompt, 5, StaticController(3))
    assert "prompt" in str(info.value)
    assert still_works(engine, prompts, reference)


def test_integer_prompt_forms_are_accepted(engine, tiny_pair, prompts, reference):
    ids = tiny_pair.tokenizer.encode(prompts[0])
    for prompt in (
        ids,
        tuple(ids),
        np.asarray(ids),
        np.asarray([ids], dtype=np.int32),
        torch.tensor(ids),
        torch.tensor([ids], dtype=torch.int32),
        [np.int64(t) for t in ids],
    ):
        assert engine.generate(prompt, NUM_NEW, StaticController(3)).tokens == reference


# ------------------------------------------------------------------------------------------------ seeds
@pytest.mark.parametrize("seed", [1.5, None, 2**64, -1, True, "3", np.float64(2.0)])
def test_bad_seeds(engine, prompts, reference, seed):
    with pytest.raises(InputError, match="seed"):
        engine.generate(prompts[0], 5, StaticController(3), seed=seed)
    assert still_works(engine, prompts, reference)


def test_seed_range_edges_are_accepted(tiny_pair, prompts):
    sampled = SpeculativeEngine(tiny_pair, SamplingConfig(temperature=1.0))
    for seed in (0, np.int64(7), 2**64 - 1):
        first = sampled.generate(prompts[0], 6, StaticController(2), seed=seed).tokens
        assert sampled.generate(prompts[0], 6, StaticController(2), seed=seed).tokens == first  # reproducible


# ------------------------------------------------------------------------------------------ controllers
class Answering(Controller):
    """Answers ``depth`` to should_continue and ``size`` to num_to_verify."""

    def __init__(self, depth=True, size=2, tree_width=1, depth_zero=False):
        self.depth, self.size, self.tree_width, self.decides_depth_zero = depth, size, tree_width, depth_zero

    def should_continue(self, state):
        return self.depth if state.depth < 2 else False

    def num_to_verify(self, state):
        return self.size


@pytest.mark.parametrize(
    "controller, match",
    [
        (Answering(depth=None), r"Answering\.should_continue must return a bool, got None"),
        (Answering(depth=math.nan), "should_continue must return a bool, got nan"),
        (Answering(depth=np.array([True, False])), "should_continue must return a bool"),
        (Answering(depth="yes"), "should_continue must return a bool"),
        (Answering(depth=2), "should_continue must return a bool, got 2"),
        (Answering(depth=None, depth_zero=True), "should_continue must return a bool"),
        (Answering(size=None), r"Answering\.num_to_verify must return an integer, got None"),
        (Answering(size=math.nan), "num_to_verify must return an integer, got nan"),
        (Answering(size=2.5), "num_to_verify must return an integer"),
        (Answering(size=np.array([3])), "num_to_verify must return an integer"),
        (Answering(size=torch.tensor(3)), "num_to_verify must return an integer"),
    ],
)
def test_bad_controller_answers(engine, prompts, reference, controller, match):
    with pytest.raises(ControllerError, match=match):
        engine.generate(prompts[0], NUM_NEW, controller)
    assert still_works(engine, prompts, reference)


def test_good_controller_answer_types(engine, prompts, reference):
    for ctrl in (
        Answering(depth=np.bool_(True), size=np.int64(2)),
        Answering(depth=1, size=np.int32(1)),
        Answering(depth=0, size=-3),
    ):  # negative sizes are clamped to 0, as documented
        assert engine.generate(prompts[0], NUM_NEW, ctrl).tokens == reference


class DuckController:
    """Has the methods but is not an engine.Controller."""

    tree_width = 1
    decides_depth_zero = False

    def reset(self):
        pass

    def should_continue(self, state):
        return False

    def num_to_verify(self, state):
        return 1

    def observe(self, record):
        pass


@pytest.mark.parametrize("controller", [DuckController(), "static", 4, StaticController])
def test_non_controllers_are_refused(engine, prompts, reference, controller):
    with pytest.raises(ControllerError, match="controller must be an engine.Controller"):
        engine.generate(prompts[0], 5, controller)
    assert still_works(engine, prompts, reference)


def test_replay_checks_controller_answers_like_the_engine(tiny_pair, prompts):
    ids = tiny_pair.encode(prompts[0], chat=False)
    rt = ReplayTrace(record_trace(tiny_pair, ids, "p", SamplingConfig(), 3, 1, max_new_tokens=10))
    for ctrl, match in (
        (Answering(depth=None), "should_continue"),
        (Answering(size=math.nan), "num_to_verify"),
    ):
        with pytest.raises(ControllerError, match=match):
            replay_generate(rt, ctrl)


def test_every_refusal_is_a_draftpilot_error(engine, prompts):
    for call in (
        lambda: engine.generate([1.5], 5),
        lambda: engine.generate(prompts[0], 5, seed=None),
        lambda: engine.generate(prompts[0], 5, Answering(size=None)),
        lambda: engine.generate(prompts[0], 5, DuckController()),
        lambda: SamplingConfig(temperature=math.inf),
        lambda: EngineConfig(max_verify=100),
    ):
        with pytest.raises(DraftpilotError):
            call()
