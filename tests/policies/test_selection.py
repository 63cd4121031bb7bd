"""``policies.selection``: one reading of ``--policy`` for serve.py, generate.py and evaluate.py. What each value
names per command (serve.py's keywords, every value a policy file elsewhere, what no value means), the
refusals (an ``InputError`` naming the flag; one ``error:`` line and exit 2 at the command line, before any
model loads), the table file read as the controllers' own, and the controllers built (a fresh one per
call)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import evaluate
import generate
import serve
from engine.control import StaticController
from engine.errors import InputError
from evaluation.config import EvalConfig, find_policy
from policies.analytic import AnalyticController
from policies.goodput import GoodputController
from policies.learned_controller import LearnedController
from policies.selection import (
    SERVE_KEYWORDS,
    PolicyChoice,
    check_policy,
    parse_policy,
    read_policy_table,
    select_controller,
)
from policies.static import BatchSizeTableController, read_table, write_batch_size_table
from tests_helpers import batched_profile, make_policy, one_error_line

SERVE = {"keywords": SERVE_KEYWORDS}
FILES = {}  # generate.py: every value a policy file, none the static setting
NEWEST = {"absent": "newest"}  # evaluate.py: every value a policy file, none the newest runs/*/policy.pt
CPU_PAIR = SimpleNamespace(name="tiny", precision="float32", device=torch.device("cpu"))


def static() -> StaticController:
    return StaticController(depth=3, verify=5, tree_width=2)


@pytest.fixture()
def no_models(monkeypatch):
    """Fail the test if a command line gets as far as loading the pair."""

    def refuse(*args, **kwargs):
        pytest.fail("models were loaded before the arguments were checked")

    monkeypatch.setattr("engine.cli.load_pair", refuse)


# ------------------------------------------------------------------------------------------ what it names
@pytest.mark.parametrize(
    "value, serve_kind, serve_path",
    [
        ("auto", "auto", None),
        ("none", "none", None),
        ("analytic", "analytic", None),
        ("goodput", "goodput", None),
        ("analytic:a.pt", "analytic", "a.pt"),
        ("goodput:runs/x/policy.pt", "goodput", "runs/x/policy.pt"),
        ("table:runs/t.json", "table", "runs/t.json"),
        ("table:C:/t.json", "table", "C:/t.json"),  # only the first colon splits
        ("runs/main/policy.pt", "file", "runs/main/policy.pt"),
        ("None", "file", "None"),  # serve.py's flag is not optional: only "none" is the keyword
        ("static", "file", "static"),
        ("heuristic", "file", "heuristic"),
        ("", "file", ""),
    ],
)
def test_each_value_names_a_kind_per_command(value, serve_kind, serve_path):
    """serve.py reads its keywords; generate.py and evaluate.py read every value as a policy file."""
    assert parse_policy(value, **SERVE) == PolicyChoice(serve_kind, serve_path, value)
    for elsewhere in (FILES, NEWEST):
        assert parse_policy(value, **elsewhere) == PolicyChoice("file", value, value)


def test_no_value_is_the_static_setting_or_the_newest_policy():
    assert parse_policy(None) == PolicyChoice("none") == parse_policy(None, **SERVE)
    assert parse_policy(None, **NEWEST) == PolicyChoice("newest")


def test_the_commands_read_the_same_values_as_before():
    """Through each command's own flags: generate.py and evaluate.py read none (any case) as no value."""
    assert serve.policy_choice(serve.ServeConfig(pair="tiny")) == PolicyChoice("auto", None, "auto")
    args = generate.build_parser().parse_args(["--prompt", "hi", "--policy", "None"])
    assert args.policy is None and parse_policy(args.policy).kind == "none"
    config = evaluate.config_from_argv(["--policy", "none"])
    assert config.policy is None and parse_policy(config.policy, **NEWEST).kind == "newest"


# ----------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "value, needles",
    [
        ("table", ["--policy table needs its file", "table:FILE"]),
        ("table:", ["--policy table:FILE needs its file", "'table:'"]),
        ("analytic:", ["--policy analytic:FILE needs its file"]),
        ("goodput:", ["--policy goodput:FILE needs its file"]),
    ],
)
def test_a_keyword_without_its_file_is_refused(value, needles, capsys, no_models):
    with pytest.raises(InputError) as err:
        parse_policy(value, **SERVE)
    for needle in needles:
        assert needle in str(err.value)
    assert serve.main(["--pair", "tiny", "--policy", value]) == 2
    one_error_line(capsys, *needles)


def test_a_misused_parameter_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown keywords"):
        parse_policy("auto", keywords=("auto", "static"))
    with pytest.raises(ValueError, match="absent"):
        parse_policy(None, absent="auto")
    with pytest.raises(ValueError, match="kind"):
        PolicyChoice("static")
    with pytest.raises(ValueError, match="evaluation"):
        select_controller(PolicyChoice("newest"), static)


