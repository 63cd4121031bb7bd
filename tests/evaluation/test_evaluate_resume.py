"""An interrupted evaluation resumes where it stopped: the grid search and the measured prompts are kept,
only the rest is measured; a partial run with another config is refused, --restart discards it."""

from __future__ import annotations

import json

import pytest

from evaluation import runner
from evaluation.checkpoint import differing_fields, prepare_output
from tests_evaluation_helpers import run_cli, tiny_args

CONTROLLERS = ["autoregressive", "static_chain", "learned"]
PARTIAL = "live_runs.partial.json"


def _argv(workdir, policy, out, *extra):
    return tiny_args(
        workdir,
        policy,
        out,
        "--controllers",
        ",".join(CONTROLLERS),
        "--prompts-per-language",
        "2",
        "--max-new-tokens",
        "16",
        "--tune-max-new-tokens",
        "16",
        "--no-replay",
        "--no-exactness",
        *extra,
    )


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
    assert second.calls == warmups + (prompts - 1) * len(
        CONTROLLERS
    )  # the first prompt was not measured again
    res = json.loads((out / "results.json").read_text())
    assert len(res["runs"]) == prompts * len(CONTROLLERS)
    assert {(r["prompt_id"], r["controller"]) for r in res["runs"]} == {
        (p, c) for p in {r["prompt_id"] for r in res["runs"]} for c in CONTROLLERS
    }
    for run in res["runs"]:  # the kept runs are the first sitting's measurements, untouched
        if run["prompt_id"] == partial["runs"][0]["prompt_id"]:
            assert run["total_s"] == kept[run["controller"]]["total_s"]
    assert res["tuning"] == partial["tuning"]  # the grid search was not redone
    assert len(res["sittings"]) == 2
    assert "Measured in 2 sittings" in (out / "report.md").read_text()
    assert not (out / PARTIAL).exists()
    # the learned policy's action log spans both sittings
    assert len(res["learned_actions"]["size"]) >= sum(
        1 for r in res["runs"] if r["controller"] == "learned" for c in r["cycles"] if c[3] >= 0
    )


def test_partial_run_with_another_config_is_refused_and_restart_discards_it(workdir, tiny_policy):
    out = workdir / "other"
    out.mkdir(parents=True, exist_ok=True)
    saved = {"config": {"max_new_tokens": 999}, "tuning": None, "runs": [{"x": 1}], "sittings": []}
    (out / PARTIAL).write_text(json.dumps(saved))
    rc, _, stderr = run_cli(
        _argv(workdir, tiny_policy, "other", "--languages", "it", "--prompts-per-language", "1")
    )
    assert (
        rc == 2
        and "different config" in stderr
        and "max_new_tokens: 999 -> 16" in stderr
        and "--restart" in stderr
    )
    assert json.loads((out / PARTIAL).read_text()) == saved  # nothing lost

    (out / PARTIAL).write_text("{not json")
    rc, _, stderr = run_cli(
        _argv(workdir, tiny_policy, "other", "--languages", "it", "--prompts-per-language", "1")
    )
    assert rc == 2 and "not a readable partial evaluation" in stderr

    rc, _, stderr = run_cli(
        _argv(workdir, tiny_policy, "other", "--languages", "it", "--prompts-per-language", "1", "--restart")
    )
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
    levels = {**a, "server_concurrencies": [1, 2]}  # as JSON stores the tuple
    assert differing_fields(levels, {**a, "server_concurrencies": (1, 2)}) == []
    assert differing_fields(levels, {**a, "server_concurrencies": (1, 3)}) == [
        "server_concurrencies: [1, 2] -> [1, 3]"
    ]


# --------------------------------------------------------------------------- what a resume compares, --out
def _partial_for(argv):
    """A partial evaluation (no runs yet) as the command ``argv`` would leave it."""
    import evaluate

    config = evaluate.config_from_argv(argv).resolved()
    state = prepare_output(config.out, config)
    state.save()
    return config, state


def _lines(stderr: str) -> list[str]:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines


