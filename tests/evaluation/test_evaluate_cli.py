"""``python evaluate.py`` end to end on the tiny pair: report, raw results, figures, interleaving, greedy
exactness, load (threads, and the server replay per load level), the exactness subcommand, user prompt files
and clear errors on bad inputs."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from engine.costs.cost_profile import CostProfile
from evaluation.config import CONTROLLERS, LLAMA_PEERS, PEERS
from policies.learned import HASH_KEY, payload_digest
from tests_evaluation_helpers import CACHE, run_cli, tiny_args

SECTIONS = (
    "## Targets",
    "## Results (all measured prompts)",
    "### Per language",
    "## Learned policy ratios",
    "## Conditions",
    "## Static grid search (tune split)",
    "## Replay: hindsight oracle",
    "## Load: 2 concurrent requests",
    "## Under load (server replay)",
    "## Exactness audit",
    "Sampled two-sample test",
    "Sampler law checks",
    "## Figures",
    "## Method notes",
)
MEASURED = [n for n in CONTROLLERS if n != "oracle" and n not in LLAMA_PEERS]  # the tiny pair has no GGUF


def small_eval(workdir, policy, out: str, controllers: str, *extra: str) -> tuple[int, str, dict | None]:
    """evaluate.py on one prompt per language, 16 tokens, no exactness audit: (exit code, stderr, the
    results.json when it succeeded)."""
    rc, _, stderr = run_cli(
        tiny_args(
            workdir,
            policy,
            out,
            "--controllers",
            controllers,
            "--prompts-per-language",
            "1",
            "--max-new-tokens",
            "16",
            "--no-exactness",
            *extra,
        )
    )
    results = json.loads((workdir / out / "results.json").read_text()) if rc == 0 else None
    return rc, stderr, results


def test_end_to_end_writes_report_results_and_figures(evaluated):
    assert evaluated["rc"] == 0, evaluated["stderr"]
    out = evaluated["out"]
    for name in (
        "report.md",
        "results.json",
        "config.json",
        "speedup.png",
        "accepted_hist.png",
        "learned_actions.png",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    for section in SECTIONS:
        assert section in report, section
    assert report.count("PASS") + report.count("FAIL") + report.count("NOT MEASURED") >= 4
    # the printed summary: where the report is, one line per controller, the targets
    stdout = evaluated["stdout"]
    assert f"report: {out / 'report.md'}" in stdout
    assert all(name in stdout for name in MEASURED)
    config = json.loads((out / "config.json").read_text())
    assert (
        config["concurrency"] == 2 and config["max_new_tokens"] == 32 and config["prompts_per_language"] == 2
    )


def test_results_json_holds_every_measurement(evaluated):
    res = evaluated["results"]
    for key in (
        "config",
        "conditions",
        "warnings",
        "tuning",
        "best_static",
        "runs",
        "replay",
        "server_replay",
        "concurrency",
        "exactness",
        "learned_actions",
        "summary",
        "wall_s",
    ):
        assert key in res, key
    cond = res["conditions"]
    for key in (
        "pair",
        "dtype",
        "device",
        "torch",
        "transformers",
        "cpu",
        "threads",
        "sampling",
        "split",
        "prompts",
        "policy",
        "policy_metrics",
        "max_new_tokens",
        "reps",
        "date",
    ):
        assert key in cond, key
    assert cond["pair"] == "tiny" and cond["prompts"] == {"it": 2, "en": 2} and cond["threads"] == 1
    runs = res["runs"]
    assert len(runs) == len(MEASURED) * 4  # every controller on every prompt, 1 rep
    for run in runs:
        assert run["num_tokens"] == len(run["tokens"]) <= 32 and run["total_s"] > 0 and run["ttft_s"] > 0
        assert all(len(c) == 6 for c in run["cycles"])  # emitted, s, accepted, verified, depth, lookup
    table = res["summary"]["table"]
    assert set(table) == set(MEASURED)
    for name in MEASURED:
        assert set(table[name]) == {"it", "en", "all"}
        row = table[name]["all"]
        for key in (
            "tokens_per_s",
            "speedup",
            "mean_accepted",
            "ttft_s",
            "itl_p50_s",
            "itl_p90_s",
            "itl_p99_s",
            "total_s",
            "peak_memory_mb",
        ):
            assert key in row, key
        assert row["tokens_per_s"] > 0
    assert table["autoregressive"]["all"]["speedup"] == pytest.approx(1.0)
    ratios = res["summary"]["learned_ratios"]
    assert ratios["best_static"]["against"] == res["best_static"] in ("static_chain", "static_tree")
    for r in ratios.values():
        assert r["low"] <= r["ratio"] <= r["high"] and r["prompts"] == 4
    targets = res["summary"]["targets"]
    assert len(targets) == 6
    llama = [t for t in targets if "llama.cpp" in t["target"]]
    assert len(llama) == 2 and all(t["pass"] is None for t in llama)  # not measured: no llama.cpp rows here
    assert all(t["pass"] in (True, False) for t in targets if t not in llama)
    assert any("llama.cpp rows" in w or "GGUF" in w for w in res["warnings"])
    assert res["replay"]["oracle_tokens_per_s"] > 0 and "learned" in res["summary"]["replay_vs_live"]
    for kind in ("static_chain", "static_tree"):
        tune = res["tuning"][kind]
        assert len(tune["confirmed"]) == 1 and tune["replay_grid"]  # --quick: confirm_top 1
        assert tune["best"]["depth"] == tune["confirmed"][0]["depth"]
    actions = res["learned_actions"]
    assert actions["depth"] and all(len(row) == 5 for row in actions["size"] + actions["depth"])
    # whether the tiny policy drafts at all depends on the tiny profile measured under this machine's load
    # (on a busy machine it can learn never to draft): no size decision only if it never went on drafting
    assert actions["size"] or not any(row[4] for row in actions["depth"])


def test_controllers_are_interleaved_and_rotated(evaluated):
    order = defaultdict(list)
    for run in evaluated["results"]["runs"]:
        order[run["prompt_id"]].append(run["controller"])
    firsts = [names[0] for names in order.values()]
    assert all(len(names) == len(MEASURED) for names in order.values())
    assert len(set(firsts)) == len(firsts)  # the order is rotated per prompt
    runs = evaluated["results"]["runs"]
    assert [r["prompt_id"] for r in runs[: len(MEASURED)]] == [runs[0]["prompt_id"]] * len(MEASURED)


def test_greedy_exactness_is_total_on_the_tiny_pair(evaluated):
    exactness = evaluated["results"]["exactness"]
    audit = exactness["token_audit"]
    assert set(audit) == {n for n in MEASURED if n not in PEERS and n != "autoregressive"}
    for name, a in audit.items():
        assert a["match_rate"] == 1.0 and not a["divergences"], name
    assert all(c["ok"] for c in exactness["law_checks"])
    assert exactness["sampled"]["controller_name"] == "learned" and len(exactness["sampled"]["prompts"]) == 1


def test_concurrency_reports_aggregate_numbers(evaluated):
    load = evaluated["results"]["concurrency"]
    assert load["workers"] == 2
    assert {"autoregressive", "learned", evaluated["results"]["best_static"]} == set(load["modes"])
    for mode in load["modes"].values():
        s = mode["summary"]
        assert s["requests"] == 4 and s["tokens"] > 0 and s["aggregate_tokens_per_s"] > 0
        assert 0 < s["latency_p50_s"] <= s["latency_p99_s"] <= mode["passes"][0]["wall_s"] + 1e-6
    assert load["modes"]["autoregressive"]["summary"]["speedup"] == pytest.approx(1.0)
    # same seed, deterministic drafts: load does not change the greedy output
    ar = {r["prompt_id"]: r["tokens"] for r in load["modes"]["autoregressive"]["passes"][0]["requests"]}
    learned = {r["prompt_id"]: r["tokens"] for r in load["modes"]["learned"]["passes"][0]["requests"]}
    assert ar == learned


SERVER_ROWS = (
    "autoregressive",
    "lookup only (no draft model)",
    "static tuned at N=1",
    "static per load (table)",
    "analytic given the load",
    "goodput given the load",
    "learned",
)
"""The rows of the server replay section for a policy trained without context lookup (static tuned at N=1:
its name goes on with the depth chosen; goodput only on chain traces: it drafts chains)."""


def check_server_rows(server: dict, levels: list[int]) -> None:
    """Every row of the section at every level, its score the mean of its ratios over autoregressive's."""
    assert server["concurrencies"] == levels
    names = list(server["rows"])
    expected = [r for r in SERVER_ROWS if server["traces"]["width"] == 1 or not r.startswith("goodput")]
    assert len(names) == len(expected) and all(n.startswith(r) for n, r in zip(names, expected))
    reference = server["reference_autoregressive"]
    for name, row in server["rows"].items():
        for n in levels:
            assert row[f"N={n}"] > 0 and row[f"N={n} depth"] >= 0, (name, n)
        assert row["poisson"] > 0 and row["poisson_itl_p99_ms"] > 0, name
        ratios = [row[f"N={n}"] / reference[str(n)] for n in levels]
        assert abs(row["score"] - sum(ratios) / len(ratios)) < 1e-9, name
    ar = server["rows"]["autoregressive"]
    assert all(abs(ar[f"N={n}"] - reference[str(n)]) < 1e-9 for n in levels)  # the same replay
    depth = server["table"][str(levels[0])][0]
    assert names[2] == f"static tuned at N=1 (depth {depth})"
    learned = server["rows"]["learned"]
    assert server["learned_depths"] == {str(n): round(learned[f"N={n} depth"]) for n in levels}


