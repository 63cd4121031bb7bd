"""Files and runs: checkpoints that never execute planted code, writes that a kill cannot truncate, run
directories that never serve a policy trained with another config, and one run per directory at a time."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import generate
import train
import training.ppo as ppo
from engine.backends.files import DirectoryBusyError, sha256_file, user_hmac
from engine.config_flags import save_config
from engine.control import StaticController
from engine.costs.observation import NUM_DEVICE_FEATURES
from engine.errors import InputError
from engine.lookup import LookupConfig, describe_lookup
from envs.backends import ReplayBackend
from envs.environments import EnvConfig
from envs.trace import Trace
from evaluation import plots
from evaluation.checkpoint import Checkpoint
from evaluation.config import EvalConfig
from evaluation.report import write_json
from policies.learned import load_policy
from training import load_training
from training.export import EXPORTS, SGLANG_FILE
from training.ppo import CoTrainer
from training.ppo_checkpoint import MANIFEST, CheckpointError, read_trainer_state, verify_checkpoint
from training.ppo_config import PPOConfig
from training.train_config import QUICK, QUICK_PPO, RunDirectoryError, TrainConfig
from training.train_data import ensure_profile, load_models, select_prompts

pytestmark = pytest.mark.usefixtures("single_thread")


def quick_config(tmp: Path, **kw) -> TrainConfig:
    values = {
        **QUICK,
        "pair": "tiny",
        "cache_dir": str(tmp / "cache"),
        "run_dir": str(tmp / "runs"),
        "progress": False,
        "languages": "it,en",
        "run_name": "base",
        "lookup": "off",  # the base run trains without context lookup (the default is on: a test of its own)
    }
    values.update(kw)
    return TrainConfig(**values, ppo=PPOConfig(**QUICK_PPO))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """One quick tiny run (policy, metrics, checkpoint); tests copy its directory before changing anything."""
    tmp = tmp_path_factory.mktemp("runs")
    metrics = train.train(quick_config(tmp))
    return {"tmp": tmp, "run": Path(metrics["policy"]).parent}


def copy_run(base: dict, name: str) -> Path:
    run = base["tmp"] / "runs" / name
    shutil.copytree(base["run"], run)
    (run / ".lock").unlink(missing_ok=True)
    return run


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = train.main(argv)
    return rc, out.getvalue(), err.getvalue()


def _quick_argv(base: dict, run: Path) -> list[str]:
    """The train.py flags of the base run's config, aimed at ``run``."""
    cache = str(base["tmp"] / "cache")
    return ["--pair", "tiny", "--quick", "--languages", "it,en", "--no-progress", "--cache-dir", cache,
            "--lookup", "off", "--run-dir", str(run.parent), "--run-name", run.name]  # fmt: skip


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


@contextlib.contextmanager
def locked_by_another_process(directory: Path):
    """A second process that holds ``directory``'s lock until the block ends."""
    code = (
        "import sys; from engine.backends.files import DirectoryLock; DirectoryLock(sys.argv[1]).acquire(); "
        "print('locked', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(train.__file__).parent,
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


# ------------------------------------------------------------------------------------------- checkpoints
class _Planted:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for arbitrary code in a planted checkpoint."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def plant(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rho": _Planted(marker)}, path)
    return path


def test_the_planted_pickle_does_run_code_when_unpickled(tmp_path):
    """Control: the payload the next tests plant really executes under a plain unpickler."""
    marker = tmp_path / "pwned"
    torch.load(plant(tmp_path / "trainer.pt", marker), weights_only=False)
    assert marker.exists()


def test_planted_trainer_state_never_executes_on_resume(base, tmp_path):
    marker = tmp_path / "pwned"
    run = tmp_path / "evil"
    save_config(quick_config(base["tmp"]), run / "config.json")
    planted = plant(run / "checkpoint" / "trainer.pt", marker)
    # no manifest: refused before anything is read
    rc, _, stderr = run_main(["--resume", str(run)])
    assert rc == 2 and MANIFEST in one_error_line(stderr) and not marker.exists()
    # a forged manifest that vouches for the planted file: not signed with this user's key, so refused
    forged = {
        "format": "draftpilot-checkpoint",
        "version": 1,
        "phases": 1,
        "files": {"trainer.pt": {"file": "trainer.pt", "sha256": sha256_file(planted)}},
    }
    (run / "checkpoint" / MANIFEST).write_text(json.dumps({**forged, "hmac": "0" * 64}))
    with pytest.raises(CheckpointError, match="not signed with this user's key"):
        verify_checkpoint(run / "checkpoint")
    rc, _, stderr = run_main(["--resume", str(run)])
    assert rc == 2 and "not signed" in one_error_line(stderr) and not marker.exists()
    # even signed (an author who can read the key): the weights-only reader still refuses it unexecuted
    forged["hmac"] = user_hmac(json.dumps(forged, sort_keys=True).encode())
    (run / "checkpoint" / MANIFEST).write_text(json.dumps(forged))
    assert verify_checkpoint(run / "checkpoint") == {"trainer.pt": planted}
    with pytest.raises(CheckpointError, match="not a plain trainer state"):
        read_trainer_state(planted)
    rc, _, stderr = run_main(["--resume", str(run)])
    assert rc == 2 and "trainer.pt is not a plain trainer state" in one_error_line(stderr)
    assert not marker.exists()