def test_the_same_out_given_relative_or_absolute_resumes(workdir, tiny_policy, monkeypatch):
    out = workdir / "relative"
    first = _Counting(runner.run_engine, stop_at=len(CONTROLLERS) + len(CONTROLLERS) + 1)
    monkeypatch.setattr(runner, "run_engine", first)
    with pytest.raises(KeyboardInterrupt):
        run_cli(_argv(workdir, tiny_policy, "relative"))
    assert json.loads((out / PARTIAL).read_text())["runs"]
    monkeypatch.setattr(runner, "run_engine", first.inner)
    monkeypatch.chdir(workdir)
    relative = [
        "--pair",
        "tiny",
        "--quick",
        "--threads",
        "1",
        "--policy",
        str(tiny_policy.relative_to(workdir)),
        "--cache-dir",
        "cache",
        "--out",
        "relative",
        "--no-progress",
        "--languages",
        "it,en",
        "--controllers",
        ",".join(CONTROLLERS),
        "--prompts-per-language",
        "2",
        "--max-new-tokens",
        "16",
        "--tune-max-new-tokens",
        "16",
        "--no-replay",
        "--no-exactness",
    ]
    rc, stdout, stderr = run_cli(relative)
    assert rc == 0 and "resuming the partial evaluation" in stdout, stderr
    config = json.loads((out / "config.json").read_text())
    assert config["out"] == str(out) and config["cache_dir"] == str(workdir / "cache")
    assert config["policy"] == str(tiny_policy) and len(config["policy_sha256"]) == 64


def test_resume_with_a_replaced_policy_file_is_refused(workdir, tiny_policy, tmp_path):
    import torch

    policy = tmp_path / "policy.pt"
    policy.write_bytes(tiny_policy.read_bytes())
    argv = _argv(workdir, policy, "replaced")
    config, _ = _partial_for(argv)
    assert prepare_output(config.out, config).resumed  # control: the unchanged policy resumes
    (workdir / "replaced" / "config.json").write_text('{"from": "the first sitting"}\n')
    payload = torch.load(policy, weights_only=True)
    torch.save({**payload, "metrics": json.dumps({"retrained": True})}, policy)  # same path, other bytes
    rc, _, stderr = run_cli(argv)
    assert (
        rc == 2
        and "policy_sha256" in _lines(stderr)[0]
        and f"the policy file {policy} was replaced" in stderr
    )
    assert json.loads((workdir / "replaced" / "config.json").read_text()) == {"from": "the first sitting"}


def test_resume_without_policy_after_a_newer_policy_appeared_is_refused(
    workdir, tiny_policy, tmp_path, monkeypatch
):
    import os

    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    older = tmp_path / "runs" / "a" / "policy.pt"
    older.write_bytes(tiny_policy.read_bytes())
    argv = [a for a in _argv(workdir, tiny_policy, "newer") if a != str(tiny_policy)]
    argv.remove("--policy")
    config, _ = _partial_for(argv)
    assert config.policy == str(older)
    newer = tmp_path / "runs" / "b" / "policy.pt"
    newer.write_bytes(tiny_policy.read_bytes())
    os.utime(newer, (older.stat().st_atime, older.stat().st_mtime + 60))
    rc, _, stderr = run_cli(argv)
    line = _lines(stderr)[0]
    assert rc == 2 and f"policy: '{older}' -> '{newer}'" in line and f"--policy {older}" in line


def test_a_finished_out_is_kept_unless_restart(workdir, tiny_policy):
    out = workdir / "finished"
    out.mkdir()
    old = {
        "report.md": "# old report\n",
        "results.json": "{}\n",
        "config.json": '{"old": 1}\n',
        "learned_actions.png": "old figure",
    }
    for name, text in old.items():
        (out / name).write_text(text)
    cheap = [
        "--controllers",
        "autoregressive",
        "--prompts-per-language",
        "1",
        "--max-new-tokens",
        "8",
        "--tune-max-new-tokens",
        "8",
        "--no-replay",
        "--no-exactness",
    ]
    for argv in (
        tiny_args(workdir, tiny_policy, "finished", *cheap),
        ["exactness"] + tiny_args(workdir, tiny_policy, "finished", *cheap),
    ):
        rc, _, stderr = run_cli(argv)
        assert (
            rc == 2 and "already holds a finished evaluation" in _lines(stderr)[0] and "--restart" in stderr
        )
        assert {name: (out / name).read_text() for name in old} == old  # nothing touched
    rc, _, stderr = run_cli(tiny_args(workdir, tiny_policy, "finished", *cheap, "--restart"))
    assert rc == 0, stderr
    assert not (out / "learned_actions.png").exists()  # the old run's figure went with it
    assert (out / "report.md").read_text() != old["report.md"]
    assert json.loads((out / "config.json").read_text())["controllers"] == "autoregressive"