def server_section(report: str) -> list[str]:
    """The lines of report.md's "Under load (server replay)" section."""
    lines = report.splitlines()
    start = lines.index("## Under load (server replay)")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    return lines[start:end]


def test_the_server_replay_section_has_every_row_and_level(evaluated):
    """The evaluated policy and every load baseline at each of the policy's training load levels and on the
    Poisson run, on the test traces the replay section recorded; the policy was trained load-aware: no note."""
    server = evaluated["results"]["server_replay"]
    check_server_rows(server, [1, 2, 4, 8])
    assert server["traces"]["split"] == "test" and server["traces"]["measured"] == 4
    assert not server["traces"]["recorded_here"]  # the replay section's traces
    assert server["lookup"] == "off" and server["lookup_row"] == "3-4:2+8:4"
    assert server["notes"] == []
    section = server_section((evaluated["out"] / "report.md").read_text())
    table = [line for line in section if line.startswith("| ")]
    assert table[0] == (
        "| controller | N=1 | N=2 | N=4 | N=8 | Poisson tokens/s | Poisson ITL p99 ms | score |"
    )
    assert [line.split(" | ")[0][2:] for line in table[1:]] == list(server["rows"])
    assert all(line.count("|") == 9 for line in table)
    assert any(line.startswith("Per-load static table") for line in section)
    assert not any(line.startswith("Note:") for line in section)
    assert "under load (server replay" in evaluated["stdout"]


