"""benchmarks/foresight.py: the acceptance samples agree with replay's own accepted lengths, the in-sample
calibration recovers a known acceptance law, the foresight controllers draft exactly what they were told
(and a controller told another trace's future does not), the oracle bounds every row, and the CLI runs on
the tiny pair's chain policy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))  # tests_envs_helpers

from engine.control import StaticController  # noqa: E402
from envs.oracle import oracle_throughput  # noqa: E402
from envs.replay import ReplayTrace, replay_generate, throughput  # noqa: E402
from envs.trace import Trace  # noqa: E402
from tests_envs_helpers import LinearProfile  # noqa: E402
from tests_evaluation_helpers import CACHE, load_benchmark  # noqa: E402

foresight = load_benchmark("foresight")


def chain_trace(seed: int, length: int = 120, depth: int = 6, vocab: int = 40) -> Trace:
    """A chain trace whose draft is right with the probability it states: the k-th drafted token follows the
    trajectory with probability p (its recorded conditional probability) while its predecessors did."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=length).astype(np.int32)
    offsets, toks, parents, depths, scores = [0], [], [], [], []
    for t in range(length):
        score, on_path = 0.0, True
        for k in range(1, depth + 1):
            p = float(rng.uniform(0.05, 1.0))
            target = t + k
            truth = int(tokens[target]) if target < length else int(rng.integers(vocab))
            follow = on_path and target < length and rng.random() < p
            toks.append(truth if follow else (truth + 1) % vocab)
            parents.append(-1 if k == 1 else k - 2)
            depths.append(k)
            score += float(np.log(p))
            scores.append(score)
            on_path = follow
        offsets.append(offsets[-1] + depth)
    meta = {"tree_width": 1, "max_depth": depth, "max_new_tokens": length, "max_context": 10_000}
    return Trace(
        prompt_id=f"chain-{seed}",
        prompt_len=7,
        tokens=tokens,
        node_offsets=np.asarray(offsets, dtype=np.int64),
        node_tokens=np.asarray(toks, dtype=np.int32),
        node_parents=np.asarray(parents, dtype=np.int16),
        node_depths=np.asarray(depths, dtype=np.int8),
        node_scores=np.asarray(scores, dtype=np.float32),
        meta=meta,
    )


@pytest.fixture(scope="module")
def traces() -> list[ReplayTrace]:
    out = [ReplayTrace(chain_trace(seed)) for seed in range(4)]
    for rt in out:
        rt.trace.validate()
    return out


def test_acceptance_samples_agree_with_replay(traces):
    depths, probs, accepted = foresight.acceptance_samples(traces)
    runs = [len(rt.position(t).zpath) for rt in traces for t in range(len(rt.trace.tokens) - 1)]
    assert accepted.sum() == sum(runs)
    # one sample per accepted token plus the first rejected one, unless the whole chain was accepted
    assert len(accepted) == sum(min(r + 1, rt.max_depth) for r, rt in zip(runs, _owners(traces)))
    assert np.all((probs > 0) & (probs <= 1)) and depths.min() == 1 and depths.max() == 6


def _owners(traces):
    return [rt for rt in traces for _ in range(len(rt.trace.tokens) - 1)]


def test_calibration_recovers_a_known_law():
    rng = np.random.default_rng(0)
    n = 200_000
    depths = rng.integers(1, 9, size=n)
    probs = rng.uniform(0.0, 1.0, size=n)
    law = np.where(depths == 1, probs, 0.5 * probs)
    accepted = (rng.random(n) < law).astype(float)
    cal = foresight.Calibration(depths, probs, accepted)
    grid = np.array([0.1, 0.3, 0.5, 0.7, 0.9])
    assert cal(np.ones(5, dtype=int), grid) == pytest.approx(grid, abs=0.05)
    assert cal(np.full(5, 4), grid) == pytest.approx(0.5 * grid, abs=0.05)
    # a calibration fitted on shuffled outcomes has no slope: the fit reads the outcomes, not the inputs
    flat = foresight.Calibration(depths, probs, rng.permutation(accepted))
    assert np.ptp(flat(np.ones(5, dtype=int), grid)) < 0.05


def _walk(rt, records):
    """(position, record) of every cycle."""
    t = 0
    for rec in records:
        yield t, rec
        t += rec.emitted


def test_length_foresight_drafts_exactly_the_accepted_run(traces):
    profile = LinearProfile()
    for rt in traces:
        ctrl = foresight.Foresight(StaticController(3, 3), rt, "length")
        records = replay_generate(rt, ctrl, profile)
        for t, rec in _walk(rt, records):
            run = len(rt.position(t).zpath)
            if rec.depth == 0:  # nothing would be accepted, or the budget leaves no room to draft
                assert run == 0 or rt.depth_cap(t) < 1
            else:
                assert rec.accepted == rec.depth == min(run, rt.depth_cap(t))


def test_first_token_foresight_drafts_only_when_the_first_token_is_accepted(traces):
    profile = LinearProfile()
    drafted = 0
    for rt in traces:
        records = replay_generate(rt, foresight.Foresight(StaticController(3, 3), rt, "first"), profile)
        for t, rec in _walk(rt, records):
            assert (rec.depth > 0) == (len(rt.position(t).zpath) > 0 and rt.depth_cap(t) >= 1)
            if rec.depth > 0:
                drafted += 1
                assert rec.accepted >= 1 and rec.depth == min(3, rt.depth_cap(t))
    assert drafted > 0


def test_foresight_of_another_trace_is_not_foresight(traces):
    """Negative control: told the future of another trace, the controller drafts runs that are rejected."""
    profile = LinearProfile()
    rt, other = traces[0], traces[1]
    records = replay_generate(rt, foresight.Foresight(StaticController(3, 3), other, "length"), profile)
    assert any(rec.depth > 0 and rec.accepted < rec.depth for rec in records)


def test_the_oracle_bounds_the_foresight_rows(traces):
    profile = LinearProfile()
    oracle = oracle_throughput(traces, profile)
    for mode in ("first", "length"):
        rows = [
            replay_generate(rt, foresight.Foresight(StaticController(3, 3), rt, mode), profile)
            for rt in traces
        ]
        assert throughput(rows) <= oracle * (1 + 1e-9)
    length = throughput(
        [
            replay_generate(rt, foresight.Foresight(StaticController(3, 3), rt, "length"), profile)
            for rt in traces
        ]
    )
    static = throughput([replay_generate(rt, StaticController(3, 3), profile) for rt in traces])
    assert length > static  # knowing the accepted run is worth something on these traces


def test_cli_on_the_tiny_chain_policy(workdir, tiny_chain_policy, tmp_path):
    out = tmp_path / "foresight.json"
    rc = foresight.main(
        [
            "--policy",
            str(tiny_chain_policy),
            "--prompts-per-language",
            "1",
            "--tune-prompts-per-language",
            "1",
        ]
        + ["--cache-dir", str(workdir / CACHE), "--out", str(out)]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert list(rows)[0] == "autoregressive" and list(rows)[-1] == "oracle"
    assert {"learned", "calibrated analytic (in sample)", "length foresight (draft L, verify L)"} <= set(rows)
    assert all(v > 0 for v in rows.values())
    assert all(rows["oracle"] >= v * (1 - 1e-9) for v in rows.values())
    assert data["lookup"] == "off"


def test_a_tree_policy_is_refused(tiny_policy, capsys):
    with pytest.raises(SystemExit) as err:
        foresight.main(["--policy", str(tiny_policy)])
    assert err.value.code == 2 and "chain" in capsys.readouterr().err
