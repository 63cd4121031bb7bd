"""Command lines check every argument and the output path before any model loads (issue 14), and report a
bad one as a single ``error: ...`` line naming it, exit status 2: ``python generate.py`` and
``python -m engine.costs.measure_costs``. A profile is saved atomically."""

from __future__ import annotations

import json

import pytest

import generate
from engine.backends.models import load_pair
from engine.costs import measure_costs
from engine.costs.cost_profile import CostProfile
from engine.errors import InputError
from tests_helpers import one_error_line

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture()
def no_models(monkeypatch):
    """Fail the test if a command line gets as far as loading models or measuring."""

    def refuse(*args, **kwargs):
        pytest.fail("models were loaded before the arguments were checked")

    monkeypatch.setattr("engine.cli.load_pair", refuse)  # every command line loads its pair there
    monkeypatch.setattr(measure_costs, "measure_profile_cli", refuse)


# ------------------------------------------------------------------------------------- engine.costs.measure_costs
PROFILE_BASE = ["--pair", "tiny", "--quick", "--reps", "1"]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--contexts", "0"], ["contexts", "--contexts"]),
        (["--contexts", "5000"], ["--contexts", "context limit 1024"]),
        (["--contexts", "16,2000"], ["--contexts"]),
        (["--widths", "0"], ["--widths"]),
        (["--widths", "300"], ["--widths", "vocabulary", "272"]),
        (["--reps", "0"], ["--reps"]),
        (["--warmup", "-1"], ["--warmup"]),
        (["--prefill-reps", "0"], ["--prefill-reps"]),
        (["--overhead-cycles", "0"], ["--overhead-cycles"]),
        (["--sizes=-1,0"], ["--sizes"]),
        (["--sizes", "0,65"], ["--sizes", "64"]),
        (["--chunks", "0,1"], ["--chunks"]),
        (["--contexts", "4", "--chunks", "1,8"], ["--contexts", "largest chunk"]),
        (["--threads", "-1"], ["--threads"]),
        (["--device", "bogus"], ["--device", "bogus"]),
        (["--device", "cuda:7"], ["--device", "cuda:7"]),
        (["--dtype", "float8"], ["--dtype", "float8"]),
        (["--weights", "int3"], ["--weights", "int3"]),
        (["--draft-vocab", "100000"], ["--draft-vocab"]),
    ],
)
def test_profile_refuses_bad_arguments_before_measuring(argv, needles, tmp_path, capsys, no_models):
    out = tmp_path / "p.json"
    assert measure_costs.main([*PROFILE_BASE, *argv, "--out", str(out)]) == 2
    one_error_line(capsys, *needles)
    assert not out.exists()


def test_profile_refuses_an_unknown_pair(tmp_path, capsys, no_models):
    assert measure_costs.main(["--pair", "nope", "--quick", "--out", str(tmp_path / "p.json")]) == 2
    one_error_line(capsys, "--pair", "'nope'", "known: tiny")


def test_profile_checks_the_output_path_first(tmp_path, capsys, no_models):
    assert measure_costs.main([*PROFILE_BASE, "--out", str(tmp_path)]) == 2  # a directory
    one_error_line(capsys, "--out", "is a directory")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert measure_costs.main([*PROFILE_BASE, "--out", str(blocker / "p.json")]) == 2  # under a file
    one_error_line(capsys, "--out", "cannot create the directory")


def test_argparse_errors_also_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        measure_costs.main(["--pair", "tiny", "--contexts", "x", "--out", "p.json"])
    assert info.value.code == 2


def test_profile_cli_good_arguments_still_measure(tmp_path, capsys):
    """Negative control of the refusals: the same base arguments with valid grids measure and save."""
    out = tmp_path / "deep" / "p.json"  # a missing directory is created
    assert (
        measure_costs.main([*PROFILE_BASE, "--contexts", "16,48", "--sizes", "0,3", "--out", str(out)]) == 0
    )
    assert CostProfile.load(out).sizes == [0, 3]
    assert f"saved {out}" in capsys.readouterr().out


def small_profile(**overrides) -> CostProfile:
    args = dict(
        contexts=[100, 300],
        widths=[1, 2],
        sizes=[0, 4],
        draft_step_table=[[1e-3, 2e-3], [2e-3, 3e-3]],
        verify_table=[[1e-2, 2e-2], [2e-2, 3e-2]],
    )
    return CostProfile(**{**args, **overrides})