def test_a_policy_trained_without_load_awareness_gets_its_rows_and_a_clear_line(
    workdir, tiny_batch_one_policy
):
    """--no-load-aware: the rows are all there, with a line saying how the policy was trained; the section
    records the test traces itself under --no-replay, at the levels --server-concurrencies gives."""
    rc, stderr, res = small_eval(
        workdir, tiny_batch_one_policy, "batch-one", "learned", "--no-replay", "--server-concurrencies", "1,3"
    )
    assert rc == 0, stderr
    server = res["server_replay"]
    check_server_rows(server, [1, 3])
    assert server["traces"]["recorded_here"] and res["replay"] is None
    (note,) = server["notes"]
    assert note.startswith("the policy was trained without load awareness (train.py --no-load-aware")
    section = server_section((workdir / "batch-one" / "report.md").read_text())
    assert f"Note: {note}." in section


def test_a_profile_without_a_batch_axis_is_a_clear_line_and_the_section_can_be_left_out(
    workdir, tiny_chain_policy
):
    profile = next((workdir / CACHE).rglob("profile.json"))
    data = CostProfile.load(profile).to_dict()
    assert data["batched"]  # the cached profile has one: the run below is the one without
    path = workdir / "unbatched.json"
    CostProfile(**{**data, "batched": {}}).save(path)
    rc, stderr, res = small_eval(workdir, tiny_chain_policy, "unbatched", "learned", "--profile", str(path))
    assert rc == 0, stderr
    assert res["server_replay"]["skipped"].startswith("the cost profile has no batch axis")
    section = server_section((workdir / "unbatched" / "report.md").read_text())
    assert section[2].startswith("Not measured: the cost profile has no batch axis")
    rc, stderr, res = small_eval(workdir, tiny_chain_policy, "no-server", "learned", "--no-server-replay")
    assert rc == 0, stderr
    assert res["server_replay"] is None
    assert "## Under load" not in (workdir / "no-server" / "report.md").read_text()


def test_a_policy_of_older_features_is_refused_with_one_line(workdir, tiny_chain_policy):
    """A policy file of an older feature version (before the load features: 5) cannot be run by this code at
    all: the evaluation refuses it before anything is measured, in one line that says to retrain it."""
    payload = torch.load(tiny_chain_policy, weights_only=True)
    old = {**payload, "feature_version": 5}
    old[HASH_KEY] = payload_digest(old)
    path = workdir / "features-5.pt"
    torch.save(old, path)
    rc, stderr, _ = small_eval(workdir, path, "features-5", "learned")
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "observation features version 5" in lines[0] and "retrain it" in lines[0]
    assert not (workdir / "features-5" / "report.md").exists()


