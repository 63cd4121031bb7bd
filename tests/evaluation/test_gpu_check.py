"""benchmarks/gpu_check.py, the one-run GPU check, kept working on a CPU with a shrunken random pair: every
section runs (the batched engine and the profile's batch axis included), correctness passes, the profile and
the report files are written, no CUDA is refused clearly."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.costs.cost_profile import CostProfile
from tests_evaluation_helpers import load_benchmark


def load_script():
    return load_benchmark("gpu_check")


def test_gpu_check_runs_on_cpu_small(tmp_path, capsys):
    rc = load_script().main(
        [
            "--device",
            "cpu",
            "--small",
            "--dtype",
            "float32",
            "--out",
            str(tmp_path),
            "--prompts",
            "2",
            "--samples",
            "40",
            "--law-trials",
            "400",
            "--timing-prompts",
            "1",
            "--prompt-len",
            "32",
            "--tokens",
            "6",
            "--batch-requests",
            "4",
        ]
    )
    assert rc == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    check = report["correctness"]
    assert check["ok"] and check["greedy_identical"]
    assert all(row["prompts"] == 2 for row in check["greedy_audit"].values())
    assert {c["expected"] for c in check["law_checks"]} == {"agree", "disagree"}  # the negative control ran
    batch = report["batched"]  # the batched engine on the device: greedy requests as alone, sampled ones done
    assert batch["ok"] and batch["identical"] == 4 and batch["sampled_finished"] == 2
    assert batch["cut_verifications"] > 0 and len(batch["requests"]) == 4
    profile = CostProfile.load(tmp_path / "profile.json")
    assert profile.meta["random_weights"] and set(report["cost"]) == {str(c) for c in profile.contexts}
    cost = report["batched_cost"]  # the profile's batch axis, summarised
    assert cost["context"] == profile.batched["context"]
    for model in ("target", "draft"):
        assert [(r["sequences"], r["rows"]) for r in cost[model]] == [
            (s, s * r) for s in (1, 2, 4) for r in (1, 4)
        ]
        assert all(r["ms"] > 0 and math.isfinite(r["over_singles"]) for r in cost[model])
    settings = report["timing"]["settings"]
    assert len(settings) == 12 and all(s["live_cycle_s"] > 0 and s["predicted_cycle_s"] > 0 for s in settings)
    assert "correctness OK" in (tmp_path / "gpu_check.txt").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_check_refuses_without_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        load_script().main(["--out", str(tmp_path)])
    assert err.value.code == 2 and "CUDA is not available" in capsys.readouterr().err