def test_checks_before_any_model_loads(tmp_path):
    missing = str(tmp_path / "missing.pt")
    with pytest.raises(InputError, match="--policy: no file"):
        check_policy(parse_policy(missing, **SERVE))
    with pytest.raises(InputError, match=r"--policy table:\S+: .*not a table file"):
        check_policy(parse_policy(f"table:{tmp_path / 'none.json'}", **SERVE))
    table = write_batch_size_table({(1, 1): 2, (2, 8): 1}, tmp_path / "t.json")
    check_policy(parse_policy(f"table:{table}", **SERVE))  # negative control: a good table
    profile = str(batched_profile().save(tmp_path / "profile.json"))
    for value in ("none", "auto", f"table:{table}"):
        with pytest.raises(InputError, match="--profile is the cost profile of --policy analytic or goodput"):
            check_policy(parse_policy(value, **SERVE), profile, tmp_path / "no-policy.pt")
    with pytest.raises(InputError, match="--policy analytic needs a cost profile"):
        check_policy(parse_policy("analytic", **SERVE), None, tmp_path / "no-policy.pt")
    check_policy(parse_policy("goodput", **SERVE), profile, tmp_path / "no-policy.pt")


def test_generate_reads_a_keyword_as_a_file_name(tmp_path, capsys, no_models, monkeypatch):
    """generate.py has no keywords: ``table:FILE`` is a policy file there, refused as a missing one."""
    monkeypatch.chdir(tmp_path)
    assert generate.main(["--pair", "tiny", "--prompt", "hi", "--policy", "table:t.json"]) == 2
    one_error_line(capsys, "--policy", "no policy file")


def test_evaluate_finds_the_given_file_or_the_newest(tmp_path):
    path = make_policy(tmp_path / "runs" / "a" / "policy.pt")
    assert find_policy(EvalConfig(pair="tiny"), tmp_path / "runs") == path
    assert find_policy(EvalConfig(pair="tiny", policy=str(path)), tmp_path / "nowhere") == path
    with pytest.raises(FileNotFoundError, match="no policy file there"):
        find_policy(EvalConfig(pair="tiny", policy="analytic"), tmp_path / "runs")


# ------------------------------------------------------------------------------------------ the controllers
def test_none_and_auto_without_a_main_policy_are_the_static_setting(tmp_path):
    for value in ("none", "auto"):
        selection = select_controller(parse_policy(value, **SERVE), static, default_policy=tmp_path / "x.pt")
        controller = selection.make()
        assert isinstance(controller, StaticController) and controller is not selection.make()
        assert (controller.depth, controller.verify, controller.tree_width) == (3, 5, 2)
        assert selection.description == repr(static()) and selection.trained_lookup is None


def test_autoregressive_builds_no_controller_whatever_the_policy():
    selection = select_controller(parse_policy("analytic:nowhere.pt", **SERVE), static, autoregressive=True)
    assert selection.make() is None and selection.description == "autoregressive"


def test_a_policy_file_and_the_main_policy(tmp_path):
    path = make_policy(tmp_path / "policy.pt", train_config={"lookup": "1-2:2"})
    for choice, default in (
        (parse_policy(str(path)), tmp_path / "x.pt"),
        (parse_policy("auto", **SERVE), path),
    ):
        selection = select_controller(choice, static, default_policy=default, pair=CPU_PAIR)
        controller = selection.make()
        assert isinstance(controller, LearnedController) and controller is not selection.make()
        assert selection.description == f"policy {path}" and selection.trained_lookup is not None
    with pytest.raises(InputError, match="--policy: no policy file"):
        select_controller(parse_policy(str(tmp_path / "missing.pt")), static)


def test_auto_leaves_a_main_policy_of_another_pair_for_the_static_setting(tmp_path, capsys):
    path = make_policy(tmp_path / "policy.pt", pair="qwen2.5-coder")
    selection = select_controller(parse_policy("auto", **SERVE), static, default_policy=path, pair=CPU_PAIR)
    assert isinstance(selection.make(), StaticController)
    assert "--policy auto: not using" in capsys.readouterr().err


def test_the_table_file_is_the_controllers_own(tmp_path):
    """``table:FILE`` reads vLLM's per-batch-size table (``policies.static``) at the server's tree width."""
    path = write_batch_size_table({(1, 2): 3, (5, 8): 1}, tmp_path / "gaps.json")
    assert read_table(path) == {1: 3, 5: 1} == read_policy_table(parse_policy(f"table:{path}", **SERVE))
    assert BatchSizeTableController.from_file(path, tree_width=2).table == {1: 3, 5: 1}
    selection = select_controller(parse_policy(f"table:{path}", **SERVE), static, tree_width=2)
    controller = selection.make()
    assert isinstance(controller, BatchSizeTableController) and controller is not selection.make()
    assert controller.tree_width == 2 and str(path) in selection.description
    with pytest.raises(ValueError, match="not a table file"):
        BatchSizeTableController.from_file(tmp_path / "missing.json")


def test_analytic_and_goodput_from_a_profile_or_a_policy_file(tmp_path):
    profile = str(batched_profile().save(tmp_path / "profile.json"))
    nowhere = tmp_path / "no-policy.pt"
    analytic = select_controller(
        parse_policy("analytic", **SERVE), static, tree_width=3, profile=profile, default_policy=nowhere
    )
    assert isinstance(analytic.make(), AnalyticController) and analytic.make().tree_width == 3
    assert profile in analytic.description and analytic.trained_lookup is None
    path = make_policy(tmp_path / "p.pt", profile=batched_profile().to_dict(), max_depth=5)
    goodput = select_controller(parse_policy(f"goodput:{path}", **SERVE), static, default_policy=nowhere)
    controller = goodput.make()
    assert isinstance(controller, GoodputController) and controller is not goodput.make()
    assert controller.max_depth == 5 and str(path) in goodput.description
