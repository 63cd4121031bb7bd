"""``python -m envs.record_traces`` checks its arguments, prompts and --out before any model loads (issue 14): nothing
recorded is never a success, a null id never becomes a file ``None__s0.npz``, and an --out holding traces
recorded with other settings is refused (one ``error:`` line, traces untouched) unless ``--overwrite``."""

from __future__ import annotations

import json

import pytest

from engine.backends.files import DirectoryBusyError, DirectoryLock
from engine.errors import InputError
from engine.sampling import SamplingConfig
from envs.draft_trees import draft_trees
from envs.record_traces import main, record_prompts
from envs.recording import RecordError, load_traces, read_prompts
from tests_helpers import one_error_line

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"id": "a", "prompt": "def f():"}) + "\n" + json.dumps({"id": 7, "prompt": "x"}) + "\n"
    )
    return path


def argv(prompts, out, *extra):
    return [
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
        "8",
        "--max-depth",
        "2",
        "--tree-width",
        "2",
        "--raw",
        "--no-progress",
        *extra,
    ]


@pytest.fixture()
def no_models(monkeypatch):
    # every command line loads its pair through engine.cli.ModelConfig.load
    monkeypatch.setattr(
        "engine.cli.load_pair", lambda *a, **k: pytest.fail("models loaded before the checks")
    )


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--samples-per-prompt", "0"], ["--samples-per-prompt"]),
        (["--chunk", "0"], ["--chunk"]),
        (["--max-depth", "0"], ["--max-depth"]),
        (["--max-depth", "200"], ["trace format"]),
        (["--tree-width", "0"], ["--tree-width"]),
        (["--tree-width", "200"], ["trace format"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--seed", "-1"], ["--seed"]),
        (["--threads", "-1"], ["--threads"]),
        (["--temperature", "-0.5"], ["temperature"]),
        (["--device", "bogus"], ["--device"]),
        (["--draft-weights", "int2"], ["--draft-weights"]),
    ],
)
def test_bad_arguments_fail_before_the_models_load(prompts_file, tmp_path, capsys, no_models, extra, needles):
    out = tmp_path / "traces"
    assert main(argv(prompts_file, out, *extra)) == 2
    one_error_line(capsys, *needles)
    assert not out.exists() or not list(out.iterdir())


def test_unknown_pair_fails_before_the_models_load(prompts_file, tmp_path, capsys, no_models):
    assert (
        main([*argv(prompts_file, tmp_path / "t")[:1], "nope", *argv(prompts_file, tmp_path / "t")[2:]]) == 2
    )
    one_error_line(capsys, "--pair", "'nope'")


@pytest.mark.parametrize(
    "line, needles",
    [
        ({"id": None, "prompt": "x"}, ["prompt id must be a string or an integer, got None"]),
        ({"id": 1.5, "prompt": "x"}, ["got 1.5"]),
        ({"id": True, "prompt": "x"}, ["got True"]),
        ({"id": ["a"], "prompt": "x"}, ["got ['a']"]),
        ({"id": -1, "prompt": "x"}, ["'-1'", "file name"]),
        ({"id": "a", "prompt": None}, ["string 'prompt'"]),
    ],
)
def test_bad_prompt_ids_fail_before_the_models_load(tmp_path, capsys, no_models, line, needles):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(line) + "\n")
    out = tmp_path / "traces"
    assert main(argv(path, out)) == 2
    one_error_line(capsys, *needles)
    assert not (out / "None__s0.npz").exists()


def test_unusable_files_are_one_error_line(prompts_file, tmp_path, capsys, no_models):
    assert main(argv(tmp_path, tmp_path / "t")) == 2  # --prompts is a directory: an OSError
    one_error_line(capsys, str(tmp_path))
    assert main(argv(tmp_path / "missing.jsonl", tmp_path / "t")) == 2
    one_error_line(capsys, "missing.jsonl")
    (tmp_path / "a-file").write_text("x")
    assert main(argv(prompts_file, tmp_path / "a-file")) == 2  # --out is a file
    one_error_line(capsys, "--out", "not a directory")


