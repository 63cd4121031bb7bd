"""An interrupted evaluation resumes where it stopped: the grid search and the measured prompts are kept,
only the rest is measured; a partial run with another config is refused, --restart discards it."""

from __future__ import annotations

import json

import pytest

from evaluation import runner
from evaluation.checkpoint import differing_fields
from tests_evaluation_helpers import run_cli, tiny_args

CONTROLLERS = ["autoregressive", "static_chain", "learned"]
PARTIAL = "live_runs.partial.json"


def _argv(workdir, policy, out, *extra):
    return tiny_args(workdir, policy, out, "--controllers", ",".join(CONTROLLERS), "--prompts-per-language", "2",
                     "--max-new-tokens", "16", "--tune-max-new-tokens", "16", "--no-replay", "--no-exactness", *extra)


class _Counting:
    """Wraps ``runner.run_engine``: counts calls and raises KeyboardInterrupt on call ``stop_at``."""

    def __init__(self, inner, stop_at=None):
        self.inner, self.stop_at, self.calls = inner, stop_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.stop_at is not None and self.calls == self.stop_at:
            raise KeyboardInterrupt
        return self.inner(*args, **kwargs)


def test_interrupted_evaluation_resumes_with_the_measured_prompts_kept(workdir, tiny_policy, monkeypatch):
    argv = _argv(workdir, tiny_policy, "resume")
    out = workdir / "resume"
    warmups = len(CONTROLLERS)
    # interrupted during the second prompt: the first prompt's three runs are saved, the second's partial one is not
    first = _Counting(runner.run_engine, stop_at=warmups + len(CONTROLLERS) + 2)
    monkeypatch.setattr(runner, "run_engine", first)
    with pytest.raises(KeyboardInterrupt):
        run_cli(argv)
    partial = json.loads((out / PARTIAL).read_text())
    assert partial["tuning"]["static_chain"]["best"]["tree_width"] == 1
    assert len(partial["runs"]) == len(CONTROLLERS)
    kept = {r["controller"]: r for r in partial["runs"]}
    assert set(kept) == set(CONTROLLERS) and len({r["prompt_id"] for r in partial["runs"]}) == 1
    assert not (out / "results.json").exists()

    second = _Counting(first.inner)
    monkeypatch.setattr(runner, "run_engine", second)
    rc, stdout, stderr = run_cli(argv)
    assert rc == 0, stderr
    assert "resuming the partial evaluation" in stdout
    prompts = 4  # 2 per language, it and en
    assert second.calls == warmups + (prompts - 1) * len(CONTROLLERS)  # the first prompt was not measured again
    res = json.loads((out / "results.json").read_text())
    assert len(res["runs"]) == prompts * len(CONTROLLERS)
    assert {(r["prompt_id"], r["controller"]) for r in res["runs"]} == {
        (p, c) for p in {r["prompt_id"] for r in res["runs"]} for c in CONTROLLERS}
    for run in res["runs"]:  # the kept runs are the first sitting's measurements, untouched
        if run["prompt_id"] == partial["runs"][0]["prompt_id"]:
            assert run["total_s"] == kept[run["controller"]]["total_s"]
    assert res["tuning"] == partial["tuning"]  # the grid search was not redone
    assert len(res["sittings"]) == 2
    assert "Measured in 2 sittings" in (out / "report.md").read_text()
    assert not (out / PARTIAL).exists()
    # the learned policy's action log spans both sittings
    assert len(res["learned_actions"]["size"]) >= sum(
        1 for r in res["runs"] if r["controller"] == "learned" for c in r["cycles"] if c[3] >= 0)


def test_partial_run_with_another_config_is_refused_and_restart_discards_it(workdir, tiny_policy):
    out = workdir / "other"
    out.mkdir(parents=True, exist_ok=True)
    saved = {"config": {"max_new_tokens": 999}, "tuning": None, "runs": [{"x": 1}], "sittings": []}
    (out / PARTIAL).write_text(json.dumps(saved))
    rc, _, stderr = run_cli(_argv(workdir, tiny_policy, "other", "--languages", "it", "--prompts-per-language", "1"))
    assert rc == 2 and "different config" in stderr and "max_new_tokens: 999 -> 16" in stderr and "--restart" in stderr
    assert json.loads((out / PARTIAL).read_text()) == saved  # nothing lost

    (out / PARTIAL).write_text("{not json")
    rc, _, stderr = run_cli(_argv(workdir, tiny_policy, "other", "--languages", "it", "--prompts-per-language", "1"))
    assert rc == 2 and "not a readable partial evaluation" in stderr

    rc, _, stderr = run_cli(_argv(workdir, tiny_policy, "other", "--languages", "it", "--prompts-per-language", "1",
                                  "--restart"))
    assert rc == 0, stderr
    res = json.loads((out / "results.json").read_text())
    assert len(res["sittings"]) == 1 and len(res["runs"]) == len(CONTROLLERS)
    assert not (out / PARTIAL).exists()


def test_config_comparison_ignores_progress_and_restart_only():
    a = {"progress": True, "restart": False, "temperature": 0.7, "reps": 1}
    assert differing_fields(a, {**a, "progress": False, "restart": True}) == []
    assert differing_fields(a, {**a, "temperature": 0.70000000000001}) == []
    assert differing_fields(a, {**a, "reps": 2}) == ["reps: 1 -> 2"]
    assert differing_fields(a, {**a, "seed": 1}) == ["seed: None -> 1"]
