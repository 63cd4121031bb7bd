"""Every command line builds its flags one way (``engine.config_flags.add_dataclass_args`` over a dataclass that extends
``ModelConfig``) and names a pair one way (``--pair NAME`` or ``--pair TARGET::DRAFT``, parsed by
``engine.backends.models.split_pair``)."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field

import pytest

import evaluate
import generate
import train
from engine.backends.models import load_pair, pair_name, split_pair
from engine.cli import ArgumentParser, ModelConfig
from engine.config_flags import add_dataclass_args, from_args
from engine.costs import measure_costs
from engine.errors import InputError
from envs import record_traces
from evaluation import shift_config
from evaluation.config import EvalConfig
from tests_helpers import one_error_line
from training.train_config import TrainConfig


@dataclass
class _Config(ModelConfig):
    out: str = field(kw_only=True)
    """Where the result goes."""
    grid: tuple[int, ...] = (1, 2)
    """A grid of integers."""
    fast: bool = False
    """Go fast."""


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="tool")
    add_dataclass_args(ap, _Config)
    return ap


def test_fields_become_flags_with_their_docstrings():
    help_text = _parser().format_help()
    for needle in ("--out", "Where the result goes. (required)", "--grid", "(default: 1,2)", "--no-fast"):
        assert needle in help_text
    for flag in (
        "--pair",
        "--dtype",
        "--weights",
        "--draft-weights",
        "--draft-vocab",
        "--device",
        "--threads",
    ):
        assert flag in help_text  # the ModelConfig fields
    config = from_args(_Config, _parser().parse_args(["--out", "x", "--grid", "4,8,16", "--fast"]))
    assert (config.out, config.grid, config.fast, config.pair) == ("x", (4, 8, 16), True, "qwen2.5-coder")


@pytest.mark.parametrize("argv", [[], ["--out", "x", "--grid", "1,b"]])
def test_a_missing_required_flag_or_a_bad_tuple_is_one_error_line(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2
    one_error_line(capsys, "--out" if not argv else "--grid")


def test_model_config_refuses_negative_threads():
    with pytest.raises(InputError, match="--threads"):
        ModelConfig(threads=-1)
    assert ModelConfig(threads=0).threads == 0  # torch's default


@pytest.mark.parametrize(
    "config_class",
    [
        generate.GenerateConfig,
        measure_costs.MeasureCostsConfig,
        record_traces.RecordConfig,
        TrainConfig,
        EvalConfig,
    ],
)
def test_every_command_line_config_extends_model_config(config_class):
    assert issubclass(config_class, ModelConfig)


HISTORY = re.compile(r"\b20\d\d-\d\d\b|\b\d+\.\d+ ?[x×]|\bXeon\b|\bEPYC\b|\bZen \d|\bsession\b|\bmeasured:")
"""What a measurement quotes: a date, a ratio (1.06x), a CPU, a session."""


def _shift_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python evaluate.py shift")
    add_dataclass_args(ap, shift_config.ShiftConfig)
    return ap


@pytest.mark.parametrize(
    "build_parser",
    [
        train.build_parser,
        evaluate.build_parser,
        _shift_parser,
        generate.build_parser,
        record_traces.build_parser,
        measure_costs.build_parser,
    ],
)
def test_flag_help_says_what_a_flag_does_without_history(build_parser):
    """A flag's help (its field's docstring) says what the flag does and why its default; the measurements
    behind a default live in docs/ (docs/architecture.md, "Why the defaults are what they are")."""
    quoted = {
        action.option_strings[0]: action.help
        for action in build_parser()._actions
        if action.help and HISTORY.search(action.help)
    }
    assert quoted == {}
    assert HISTORY.search("fell from 1.076x to 0.981x (2026-12-02)")  # negative control: it is caught


def test_the_pair_syntax_has_one_parser():
    assert split_pair("tiny") is None and pair_name("tiny") == "tiny"
    assert split_pair("org/big::./small") == ("org/big", "./small")
    assert pair_name("org/big::./small") == "org/big+./small"
    with pytest.raises(InputError, match="TARGET::DRAFT"):
        load_pair("a::b", target="a", draft="b")


def test_pair_paths_are_checked_by_every_command_line(tmp_path, capsys, monkeypatch):
    """``--pair TARGET::DRAFT`` with a target that cannot be a model: one error line naming --pair, before
    anything loads, in every command that takes a pair."""
    monkeypatch.setattr(
        "engine.cli.load_pair", lambda *a, **k: pytest.fail("models loaded before the checks")
    )
    monkeypatch.setattr(measure_costs, "measure_profile_cli", lambda *a, **k: pytest.fail("measured"))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    pair = f"/nonexistent/model::{draft}"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    commands = [
        (generate.main, ["--pair", pair, "--prompt", "hi"]),
        (measure_costs.main, ["--pair", pair, "--out", str(tmp_path / "p.json")]),
        (record_traces.main, ["--pair", pair, "--prompts", str(prompts), "--out", str(tmp_path / "t")]),
        (evaluate.main, ["--pair", pair, "--controllers", "autoregressive", "--out", str(tmp_path / "e")]),
        (train.main, ["--pair", pair, "--run-dir", str(tmp_path / "r")]),
    ]
    for main, argv in commands:
        assert main(argv) == 2, main.__module__
        one_error_line(capsys, "--pair (target)", "no such model directory")


def test_generate_lookup_flag(capsys):
    """--lookup MIN-MAX:K runs lookup cycles (same tokens as without); a bad setting is one clear error."""
    argv = ["--pair", "tiny", "--prompt", "abcabcabcabc", "--max-new-tokens", "24", "--json", "--raw"]
    assert generate.main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert generate.main([*argv, "--lookup", "1-2:3"]) == 0
    looked = json.loads(capsys.readouterr().out)
    assert looked["tokens"] == plain["tokens"]
    assert plain["stats"]["lookup_cycles"] == 0 < looked["stats"]["lookup_cycles"]
    assert generate.main(["--pair", "tiny", "--prompt", "x", "--lookup", "3-2:1"]) == 2
    assert "max_ngram (2) must be >= min_ngram (3)" in capsys.readouterr().err
