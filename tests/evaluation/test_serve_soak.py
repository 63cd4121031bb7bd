"""benchmarks/serve_soak.py's faulty clients: on a real server process (tiny pair, loopback), requests marked to
fail through ``serving/faults.py`` each get their 500 while the other clients' answers stay exact; a server
that injects nothing fails the verdict (the control)."""

from __future__ import annotations

import json

import pytest

from tests_evaluation_helpers import load_benchmark


@pytest.fixture(scope="module")
def serve_soak():
    return load_benchmark("serve_soak")


ARGV = ["--minutes", "0.25", "--fault-clients", "2", "--burst", "0", "--sampled-clients", "1"]


def test_faulty_requests_fail_alone_and_the_soak_passes(serve_soak, tmp_path):
    out = tmp_path / "soak.json"
    assert serve_soak.main([*ARGV, "--json", str(out), "--", "--pair", "tiny"]) == 0
    data = json.loads(out.read_text())
    faults = sum(v for k, v in data["stats"].items() if k.startswith("fault "))
    assert faults >= 2 and data["stats"]["greedy"] > 0 and data["problems"] == []


def test_a_server_that_injects_nothing_fails_the_verdict(serve_soak, tmp_path, monkeypatch):
    monkeypatch.setattr(
        serve_soak, "FAULTS_ENV", "DRAFTPILOT_NO_SUCH_SETTING"
    )  # the server never sees the faults
    out = tmp_path / "soak.json"
    assert serve_soak.main([*ARGV, "--json", str(out), "--", "--pair", "tiny"]) == 1
    problems = json.loads(out.read_text())["problems"]
    assert problems and all("marked to fail" in p for p in problems)