def test_tampered_or_missing_checkpoint_files_are_refused(base):
    run = copy_run(base, "tampered")
    files = verify_checkpoint(run / "checkpoint")
    assert set(files) == {"trainer.pt", "size.zip", "depth.zip"}
    assert read_trainer_state(files["trainer.pt"])["history"]  # plain state, read with weights_only=True
    rc, stdout, stderr = run_main(["--resume", str(run)])  # control: the untouched copy resumes
    assert rc == 0 and "resumed" in stdout, stderr
    files = verify_checkpoint(run / "checkpoint")
    with open(files["size.zip"], "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        verify_checkpoint(run / "checkpoint")
    rc, _, stderr = run_main(["--resume", str(run)])
    assert rc == 2 and files["size.zip"].name in one_error_line(stderr) and "refusing" in stderr
    files["size.zip"].unlink()
    with pytest.raises(CheckpointError, match="missing"):
        verify_checkpoint(run / "checkpoint")


def test_a_kill_while_checkpointing_keeps_the_previous_checkpoint(base, monkeypatch):
    run = copy_run(base, "killed-save")
    config = quick_config(base["tmp"])
    pair = load_models(config)
    profile = ensure_profile(config, pair)
    train_prompts, _ = select_prompts(config)
    traces = train.ensure_traces(config, pair, train_prompts, "train")

    def trainer():
        return CoTrainer(
            ReplayBackend(traces, profile),
            config.ppo,
            EnvConfig(),
            lambda: StaticController(2, 2, tree_width=1),
            None,
            max_depth=config.max_depth,
            device_feats=np.zeros(NUM_DEVICE_FEATURES, np.float32),
        )

    first = trainer()
    first.load(run / "checkpoint")
    before = json.loads((run / "checkpoint" / MANIFEST).read_text())
    first.run_phase("size", 64, 1)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ppo, "atomic_write_json", killed)  # killed after the new files, before the manifest
    with pytest.raises(KeyboardInterrupt):
        first.save(run / "checkpoint")
    monkeypatch.undo()
    assert json.loads((run / "checkpoint" / MANIFEST).read_text()) == before
    again = trainer()
    again.load(run / "checkpoint")  # the previous checkpoint, intact
    assert len(again.history) == before["phases"]
    first.save(run / "checkpoint")  # a completed save replaces it and removes the older files
    assert len(list((run / "checkpoint").glob("size.*.zip"))) == 1
    again.load(run / "checkpoint")
    assert len(again.history) == before["phases"] + 1


# ---------------------------------------------------------------------------------------- atomic writes
def _half_then_die(monkeypatch, target, name):
    """Replace ``target.name`` with a writer that writes half of its output to the file, then dies."""

    def dying(*args, **kwargs):
        path = next(a for a in args if isinstance(a, (str, Path)) or hasattr(a, "write"))
        if hasattr(path, "write"):
            path.write(b"PK\x03\x04half")
        else:
            Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(target, name, dying)


