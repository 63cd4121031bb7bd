"""Trace recording (envs.record_traces): the recorded tree at a position is the tree the engine drafts live there
(docs/design.md section 3), recording resumes, bad trace files fail loudly, and the command line runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.sampling import SamplingConfig
from envs.draft_trees import draft_trees
from envs.record_traces import main, record_prompts, record_trace
from envs.recording import load_traces, read_prompts
from envs.trace import FORMAT_VERSION, Trace, TraceError

NUM_NEW = 32
MAX_DEPTH = 6
SAMPLINGS = {"greedy": SamplingConfig(temperature=0.0), "t0.8-k20": SamplingConfig(temperature=0.8, top_k=20)}
SMALL = {"max_depth": 3, "tree_width": 2, "max_new_tokens": 12, "progress": False}


def live_trees(pair, sampling, prompt_ids, controller, seed, monkeypatch):
    """Generate live and capture (context_len, DraftTree) of every cycle from the engine's own ``_draft``."""
    captured = []
    original = SpeculativeEngine._draft

    def capture(self, req, ctrl, cap):
        context_len = len(req.tokens)
        out = original(self, req, ctrl, cap)
        captured.append((context_len, out[0]))
        return out

    monkeypatch.setattr(SpeculativeEngine, "_draft", capture)
    res = SpeculativeEngine(pair, sampling).generate(prompt_ids, NUM_NEW, controller, seed=seed)
    monkeypatch.undo()
    return res.tokens, captured


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_recorded_tree_equals_live_tree(tiny_pair, monkeypatch, width, sampling_name):
    sampling = SAMPLINGS[sampling_name]
    prompt_ids = tiny_pair.tokenizer.encode("def main():")
    # chunk=7: several chunks, so nodes shared across positions meet chunk boundaries
    trace = record_trace(tiny_pair, prompt_ids, "p", sampling, MAX_DEPTH, width, NUM_NEW, seed=3, chunk=7)
    assert trace.num_positions == NUM_NEW and trace.prompt_len == len(prompt_ids)
    assert np.all(np.diff(trace.node_offsets) == width + (MAX_DEPTH - 1) * width * width)
    # verify=0 drafts a full tree at every position; the other controller leaves pending draft tokens
    for controller in (StaticController(MAX_DEPTH, 0, width), StaticController(4, 6, width)):
        tokens, cycles = live_trees(tiny_pair, sampling, prompt_ids, controller, 3, monkeypatch)
        # each emitted token is one draw from the target law, whatever the controller: same trajectory
        assert tokens == trace.tokens.tolist()
        assert len(cycles) >= 8
        for context_len, live in cycles:
            t = context_len - trace.prompt_len - 1
            node_tokens, parents, depths, scores = trace.nodes(t)
            n = len(live)  # nodes are created level by level: the live tree is a prefix of the recorded one
            assert np.all(depths[:n] <= max(live.depths)) and np.all(depths[n:] > max(live.depths)), t
            assert node_tokens[:n].tolist() == live.tokens, t
            assert parents[:n].tolist() == live.parents, t
            assert depths[:n].tolist() == live.depths, t
            np.testing.assert_allclose(scores[:n], live.scores, rtol=0, atol=1e-6)
    assert trace.meta["tree_width"] == width and trace.meta["max_depth"] == MAX_DEPTH
    assert trace.meta["sampling"]["temperature"] == sampling.temperature


def test_sharing_nodes_across_positions_changes_nothing(tiny_pair):
    """chunk=1 forwards every node of every position itself; larger chunks share identical nodes."""
    prompt_ids = tiny_pair.tokenizer.encode("The quick brown fox")
    tokens = SpeculativeEngine(tiny_pair).generate(prompt_ids, 24).tokens
    sampling = SamplingConfig()
    alone = draft_trees(tiny_pair, prompt_ids, tokens, sampling, 5, 3, chunk=1)
    for chunk in (5, 64):
        shared = draft_trees(tiny_pair, prompt_ids, tokens, sampling, 5, 3, chunk=chunk)
        for a, b in zip(alone, shared):
            assert (a.tokens, a.parents, a.depths) == (b.tokens, b.parents, b.depths)
            np.testing.assert_allclose(a.scores, b.scores, rtol=0, atol=1e-9)


