"""The load-aware comparison's baselines served live: ``serve.py --policy analytic`` (the analytic controller
given the load, costed with a cost profile from ``--profile`` or from a trained policy file) and ``--policy
table:FILE`` (the static chain of a per-batch-size table, vLLM's file format). Each starts on the tiny pair
and answers concurrent greedy requests with their tokens alone; the table's depth follows the requests in
the step. A bad table file, a missing profile or a profile the policy does not use is one ``error: ...``
line and exit 2 before any model loads."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

import serve
from engine.config_flags import from_args
from engine.costs.cost_profile import CostProfile
from engine.lookup import LookupConfig
from policies.analytic import AnalyticController
from policies.goodput import GoodputController
from policies.static import BatchSizeTableController, write_batch_size_table
from tests_helpers import batched_profile, make_policy, one_error_line
from tests_serving_helpers import (
    assert_matches_reference,
    completion_body,
    metric_sum,
    reference,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # the reference, as the server (--threads 1)

TABLE = {(1, 1): 2, (2, 256): 0}
"""Alone a chain of 2, from two requests on autoregressive steps: the load decides every cycle's kind."""
CYCLES = ("draft", "autoregressive")
PROMPTS = ("def main():", "The quick brown fox", "import numpy as np\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("policies")
    profile = batched_profile().save(tmp / "profile.json")
    table = write_batch_size_table(TABLE, tmp / "table.json")
    return {"tmp": tmp, "profile": str(profile), "table": str(table)}


@pytest.fixture(scope="module")
def servers(launch_server, files, served_pair) -> dict:
    """Both servers, started together (each start costs seconds), ready."""
    launched = {
        "analytic": launch_server("--policy", "analytic", "--profile", files["profile"]),
        "table": launch_server("--policy", f"table:{files['table']}"),
    }
    return {name: server.wait_ready() for name, server in launched.items()}


def _complete(server, ids: list[int], n: int) -> list[int]:
    import httpx

    response = httpx.post(server.url("/v1/completions"), json=completion_body(ids, n), timeout=120.0)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _concurrent_requests_are_their_alone_results(server, served_pair, n: int = 24) -> None:
    prompts = [list(served_pair.tokenizer.encode(p)) for p in PROMPTS]
    refs = [reference(served_pair, ids, n).tokens for ids in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: _complete(server, ids, n), prompts))
    for got, ref in zip(outs, refs):
        assert_matches_reference(got, ref, n, served_pair.eos_token_ids)


# ------------------------------------------------------------------------------------------- live servers
def test_the_analytic_controller_given_the_load_serves_exact_tokens(servers, files, served_pair):
    server = servers["analytic"]
    controller = server.health()["controller"]
    assert controller.startswith("AnalyticController(tree_width=1") and files["profile"] in controller
    _concurrent_requests_are_their_alone_results(server, served_pair)


def test_the_batch_size_table_serves_exact_tokens_at_the_depth_of_the_load(servers, files, served_pair):
    server = servers["table"]
    controller = server.health()["controller"]
    assert controller.startswith("BatchSizeTableController({1: 2, 2: 0}") and files["table"] in controller
    ids = list(served_pair.tokenizer.encode(PROMPTS[0]))
    server.wait_idle()
    before = server.metrics()
    ref = reference(served_pair, ids, 16).tokens
    assert_matches_reference(_complete(server, ids, 16), ref, 16, served_pair.eos_token_ids)
    alone = server.metrics()
    _concurrent_requests_are_their_alone_results(server, served_pair)
    together = server.metrics()

    def cycles(after, before) -> dict:
        key = 'draftpilot_cycles_total{{kind="{}"}}'
        return {k: metric_sum(after, key.format(k)) - metric_sum(before, key.format(k)) for k in CYCLES}

    # alone the table's chain of 2 (an autoregressive step only where the token budget leaves no room for a
    # draft: the last token); in company its 0
    first, second = cycles(alone, before), cycles(together, alone)
    assert first["autoregressive"] <= 1 < first["draft"]
    assert second["autoregressive"] > second["draft"]


# ------------------------------------------------------------------------------------ the controllers built
def _factory(argv: list[str]):
    config = serve.check(from_args(serve.ServeConfig, serve.build_parser().parse_args(argv)))
    pair = SimpleNamespace(name="tiny", precision="float32", device=torch.device("cpu"))
    return serve.controller_factory(config, pair)


def test_analytic_takes_the_profile_and_settings_of_a_trained_policy(files, monkeypatch):
    """No --profile: the cost profile, tree width, depth cap and trained lookup of the policy file
    (analytic:FILE, or runs/main/policy.pt), as the main job's analytic baseline ran."""
    profile = batched_profile()
    path = make_policy(
        files["tmp"] / "policy.pt",
        profile=profile.to_dict(),
        tree_width=2,
        max_depth=4,
        train_config={"lookup": "1-2:2"},
    )
    monkeypatch.setattr(serve, "DEFAULT_POLICY", path)
    for policy in ("analytic", f"analytic:{path}"):
        make, described, lookup = _factory(["--policy", policy])
        controller = make()
        assert isinstance(controller, AnalyticController) and controller is not make()  # one per request
        assert (controller.tree_width, controller.max_depth) == (2, 4)
        assert controller.loads.available  # the stored profile, its batch axis with it
        assert controller.profile.verify_s(4, 300) == profile.verify_s(4, 300)
        assert lookup == LookupConfig(1, 2, 2, 0, 0) and str(path) in described
    make, _, lookup = _factory(["--policy", "analytic", "--profile", files["profile"], "--tree-width", "3"])
    assert make().tree_width == 3 and lookup is None  # a profile alone: the server's flags