def test_two_evaluations_into_one_out_cannot_run_at_once(workdir, tiny_policy):
    import subprocess
    import sys
    from pathlib import Path

    out = workdir / "busy"
    code = (
        "import sys; from engine.backends.files import DirectoryLock; DirectoryLock(sys.argv[1]).acquire(); "
        "print('locked', flush=True); sys.stdin.read()"
    )
    root = Path(runner.__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        rc, _, stderr = run_cli(_argv(workdir, tiny_policy, "busy"))
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert rc == 2 and "in use by another process" in _lines(stderr)[0]
    assert not (out / "config.json").exists()


def test_an_unusable_out_gives_one_error_line(workdir, tiny_policy):
    (workdir / "a-file").write_text("not a directory")
    rc, _, stderr = run_cli(_argv(workdir, tiny_policy, "a-file"))
    assert rc == 2 and str(workdir / "a-file") in _lines(stderr)[0]


def _snapshot(directory):
    """Every path under ``directory`` with its bytes (None for a directory): what a refusal must not change."""
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(directory.rglob("*"))
    }


def test_refused_evaluations_leave_out_as_it_was(workdir, tiny_policy, tmp_path):
    """A refused evaluation (a finished or other-config --out without --restart, a bad input with --restart,
    a lock held) changes nothing in --out: no config.json, no lock file, no earlier output removed."""
    import subprocess
    import sys
    from pathlib import Path

    out = workdir / "refused"
    out.mkdir()
    for name, data in {
        "report.md": b"old report",
        "results.json": b"{}",
        "config.json": b'{"old": 1}',
        "learned_actions.png": b"png",
    }.items():
        (out / name).write_bytes(data)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"garbage")
    bad_profile = tmp_path / "profile.json"
    bad_profile.write_text("{}")
    bad_prompts = tmp_path / "prompts.jsonl"
    bad_prompts.write_text("{not json\n")
    partial = workdir / "refused-partial"
    partial.mkdir()
    (partial / PARTIAL).write_text(json.dumps({"config": {"max_new_tokens": 999}, "runs": []}))
    (partial / "config.json").write_text('{"max_new_tokens": 999}')
    cases = [
        (out, _argv(workdir, tiny_policy, "refused")),
        (out, ["exactness", *_argv(workdir, tiny_policy, "refused")]),
        (out, _argv(workdir, garbage, "refused", "--restart")),
        (out, _argv(workdir, tiny_policy, "refused", "--restart", "--profile", str(bad_profile))),
        (out, _argv(workdir, tiny_policy, "refused", "--restart", "--prompts", str(bad_prompts))),
        (out, _argv(workdir, tiny_policy, "refused", "--restart", "--pair", "/nonexistent::/nonexistent")),
        (out, _argv(workdir, tiny_policy, "refused", "--restart", "--device", "bogus")),
        (partial, _argv(workdir, tiny_policy, "refused-partial")),
        (partial, _argv(workdir, garbage, "refused-partial", "--restart")),
    ]
    for directory, argv in cases:
        before = _snapshot(directory)
        rc, _, stderr = run_cli(argv)
        assert rc == 2, (argv, stderr)
        _lines(stderr)
        assert _snapshot(directory) == before, argv

    code = (
        "import sys; from engine.backends.files import DirectoryLock; DirectoryLock(sys.argv[1]).acquire(); "
        "print('locked', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(runner.__file__).resolve().parents[1],
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        before = _snapshot(out)
        rc, _, stderr = run_cli(_argv(workdir, tiny_policy, "refused", "--restart"))
        assert rc == 2 and "in use by another process" in _lines(stderr)[0]
        assert _snapshot(out) == before
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    rc, _, stderr = run_cli(_argv(workdir, tiny_policy, "never-made", "--prompts", str(bad_prompts)))
    assert rc == 2 and "--prompts" in _lines(stderr)[0]
    assert not (workdir / "never-made").exists()  # a refused run does not even leave its --out behind