def test_trace_meta(tiny_pair):
    trace = record_trace(
        tiny_pair,
        [1, 2, 3],
        "m",
        SamplingConfig(0.5, 0, 0.9),
        2,
        2,
        5,
        seed=7,
        sample=2,
        extra_meta={"language": "it"},
    )
    meta = trace.meta
    assert meta["pair"] == "tiny" and meta["dtype"] == "float64" and meta["draft_mode"] == "deterministic"
    assert meta["sampling"] == {"temperature": 0.5, "top_k": 0, "top_p": 0.9}
    assert (meta["seed"], meta["sample"], meta["language"], meta["prompt_ids"]) == (7, 2, "it", [1, 2, 3])
    assert meta["finish_reason"] in ("eos", "length") and meta["eos_token_ids"] == [256]
    assert meta["max_context"] == 1024 and meta["max_new_tokens"] == 5


def test_resume_skips_matching_traces_and_rerecords_others(tiny_pair, tmp_path):
    prompts = [{"id": "a", "prompt": "def f():"}, {"id": "b", "prompt": "x = 1", "language": "en"}]
    first = record_prompts(tiny_pair, prompts[:1], tmp_path, SamplingConfig(), **SMALL)
    assert (first.recorded, first.skipped) == (1, 0) and first.positions == 12
    path_a = tmp_path / "a__s0.npz"
    stamp = path_a.stat().st_mtime_ns

    second = record_prompts(tiny_pair, prompts, tmp_path, SamplingConfig(), **SMALL)
    assert (second.recorded, second.skipped) == (1, 1)
    assert path_a.stat().st_mtime_ns == stamp  # not recomputed
    assert load_traces(tmp_path)[1].meta["language"] == "en"

    (tmp_path / "b__s0.npz").write_bytes(b"not a trace")  # corrupt: recorded again
    third = record_prompts(tiny_pair, prompts, tmp_path, SamplingConfig(), **{**SMALL, "tree_width": 3})
    assert (third.recorded, third.skipped) == (2, 0)  # other meta: both recorded again
    assert [t.meta["tree_width"] for t in load_traces(tmp_path)] == [3, 3]

    fourth = record_prompts(
        tiny_pair, prompts, tmp_path, SamplingConfig(), samples_per_prompt=2, **{**SMALL, "tree_width": 3}
    )
    assert (fourth.recorded, fourth.skipped) == (2, 2)
    assert sorted(p.name for p in tmp_path.glob("*.npz")) == [
        "a__s0.npz",
        "a__s1.npz",
        "b__s0.npz",
        "b__s1.npz",
    ]


@pytest.fixture(scope="module")
def good_trace(tiny_pair) -> Trace:
    return record_trace(tiny_pair, [5, 6, 7], "g", SamplingConfig(), 3, 2, 8, seed=0)


def _resave(path, trace: Trace, **changes):
    """Write ``trace`` with raw field changes (bypassing Trace.save, which always writes a valid version)."""
    fields = {
        "prompt_id": np.asarray(trace.prompt_id),
        "prompt_len": np.asarray(trace.prompt_len),
        "tokens": trace.tokens,
        "node_offsets": trace.node_offsets,
        "node_tokens": trace.node_tokens,
        "node_parents": trace.node_parents,
        "node_depths": trace.node_depths,
        "node_scores": trace.node_scores,
        "meta": np.asarray(json.dumps({**trace.meta, "format_version": FORMAT_VERSION})),
    }
    np.savez_compressed(path, **{**fields, **changes})