def test_library_refuses_what_the_command_line_refuses(tiny_pair, tmp_path):
    sampling = SamplingConfig()
    for kwargs, match in (
        ({"samples_per_prompt": 0}, "samples_per_prompt"),
        ({"chunk": 0}, "chunk"),
        ({"max_depth": 0}, "max_depth"),
        ({"seed": 1.5}, "seed"),
    ):
        with pytest.raises(InputError, match=match):
            record_prompts(tiny_pair, [{"id": "a", "prompt": "x"}], tmp_path / "lib", sampling, **kwargs)
    with pytest.raises(InputError, match="chunk"):  # was an AssertionError
        draft_trees(tiny_pair, [1, 2], [3, 4], sampling, 2, 2, chunk=0)
    with pytest.raises(RecordError, match="got None"):
        read_prompts_from(tmp_path, [{"id": None, "prompt": "x"}])
    assert not (tmp_path / "lib").exists() or not list((tmp_path / "lib").iterdir())


def read_prompts_from(tmp_path, items):
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return read_prompts(path)


def test_integer_ids_name_their_files(prompts_file, tmp_path, capsys):
    out = tmp_path / "traces"
    assert main(argv(prompts_file, out)) == 0
    assert sorted(p.name for p in out.glob("*.npz")) == ["7__s0.npz", "a__s0.npz"]


def test_other_settings_in_out_are_refused_unless_overwrite(prompts_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "traces"
    assert main(argv(prompts_file, out)) == 0
    capsys.readouterr()
    stamps = {p.name: p.read_bytes() for p in out.glob("*.npz")}

    # settings the command line knows before loading: refused without loading the models
    with monkeypatch.context() as m:
        m.setattr("engine.cli.load_pair", lambda *a, **k: pytest.fail("models loaded before the --out check"))
        assert main(argv(prompts_file, out, "--tree-width", "3")) == 2
        one_error_line(capsys, "--out", "other settings", "tree_width", "--overwrite")
        assert main(argv(prompts_file, out, "--seed", "4")) == 2
        one_error_line(capsys, "seed")
    # settings known after loading (the weight format): refused before anything is recorded
    assert main([*argv(prompts_file, out), "--dtype", "float32"]) == 2
    one_error_line(capsys, "dtype", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.glob("*.npz")} == stamps  # nothing recorded over

    # the same settings resume (negative control), --overwrite records again
    assert main(argv(prompts_file, out)) == 0 and "recorded=0 kept=2" in capsys.readouterr().out
    assert main(argv(prompts_file, out, "--tree-width", "3", "--overwrite")) == 0
    assert "recorded=2" in capsys.readouterr().out
    assert [t.meta["tree_width"] for t in load_traces(out)] == [3, 3]


def test_library_refusal_of_other_settings(tiny_pair, tmp_path):
    small = {"max_depth": 2, "tree_width": 2, "max_new_tokens": 8, "progress": False}
    prompts = [{"id": "a", "prompt": "def f():"}]
    record_prompts(tiny_pair, prompts, tmp_path, SamplingConfig(), **small)
    before = (tmp_path / "a__s0.npz").read_bytes()
    with pytest.raises(RecordError, match="other settings"):
        record_prompts(
            tiny_pair,
            prompts,
            tmp_path,
            SamplingConfig(),
            replace_mismatched=False,
            **{**small, "max_depth": 3},
        )
    assert (tmp_path / "a__s0.npz").read_bytes() == before
    summary = record_prompts(
        tiny_pair, prompts, tmp_path, SamplingConfig(), replace_mismatched=False, **small
    )
    assert (summary.recorded, summary.skipped) == (0, 1)  # same settings: resumed, not refused


def test_a_second_recorder_into_one_out_fails_at_once(tiny_pair, tmp_path):
    """Two recorders into one --out must not mix: the second is refused while the first holds it, and
    nothing is written; a cache directory (replace_mismatched) is shared, its traces written atomically."""
    small = {"max_depth": 2, "tree_width": 2, "max_new_tokens": 8, "progress": False}
    prompts = [{"id": "a", "prompt": "def f():"}]
    out = tmp_path / "out"
    with DirectoryLock(out, "--out"):  # the first recorder, mid-run
        with pytest.raises(DirectoryBusyError, match="--out .* in use"):
            record_prompts(tiny_pair, prompts, out, SamplingConfig(), replace_mismatched=False, **small)
        assert list(out.iterdir()) == []
        summary = record_prompts(tiny_pair, prompts, out, SamplingConfig(), **small)  # a cache: not locked
        assert summary.recorded == 1
    summary = record_prompts(tiny_pair, prompts, out, SamplingConfig(), replace_mismatched=False, **small)
    assert (summary.recorded, summary.skipped) == (0, 1)