def _write_text_dies(monkeypatch):
    original = Path.write_text

    def dying(self, data, *args, **kwargs):
        original(self, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", dying)


def _writers(tmp_path):
    trace = Trace(
        "p",
        3,
        np.array([1, 2], np.int32),
        np.array([0, 1, 1]),
        np.array([5], np.int32),
        np.array([-1], np.int16),
        np.array([1], np.int8),
        np.array([-0.5], np.float32),
    )

    def figure(path):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.plot([0, 1])
        return plots.save_figure(fig, path)

    eval_config = EvalConfig(controllers="autoregressive", out=str(tmp_path))
    return {
        "config.json": (lambda p: save_config(quick_config(tmp_path), p), _write_text_dies),
        "results.json": (lambda p: write_json({"x": [1.0, float("nan")]}, p), _write_text_dies),
        "partial evaluation": (lambda p: Checkpoint(p, eval_config).save(), _write_text_dies),
        "trace": (trace.save, lambda mp: _half_then_die(mp, np, "savez_compressed")),
        "figure": (
            figure,
            lambda mp: _half_then_die(mp, __import__("matplotlib.figure").figure.Figure, "savefig"),
        ),
    }


@pytest.mark.parametrize("kind", ["config.json", "results.json", "partial evaluation", "trace", "figure"])
def test_a_write_killed_midway_leaves_the_old_file_intact(kind, tmp_path, monkeypatch):
    write, kill = _writers(tmp_path)[kind]
    path = tmp_path / "out" / f"file-{kind.replace(' ', '_')}"
    path.parent.mkdir()
    write(path)
    old = path.read_bytes()
    assert old
    kill(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        write(path)
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_a_killed_trace_write_leaves_nothing_the_reader_picks_up(tmp_path, monkeypatch):
    trace = Trace(
        "p",
        3,
        np.array([1], np.int32),
        np.array([0, 0]),
        np.zeros(0, np.int32),
        np.zeros(0, np.int16),
        np.zeros(0, np.int8),
        np.zeros(0, np.float32),
    )
    _half_then_die(monkeypatch, np, "savez_compressed")
    with pytest.raises(KeyboardInterrupt):
        trace.save(tmp_path / "a__s0.npz")
    monkeypatch.undo()
    assert not list(tmp_path.iterdir())
    trace.save(tmp_path / "a__s0.npz")
    assert Trace.load(tmp_path / "a__s0.npz").prompt_id == "p"
    assert [p.name for p in tmp_path.iterdir()] == ["a__s0.npz"]  # saved under exactly that name


# ------------------------------------------------------------------------------------------ run directories
def test_reuse_trusts_the_policy_file_not_config_json(base, monkeypatch):
    """The issue's case: a killed ``--retrain --seed 1`` (old code) left config.json saying seed 1 next to the
    seed-0 policy; a rerun with --seed 1 must not serve that policy."""
    run = copy_run(base, "stale")
    tmp = base["tmp"]
    save_config(quick_config(tmp, run_name="stale", seed=1), run / "config.json")
    with pytest.raises(RunDirectoryError, match=r"another config \(--seed: 0 -> 1\)"):
        train.train(quick_config(tmp, run_name="stale", seed=1))
    assert load_policy(run / "policy.pt").meta["train_config"]["seed"] == 0  # refused, not replaced
    # the same config, with relative paths and progress bars, is reused
    monkeypatch.chdir(tmp)
    metrics = train.train(quick_config(Path("."), run_name="stale", progress=True))
    assert Path(metrics["policy"]).resolve() == run / "policy.pt"


def test_retrain_removes_stale_outputs_before_training(base, monkeypatch):
    run = copy_run(base, "retrain")
    assert (run / SGLANG_FILE).exists()  # written by every load-aware run
    tmp = base["tmp"]

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "ensure_traces", killed)  # the first step after the inputs are checked
    with pytest.raises(KeyboardInterrupt):
        train.train(quick_config(tmp, run_name="retrain", seed=1), retrain=True)
    monkeypatch.undo()
    assert not (run / "policy.pt").exists() and not (run / "metrics.json").exists()
    assert not (run / "checkpoint").exists() and not (run / "tb").exists()
    assert not any((run / name).exists() for name in EXPORTS)  # the exported tables went with the policy
    assert json.loads((run / "config.json").read_text())["seed"] == 1
    metrics = train.train(quick_config(tmp, run_name="retrain", seed=1))  # trains: nothing left to reuse
    assert load_policy(metrics["policy"]).meta["train_config"]["seed"] == 1
    assert json.loads((run / "metrics.json").read_text())["learned_on_val"] == metrics["learned_on_val"]


def test_an_interrupted_run_needs_resume_or_retrain(base):
    run = copy_run(base, "interrupted")
    (run / "policy.pt").unlink()
    (run / "metrics.json").unlink()
    rc, _, stderr = run_main(_quick_argv(base, run))
    line = one_error_line(stderr)
    assert rc == 2 and f"--resume {run}" in line and "--retrain" in line
    assert verify_checkpoint(run / "checkpoint") is not None  # nothing was removed


def test_a_second_run_with_the_same_name_fails_at_once(base):
    run = copy_run(base, "busy")
    config_before = (run / "config.json").read_bytes()
    with locked_by_another_process(run):
        with pytest.raises(DirectoryBusyError):
            train.train(quick_config(base["tmp"], run_name="busy"))
        rc, _, stderr = run_main(["--resume", str(run)])
    assert rc == 2 and "in use by another process" in one_error_line(stderr)
    assert (run / "config.json").read_bytes() == config_before
    rc, _, stderr = run_main(["--resume", str(run)])  # the other process is gone: the run is free again
    assert rc == 0, stderr


def test_resume_refuses_flags_that_differ_from_the_run(base):
    run = copy_run(base, "flags")
    with pytest.raises(RunDirectoryError) as err:
        train.config_from_argv(["--resume", str(run), "--rounds", "5", "--seed", "9"])
    assert "--rounds: 1 -> 5" in str(err.value) and "--seed: 0 -> 9" in str(err.value)
    with pytest.raises(RunDirectoryError, match="--n-envs: 2 -> 3"):
        train.config_from_argv(["--resume", str(run), "--n-envs", "3"])
    with pytest.raises(RunDirectoryError, match="--run-name"):
        train.config_from_argv(["--resume", str(run), "--run-name", "other"])
    with pytest.raises(RunDirectoryError, match="--retrain"):
        train.config_from_argv(["--resume", str(run), "--retrain"])
    # flags that agree with the run (paths given relative or absolute alike) and --progress are accepted
    config, resume, _ = train.config_from_argv(
        [
            "--resume",
            str(run),
            "--seed",
            "0",
            "--quick",
            "--progress",
            "--cache-dir",
            str(base["tmp"] / "cache" / ".." / "cache"),
        ]
    )
    assert resume == run and config.progress and config.seed == 0
    rc, _, stderr = run_main(["--resume", str(run), "--rounds", "5"])
    assert rc == 2 and "--rounds: 1 -> 5" in one_error_line(stderr)
    rc, _, stderr = run_main(["--resume", str(base["tmp"] / "nowhere")])
    assert rc == 2 and "no config.json" in one_error_line(stderr)


def test_unusable_run_directories_give_one_error_line(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    rc, _, stderr = run_main(
        ["--pair", "tiny", "--quick", "--no-progress", "--run-dir", str(tmp_path / "file"), "--run-name", "x"]
    )
    assert rc == 2 and str(tmp_path / "file") in one_error_line(stderr)
    rc, _, stderr = run_main(["--pair", "tiny", "--quick", "--n-envs", "0", "--run-dir", str(tmp_path)])
    assert rc == 2 and "n_envs must be >= 1" in one_error_line(stderr)
    rc, _, stderr = run_main(
        ["--pair", "tiny", "--quick", "--activation", "bogus", "--run-dir", str(tmp_path)]
    )
    assert rc == 2 and "activation" in one_error_line(stderr)


@pytest.mark.parametrize("name", ["../x", "a/b", ".."])
def test_a_run_name_cannot_leave_the_run_dir(tmp_path, name):
    rc, _, stderr = run_main(
        ["--pair", "tiny", "--quick", "--run-dir", str(tmp_path / "runs"), "--run-name", name]
    )
    assert rc == 2 and "--run-name" in one_error_line(stderr)
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv", [["--n-envs", "abc"], ["--bogus-flag"]])
def test_bad_flags_give_one_error_line(argv):
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(io.StringIO()) as err:
        train.main(argv)
    assert exit_info.value.code == 2
    assert one_error_line(err.getvalue()).startswith("error: ")


def test_unusable_paths_name_their_flag(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    rc, _, stderr = run_main(["--pair", "tiny", "--quick", "--run-dir", str(a_file)])
    assert rc == 2 and "--run-dir" in one_error_line(stderr)
    rc, _, stderr = run_main(
        ["--pair", "tiny", "--quick", "--run-dir", str(tmp_path / "r"), "--prompts", str(tmp_path)]
    )
    assert rc == 2 and "--prompts" in one_error_line(stderr)


def _snapshot(directory: Path) -> dict:
    """Every path under ``directory`` with its bytes (None for a directory): what a refusal must not change."""
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(directory.rglob("*"))
    }


def test_refused_runs_leave_the_run_directory_as_it_was(base, tmp_path):
    """A refused train.py run (another config without --retrain, --resume with other flags, a bad input
    given with --retrain, a lock held) changes nothing in the run directory: no config.json rewritten, no lock
    file, no earlier policy removed."""
    run = copy_run(base, "refused")
    bad_prompts = tmp_path / "prompts.jsonl"
    bad_prompts.write_text("{not json\n")
    bad_profile = tmp_path / "profile.json"
    bad_profile.write_text("{}")
    common = _quick_argv(base, run)
    cases = [
        ["--resume", str(run), "--rounds", "5"],
        [*common, "--seed", "1"],
        [*common, "--retrain", "--prompts", str(bad_prompts)],
        [*common, "--retrain", "--profile", str(bad_profile)],
        [*common, "--retrain", "--pair", "/nonexistent::/nonexistent"],
        [*common, "--retrain", "--device", "bogus"],
        [*common, "--retrain", "--weights", "int3"],
    ]
    before = _snapshot(run)
    for argv in cases:
        rc, _, stderr = run_main(argv)
        assert rc == 2, (argv, stderr)
        one_error_line(stderr)
        assert _snapshot(run) == before, argv
    with locked_by_another_process(run):
        rc, _, stderr = run_main([*common, "--retrain"])
    assert rc == 2 and "in use by another process" in one_error_line(stderr)
    assert _snapshot(run) == before
    rc, _, stderr = run_main([*common[:-1], "never-made", "--profile", str(bad_profile)])
    assert rc == 2 and str(bad_profile) in one_error_line(stderr)
    assert not (run.parent / "never-made").exists()  # a refused run does not even leave its directory


def _long_suite(path: Path) -> Path:
    context = " ".join(f"def f{i}(x): return x * {i}" for i in range(10))
    rows = [
        {
            "id": f"{lang}-long-{split}",
            "language": lang,
            "task": "code",
            "split": split,
            "prompt": f"Explain ({lang}, {split}):\n\n{context}",
        }
        for lang in ("it", "en")
        for split in ("train", "tune", "test")
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_long_requests_join_the_training_and_validation_traces(base, monkeypatch):
    tmp = base["tmp"]
    suite = _long_suite(tmp / "long.jsonl")
    seen = []
    real = train.ensure_long_traces

    def spy(config, pair, prompts, tag):
        traces = real(config, pair, prompts, tag)
        seen.append((tag, [p["id"] for p in prompts], [t.max_new_tokens for t in traces]))
        return traces

    monkeypatch.setattr(train, "ensure_long_traces", spy)
    config = quick_config(
        tmp,
        run_name="long",
        long_prompts=str(suite),
        long_train_prompts=1,
        long_val_prompts=1,
        long_max_new_tokens=40,
    )
    metrics = train.train(config)
    assert seen[0][:2] == ("train (long)", ["it-long-train", "en-long-train"])
    assert seen[1][:2] == ("validation (long)", ["it-long-tune", "en-long-tune"])
    # the long traces are recorded to their own length, not the short ones' --max-new-tokens
    assert seen[0][2] == [40, 40] and config.max_new_tokens != 40
    stored = load_policy(metrics["policy"]).meta["train_config"]
    assert stored["long_train_prompts"] == 1 and stored["long_max_new_tokens"] == 40


def test_lookup_auto_means_on_for_replay_and_off_for_live_and_is_stored_resolved():
    assert TrainConfig(pair="tiny").lookup == "3-4:2+8:4"
    assert TrainConfig(pair="tiny", lookup="on").lookup == "3-4:2+8:4"
    assert TrainConfig(pair="tiny", lookup=" 1-2:2 ").lookup == "1-2:2"
    assert TrainConfig(pair="tiny", backend="live").lookup == "off"
    assert TrainConfig(pair="tiny", lookup="off").lookup == "off"


def test_long_requests_need_the_replay_backend():
    with pytest.raises(ValueError, match="--long-train-prompts"):
        TrainConfig(pair="tiny", backend="live", long_train_prompts=1)


def test_training_with_context_lookup(base, monkeypatch):
    """--lookup: the episodes, the static baselines and validation replay with the engine's lookup, and the
    stored config says so (a deployment reads it from the policy file)."""
    seen = []

    def spy(real):
        def make(*args, **kwargs):
            backend = real(*args, **kwargs)
            seen.append(backend.lookup)
            return backend

        return make

    # the training backend: the server replay's (load-aware, the default) or the single-request one
    monkeypatch.setattr(train, "ReplayBackend", spy(train.ReplayBackend))
    monkeypatch.setattr(load_training, "ServerReplayBackend", spy(load_training.ServerReplayBackend))
    config = quick_config(base["tmp"], run_name="lookup", lookup="1-2:2")
    metrics = train.train(config)
    # the backend's lookup is the asked rules with the load limit tuned on the server replay
    assert [lookup.rules for lookup in seen] == [LookupConfig(1, 2, 2, 0, 0)]
    assert metrics["lookup"] == describe_lookup(seen[0])
    plain = json.loads((base["run"] / "metrics.json").read_text())
    # the tiny pair repeats itself, so lookup cycles change the replayed autoregressive row (faster or slower:
    # that depends on the tiny pair's profile, measured on a machine that may be busy)
    assert metrics["autoregressive_on_val"] != plain["autoregressive_on_val"]
    assert load_policy(metrics["policy"]).meta["train_config"]["lookup"] == "1-2:2"
    assert load_policy(metrics["policy"]).trained_lookup == seen[0]
    assert load_policy(metrics["policy"]).trained_lookup.rules == LookupConfig(1, 2, 2, 0, 0)
    assert load_policy(base["run"] / "policy.pt").trained_lookup is None
    # with lookup on, the policy decides lookup itself (``lookup_gate``, the default); without, it is not asked
    assert load_policy(metrics["policy"]).decides_lookup
    assert not load_policy(base["run"] / "policy.pt").decides_lookup
    # generate.py --policy runs it with the lookup it was trained for unless told otherwise
    argv = ["--pair", "tiny", "--policy", metrics["policy"], "--prompt", "abcabcabcabc", "--raw", "--json"]
    argv += ["--max-new-tokens", "24"]
    from policies.learned_controller import LearnedController

    asked, real = [], LearnedController.use_lookup
    monkeypatch.setattr(LearnedController, "use_lookup", lambda self, s: asked.append(s) or real(self, s))
    stats = {}
    for extra in ([], ["--lookup", "off"]):
        out = io.StringIO()
        asked.clear()
        with contextlib.redirect_stdout(out):
            assert generate.main([*argv, *extra]) == 0
        stats[tuple(extra)] = (len(asked), json.loads(out.getvalue())["stats"]["lookup_cycles"])
    # the lookup proposes (the policy is asked; the cycles it took are lookup cycles); off: nothing proposed
    assert stats[()][0] > 0 and stats[()][1] <= stats[()][0] and stats[("--lookup", "off")] == (0, 0)


def test_lookup_training_needs_the_replay_backend_and_a_valid_setting():
    with pytest.raises(ValueError, match="--lookup needs --backend replay"):
        TrainConfig(pair="tiny", backend="live", lookup="on")
    with pytest.raises(InputError, match="lookup setting"):
        TrainConfig(pair="tiny", lookup="3-")


def test_the_main_job_exports_the_per_load_baseline_for_serve_py(base):
    """Beside the policy, the static chain tuned per load level (the per-load baseline) in vLLM's table format;
    ``serve.py --policy table:FILE`` serves it live at the tuned depth of every load level."""
    import serve
    from policies.static import BatchSizeTableController
    from training.export import TUNED_FILE

    run = base["run"]
    load = json.loads((run / "metrics.json").read_text())["load"]
    tuned = {int(n): depth for n, (depth, _) in load["table"].items()}
    if not any(tuned.values()):  # the measured tiny profile made drafting pay at no level: nothing to serve
        assert load["exports"]["tuned table"].startswith("not written") and not (run / TUNED_FILE).exists()
        return
    assert load["exports"]["tuned table"] == str(run / TUNED_FILE)
    config = serve.ServeConfig(pair="tiny", policy=f"table:{run / TUNED_FILE}")
    controller = BatchSizeTableController(serve.read_table(config))
    assert {n: controller.depth_for(n) for n in tuned} == tuned


def test_the_step_cost_is_measured_when_not_given_and_goes_with_the_policy(base):
    """Without --step-overhead-ms the run measures a batched step's own cost (cached per profile) and stores it
    in its metrics, where ``load_training.trained_server`` reads it for a policy whose config leaves it unset;
    the config keeps None, so the same command reuses the run."""
    from policies.learned import load_policy
    from training import load_training

    run = base["run"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["step_overhead_ms"] >= 0
    meta = load_policy(run / "policy.pt").meta
    assert meta["train_config"]["step_overhead_ms"] is None
    assert load_training.trained_server(meta)["step_overhead_ms"] == metrics["step_overhead_ms"]
    given = {"train_config": {"step_overhead_ms": 7.5}, "metrics": {"step_overhead_ms": 1.0}}
    assert load_training.trained_server(given)["step_overhead_ms"] == 7.5