def test_exactness_subcommand(workdir, tiny_policy):
    rc, stdout, stderr = run_cli(
        ["exactness"]
        + tiny_args(
            workdir,
            tiny_policy,
            "audit",
            "--controllers",
            "learned,static_tree,heuristic",
            "--prompts-per-language",
            "1",
            "--max-new-tokens",
            "24",
            "--samples",
            "20",
            "--law-trials",
            "500",
        )
    )
    assert rc == 0, stderr
    out = workdir / "audit"
    report = (out / "exactness.md").read_text()
    assert "# draftpilot exactness audit" in report and "Combined (Fisher) p-value" in report
    data = json.loads((out / "exactness.json").read_text())
    assert set(data["exactness"]["token_audit"]) == {"learned", "static_tree", "heuristic"}
    assert all(a["match_rate"] == 1.0 for a in data["exactness"]["token_audit"].values())
    assert "identical to autoregressive on 2/2 prompts" in stdout


def test_user_prompt_file_without_splits_is_the_test_set_with_a_warning(workdir, tiny_policy):
    path = workdir / "mine.jsonl"
    items = [
        {"id": "a1", "language": "it", "task": "qa", "prompt": "Ciao, come stai?"},
        {"id": "b1", "language": "en", "task": "qa", "prompt": "Hello there."},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    rc, _, stderr = run_cli(
        tiny_args(
            workdir,
            tiny_policy,
            "mine",
            "--prompts",
            str(path),
            "--controllers",
            "heuristic",
            "--no-replay",
            "--no-exactness",
            "--max-new-tokens",
            "16",
        )
    )
    assert rc == 0, stderr
    res = json.loads((workdir / "mine" / "results.json").read_text())
    assert {r["prompt_id"] for r in res["runs"]} == {"a1", "b1"}
    assert "TUNED ON THE SAME PROMPTS" in (workdir / "mine" / "report.md").read_text()
    assert res["summary"]["targets"][0]["pass"] is None  # no learned policy run: not measured, not failed


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policy", "/nonexistent/policy.pt"], "train one with `python train.py`"),
        (["--controllers", "learned,warp_drive"], "unknown controller(s) ['warp_drive']"),
        (["--languages", "xx"], "no prompts selected"),
        (["--split", "tune"], "never tune on the measured prompts"),
        (["--reps", "0"], "reps must be >= 1"),
    ],
    ids=["missing-policy", "unknown-controller", "empty-split", "tune-on-test", "zero-reps"],
)
def test_bad_inputs_give_clear_errors(workdir, tiny_policy, extra, message):
    rc, _, stderr = run_cli(tiny_args(workdir, tiny_policy, "bad") + extra)
    assert rc == 2 and message in stderr, stderr