def test_goodput_is_built_per_request_from_the_profile_or_a_trained_policy(files, monkeypatch):
    """--policy goodput: a fresh goodput controller per request, costed with --profile, else with the profile,
    depth cap and trained lookup of the policy file (goodput:FILE, or runs/main/policy.pt)."""
    make, described, lookup = _factory(["--policy", "goodput", "--profile", files["profile"]])
    controller = make()
    assert isinstance(controller, GoodputController) and controller is not make()
    assert controller.loads.available and lookup is None and "GoodputController" in described
    profile = batched_profile()
    path = make_policy(
        files["tmp"] / "policy-goodput.pt",
        profile=profile.to_dict(),
        max_depth=5,
        train_config={"lookup": "1-2:2"},
    )
    monkeypatch.setattr(serve, "DEFAULT_POLICY", path)
    for policy in ("goodput", f"goodput:{path}"):
        make, described, lookup = _factory(["--policy", policy])
        controller = make()
        assert isinstance(controller, GoodputController) and controller.max_depth == 5
        assert controller.profile.verify_s(4, 300) == profile.verify_s(4, 300)
        assert lookup == LookupConfig(1, 2, 2, 0, 0) and str(path) in described


def test_the_table_is_read_as_vllm_reads_it(files, tmp_path):
    """A gap in the ranges keeps the previous depth, as vLLM carries it."""
    path = write_batch_size_table({(1, 2): 3, (5, 8): 1}, tmp_path / "gaps.json")
    make, described, lookup = _factory(["--policy", f"table:{path}"])
    controller = make()
    assert isinstance(controller, BatchSizeTableController) and lookup is None
    assert [controller.depth_for(n) for n in range(1, 11)] == [3, 3, 3, 3, 1, 1, 1, 1, 1, 1]


# ---------------------------------------------------------------------------------------------- refusals
@pytest.fixture()
def no_models(monkeypatch):
    """Fail the test if the command line gets as far as loading the pair."""

    def refuse(*args, **kwargs):
        pytest.fail("models were loaded before the arguments were checked")

    monkeypatch.setattr("engine.cli.load_pair", refuse)


def _bad_files(tmp) -> dict:
    out = {}
    for name, rows in {
        "late": [[2, 4, 1]],
        "overlap": [[1, 4, 2], [3, 8, 1]],
        "null": [[1, None, 2]],
        "float": [[1, 2.5, 2]],
        "zeros": [[1, 8, 0]],
        "object": {"1": 2},
    }.items():
        (tmp / f"{name}.json").write_text(json.dumps(rows))
        out[name] = tmp / f"{name}.json"
    (tmp / "garbage.json").write_bytes(b"\xff\xfe not json")
    out["garbage"] = tmp / "garbage.json"
    return out


@pytest.mark.parametrize(
    "name, needles",
    [
        ("late", ["starts at 2"]),
        ("overlap", ["overlaps"]),
        ("null", ["integer entries"]),
        ("float", ["integer entries"]),
        ("zeros", ["every draft length is 0"]),
        ("object", ["[first, last, k]"]),
        ("garbage", ["not a table file"]),
        ("missing", ["not a table file"]),
    ],
)
def test_a_bad_table_file_is_one_error_line(name, needles, tmp_path, capsys, no_models):
    path = _bad_files(tmp_path).get(name, tmp_path / "missing.json")
    assert serve.main(["--pair", "tiny", "--policy", f"table:{path}"]) == 2
    one_error_line(capsys, f"--policy table:{path}", *needles)


def test_a_missing_or_unusable_profile_is_one_error_line(files, tmp_path, capsys, no_models, monkeypatch):
    monkeypatch.setattr(serve, "DEFAULT_POLICY", tmp_path / "no-policy.pt")
    base = ["--pair", "tiny"]
    assert serve.main([*base, "--policy", "analytic"]) == 2
    one_error_line(capsys, "--policy analytic needs a cost profile", "--profile FILE")
    assert serve.main([*base, "--policy", "goodput"]) == 2
    one_error_line(capsys, "--policy goodput needs a cost profile", "--profile FILE")
    assert serve.main([*base, "--policy", "analytic", "--profile", str(tmp_path / "none.json")]) == 2
    one_error_line(capsys, "--profile", "no cost profile")
    (tmp_path / "bad.json").write_text("{}")
    assert serve.main([*base, "--policy", "analytic", "--profile", str(tmp_path / "bad.json")]) == 2
    one_error_line(capsys, "--profile", "version")
    bare = make_policy(tmp_path / "bare.pt", profile=None)  # a policy file that carries no profile
    assert serve.main([*base, "--policy", f"analytic:{bare}"]) == 2
    one_error_line(capsys, f"--policy analytic:{bare}", "carries no cost profile", "--profile")
    assert serve.main([*base, "--policy", f"analytic:{tmp_path / 'none.pt'}"]) == 2
    one_error_line(capsys, "--policy analytic:", "no policy file")
    assert serve.main([*base, "--policy", f"analytic:{bare}", "--profile", files["profile"]]) == 2
    one_error_line(capsys, "--profile", "give one")
    for policy in ("none", f"table:{files['table']}"):
        assert serve.main([*base, "--policy", policy, "--profile", files["profile"]]) == 2
        one_error_line(capsys, "--profile", "--policy analytic")
    for policy, needle in (
        ("table", "table:FILE"),
        ("table:", "needs its file"),
        ("analytic:", "needs its file"),
        ("goodput:", "needs its file"),
    ):
        assert serve.main([*base, "--policy", policy]) == 2
        one_error_line(capsys, "--policy", needle)
    assert isinstance(CostProfile.load(files["profile"]), CostProfile)  # negative control: the good profile