def test_profile_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    small_profile().save(path)
    before = path.read_bytes()

    def crash(fd):
        raise KeyboardInterrupt  # a kill between writing the data and renaming it

    monkeypatch.setattr("engine.backends.files.os.fsync", crash)
    changed = small_profile(overhead_base_s=1.0)
    with pytest.raises(KeyboardInterrupt):
        changed.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and json.loads(before)["version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no temporary file left behind
    changed.save(path)
    assert CostProfile.load(path).overhead_base_s == 1.0


# ------------------------------------------------------------------------------------------- generate.py
GEN_BASE = ["--pair", "tiny", "--prompt", "hi"]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--seed", "-1"], ["--seed"]),
        (["--seed", str(2**64)], ["--seed"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--tree-width", "0"], ["tree_width"]),
        (["--tree-width", "300"], ["--tree-width", "vocabulary"]),
        (["--depth", "-2"], ["depth"]),
        (["--verify", "-1"], ["verify"]),
        (["--temperature", "-1"], ["temperature"]),
        (["--temperature", "nan"], ["temperature"]),
        (["--top-p", "2"], ["top_p"]),
        (["--top-k", "-1"], ["top_k"]),
        (["--device", "bogus"], ["--device"]),
        (["--weights", "int3"], ["--weights"]),
        (["--target", "some/model"], ["--target and --draft"]),
    ],
)
def test_generate_refuses_bad_arguments_before_loading(argv, needles, capsys, no_models):
    assert generate.main([*GEN_BASE, *argv]) == 2
    one_error_line(capsys, *needles)


def test_generate_refuses_an_unknown_pair_and_a_missing_policy(tmp_path, capsys, no_models):
    assert generate.main(["--pair", "nope", "--prompt", "hi"]) == 2
    one_error_line(capsys, "--pair", "'nope'")
    assert generate.main([*GEN_BASE, "--policy", str(tmp_path / "nope.pt")]) == 2
    one_error_line(capsys, "no policy file")
    assert generate.main([*GEN_BASE, "--policy", str(tmp_path)]) == 2  # a directory
    one_error_line(capsys, "--policy", "is a directory")


def _model_dirs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"\0" * 8)
    return {
        "/nonexistent/model": "no such model directory",
        "./missing-model": "no such model directory",
        str(empty): "no config.json",
        str(a_file): "not a model directory",
        "not a hub id!": "not a Hugging Face hub id",
        "": "empty",
    }


def test_generate_checks_model_paths_before_loading(tmp_path, capsys, no_models):
    """--target/--draft that cannot be a model fail in one line naming the flag, before transformers runs
    (which printed pages of hub errors and retries for /nonexistent)."""
    model = tmp_path / "model"  # passes the check (a directory with a config.json)
    model.mkdir()
    (model / "config.json").write_text("{}")
    for path, needle in _model_dirs(tmp_path).items():
        assert generate.main(["--prompt", "hi", "--target", path, "--draft", str(model)]) == 2, path
        one_error_line(capsys, "--target", needle)
        assert generate.main(["--prompt", "hi", "--target", str(model), "--draft", path]) == 2, path
        one_error_line(capsys, "--draft", needle)


def test_load_pair_reports_an_unloadable_model_in_one_error(tmp_path):
    """A directory with a config.json that transformers cannot load: one InputError naming the model."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(InputError, match="target model .*m'") as info:
        load_pair(target=model, draft=model, device="cpu", dtype="float32")
    assert "\n" not in str(info.value)


def test_policy_refusals_print_no_torch_warning(tmp_path, capsys, no_models):
    """A foreign pickle as --policy: the one error line only (torch's weights-only unpickler warned first)."""
    import pickle

    foreign = tmp_path / "foreign.pt"
    foreign.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"garbage")
    for path in (foreign, garbage):
        with _no_warnings():
            assert generate.main([*GEN_BASE, "--policy", str(path)]) == 2
        one_error_line(capsys, "--policy", str(path), "not a file saved by torch.save")


def test_generate_reports_engine_refusals_in_one_line(capsys):
    """Errors that need the loaded pair (here: a prompt longer than the tiny pair's context) are one line too."""
    assert generate.main([*GEN_BASE[:3], "x" * 2000, "--raw", "--max-new-tokens", "2"]) == 2
    one_error_line(capsys, "context limit")
    assert (
        generate.main([*GEN_BASE, "--raw", "--max-new-tokens", "3", "--tree-width", "2"]) == 0
    )  # negative control


class _no_warnings:
    """Fail if anything inside the block warns (warnings would reach stderr ahead of the error line)."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        self._log = self._ctx.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        assert not self._log, [str(w.message)[:100] for w in self._log]