def test_bad_trace_files_raise_trace_error(good_trace, tmp_path):
    with pytest.raises(TraceError, match="not found"):
        load_traces(tmp_path / "missing")
    with pytest.raises(TraceError, match="no trace files"):
        load_traces(tmp_path)
    good_trace.save(tmp_path / "ok.npz")
    assert len(load_traces(tmp_path)) == 1
    blob = (tmp_path / "ok.npz").read_bytes()
    offsets = good_trace.node_offsets.copy()
    offsets[-1] += 1
    parents = good_trace.node_parents.copy()
    parents[0] = 3
    bad = {
        "truncated": (lambda p: p.write_bytes(blob[: len(blob) // 2]), "truncated or corrupt"),
        "empty": (lambda p: p.write_bytes(b""), "truncated or corrupt"),
        "garbage": (lambda p: p.write_bytes(b"\x00garbage" * 50), "not a readable trace"),
        "version": (
            lambda p: _resave(p, good_trace, meta=np.asarray(json.dumps({"format_version": 99}))),
            "format version 99",
        ),
        "offsets": (lambda p: _resave(p, good_trace, node_offsets=offsets), "node_offsets"),
        "parents": (lambda p: _resave(p, good_trace, node_parents=parents), "parent does not precede"),
        "missing_field": (lambda p: np.savez(p, tokens=good_trace.tokens), "not a readable trace"),
    }
    for name, (write, message) in bad.items():
        case = tmp_path / name
        case.mkdir()
        write(case / f"{name}.npz")
        with pytest.raises(TraceError, match=message):
            load_traces(case)


def test_read_prompts_rejects_bad_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    for text, message in (
        ("", "no prompts"),
        ("{oops", "not JSON"),
        ('{"id": "a"}', "needs an 'id'"),
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}', "duplicate"),
        ('{"id": "a/b", "prompt": "x"}', "file name"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_prompts(path)


def test_command_line_end_to_end(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "en1", "prompt": "def add(a, b):", "language": "en", "task": "code"})
        + "\n\n"
        + json.dumps({"id": "it1", "prompt": "Ciao"})
        + "\n"
    )
    out = tmp_path / "traces"
    argv = [
        "--pair",
        "tiny",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--dtype",
        "float64",
        "--device",
        "cpu",
        "--max-new-tokens",
        "10",
        "--max-depth",
        "3",
        "--tree-width",
        "2",
        "--temperature",
        "0.7",
        "--top-k",
        "30",
        "--samples-per-prompt",
        "2",
        "--raw",
        "--no-progress",
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "recorded=4" in printed and "positions/min=" in printed
    traces = load_traces(out)
    assert [(t.prompt_id, t.meta["sample"]) for t in traces] == [
        ("en1", 0),
        ("en1", 1),
        ("it1", 0),
        ("it1", 1),
    ]
    assert (
        traces[0].meta["language"] == "en"
        and traces[0].meta["task"] == "code"
        and "language" not in traces[2].meta
    )
    assert traces[0].meta["prompt_ids"] == list(b"def add(a, b):")  # --raw: no chat template
    assert main(argv) == 0 and "recorded=0 kept=4" in capsys.readouterr().out
    assert main([*argv[:3], str(tmp_path / "nope.jsonl"), *argv[4:]]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_prompts_recorded_together_hold_the_traces_recorded_alone(tiny_pair, tmp_path, sampling_name):
    """``record_prompts`` decodes the trajectories of several traces in one batch (``batched_trajectories``):
    every trace it writes (prompts of different lengths, two samples each) equals the one ``record_trace``
    records alone with that prompt and seed, tokens and trees; a sampled trajectory drawn with another seed
    differs (negative control)."""
    sampling = SAMPLINGS[sampling_name]
    items = [
        {"id": f"p{i}", "prompt": text} for i, text in enumerate(("def f(x):", "a", "The quick brown fox"))
    ]
    summary = record_prompts(tiny_pair, items, tmp_path, sampling, samples_per_prompt=2, seed=4, **SMALL)
    assert summary.recorded == 6
    settings = {k: SMALL[k] for k in ("max_depth", "tree_width", "max_new_tokens")}
    for path in summary.paths:
        got = Trace.load(path)
        ids = got.meta["prompt_ids"]
        alone = record_trace(tiny_pair, ids, got.prompt_id, sampling, seed=got.meta["seed"], **settings)
        assert got.tokens.tolist() == alone.tokens.tolist()
        for name in ("node_offsets", "node_tokens", "node_parents", "node_depths"):
            assert np.array_equal(getattr(got, name), getattr(alone, name)), name
        assert got.meta["trajectory_controller"]["batched"] > 1
    if sampling.temperature:
        other = record_trace(tiny_pair, ids, "x", sampling, seed=got.meta["seed"] + 10, **settings)
        assert other.tokens.tolist() != got.tokens.tolist()