def test_no_policy_anywhere_says_how_to_train_one(workdir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no runs/*/policy.pt here
    rc, _, stderr = run_cli(["--pair", "tiny", "--quick", "--no-progress", "--out", str(tmp_path / "o")])
    assert rc == 2 and "train one with `python train.py`" in stderr and "runs/*/policy.pt" in stderr


def test_sampled_mode(workdir, tiny_policy):
    rc, stderr, res = small_eval(
        workdir, tiny_policy, "sampled", "learned,hf_assisted_default", "--temperature", "0.5"
    )
    assert rc == 0, stderr
    assert res["conditions"]["sampling"].startswith("temperature 0.5")
    assert {r["controller"] for r in res["runs"]} == {"autoregressive", "learned", "hf_assisted_default"}
    assert all(r["num_tokens"] > 0 for r in res["runs"])
    assert "learned" in res["summary"]["replay_vs_live"]  # sampled traces replay the learned policy too
    assert not res["exactness"]["greedy"] and "peer_token_audit" not in res["exactness"]


def test_chain_policy_is_still_compared_with_a_static_tree(workdir, tiny_chain_policy):
    """A policy over chains (W 1): the static tree keeps width 4, while the analytic controller and the replay
    traces follow the policy's width so replay still predicts the learned policy; --tree-width 1 drops the tree."""
    policy = tiny_chain_policy
    rc, stderr, res = small_eval(workdir, policy, "chain-eval", "static_tree,analytic,learned")
    assert rc == 0, stderr
    assert (
        res["tuning"]["static_tree"]["width"] == 4 and res["tuning"]["static_tree"]["best"]["tree_width"] == 4
    )
    assert res["conditions"]["tree_width"] == 1 and res["conditions"]["static_tree_width"] == 4
    assert {r["controller"] for r in res["runs"]} == {"autoregressive", "static_tree", "analytic", "learned"}
    assert res["replay"]["width"] == 1
    assert {"learned", "analytic", "autoregressive"} <= set(res["replay"]["predicted"])
    assert "static_tree" not in res["replay"]["predicted"]  # width 4: not predictable from width-1 traces
    assert not res["warnings"]

    rc, stderr, res = small_eval(
        workdir, policy, "chain-eval-1", "static_tree,learned", "--no-replay", "--tree-width", "1"
    )
    assert rc == 0, stderr
    assert "static_tree" not in {r["controller"] for r in res["runs"]}
    assert any("static tree is the static chain" in w for w in res["warnings"])


def test_lookup_controllers_run_on_the_lookup_engine(evaluated):
    """The +lookup rows ran with context lookup (lookup cycles recorded, exact: in the token audit above) and
    the plain rows without; the learned+lookup ratios are reported."""
    runs = evaluated["results"]["runs"]
    lookup_cycles = defaultdict(int)
    for run in runs:
        lookup_cycles[run["controller"]] += sum(c[5] for c in run.get("cycles", []) if len(c) > 5)
    for name in ("autoregressive+lookup", "static_chain+lookup", "learned+lookup"):
        assert lookup_cycles[name] > 0, name
    for name in ("autoregressive", "static_chain", "learned"):
        assert lookup_cycles[name] == 0, name
    ratios = evaluated["results"]["summary"]["learned_lookup_ratios"]
    assert {"learned", "autoregressive"} <= set(ratios)
    assert "learned+lookup / learned" in (evaluated["out"] / "report.md").read_text()


def test_learned_lookup_alone_loads_the_policy(workdir, tiny_policy):
    """learned+lookup without learned still finds and loads the policy."""
    rc, stderr, results = small_eval(workdir, tiny_policy, "eval-lookup-only", "learned+lookup")
    assert rc == 0, stderr
    assert {r["controller"] for r in results["runs"]} == {"autoregressive", "learned+lookup"}


def test_lookup_mismatch_warnings():
    from engine.lookup import LookupConfig
    from evaluation.eval_setup import lookup_mismatches

    plain = {"train_config": {}}  # stored before the setting: trained without lookup
    looked = {"train_config": {"lookup": "3-4:2+8:4"}}
    legacy = {"train_config": {"lookup": "on"}}  # stored before the long-match rule: 3-4:2
    assert lookup_mismatches(plain, ["learned"], LookupConfig()) == []
    assert lookup_mismatches(looked, ["learned+lookup"], LookupConfig()) == []
    assert lookup_mismatches(legacy, ["learned+lookup"], LookupConfig(3, 4, 2, 0, 0)) == []
    (warning,) = lookup_mismatches(plain, ["learned", "learned+lookup"], LookupConfig())
    assert warning.startswith(
        "learned+lookup runs with context lookup 3-4:2+8:4, the policy was trained with off"
    )
    (warning,) = lookup_mismatches(legacy, ["learned+lookup"], LookupConfig())
    assert warning.startswith(
        "learned+lookup runs with context lookup 3-4:2+8:4, the policy was trained with 3-4:2"
    )
    plain_row, lookup_row = lookup_mismatches(
        looked, ["learned", "learned+lookup"], LookupConfig(2, 2, 2, 0, 0)
    )
    assert plain_row.startswith("learned runs with context lookup off, the policy was trained with 3-4:2+8:4")
    assert lookup_row.startswith("learned+lookup runs with context lookup 2-2:2")


def test_the_headline_row_follows_how_the_policy_was_trained():
    """The report's targets are read from learned+lookup for a policy trained with context lookup (when that row
    runs), else from learned (policies stored before the setting were trained without it)."""
    from evaluation.runner import headline_name

    looked = {"train_config": {"lookup": "3-4:2"}}
    assert headline_name(looked, ["autoregressive", "learned", "learned+lookup"]) == "learned+lookup"
    assert headline_name(looked, ["autoregressive", "learned"]) == "learned"
    assert headline_name({"train_config": {}}, ["learned", "learned+lookup"]) == "learned"
    assert headline_name({"train_config": {"lookup": "off"}}, ["learned", "learned+lookup"]) == "learned"
    assert headline_name(None, ["learned+lookup"]) == "learned"
