"""benchmarks/batch_step_split.py on the tiny pair: every timed step is split into its forwards and the rest
(per step the two add up to the step, and the forwards were seen), the decoding steps asked for are all timed, the
wrapped forward is put back afterwards, and bad arguments are refused."""

from __future__ import annotations

import json

import pytest

import engine.batch as batch_module
from engine.batch_forward import forward_rows
from tests_evaluation_helpers import load_benchmark

split = load_benchmark("batch_step_split")


@pytest.mark.parametrize("depth", [0, 2])
def test_each_step_is_its_forwards_plus_the_rest(tmp_path, depth):
    out = tmp_path / "split.json"
    args = ["--pair", "tiny", "--clients", "1,3", "--context", "40", "--steps", "3", "--depth", str(depth)]
    assert split.main([*args, "--out", str(out)]) == 0
    assert vars(batch_module)["forward_rows"] is forward_rows  # put back
    data = json.loads(out.read_text())
    assert set(data["clients"]) == {"1", "3"}
    for row in data["clients"].values():
        assert row["steps"] == 3
        assert row["forward_cpu_ms"] > 0
        steps = row["per_step"]
        for step, forward, rest in zip(steps["step_cpu_ms"], steps["forward_cpu_ms"], steps["rest_cpu_ms"]):
            assert step == pytest.approx(forward + rest) and forward > 0


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit) as err:
        split.main(["--pair", "tiny", "--steps", "0"])
    assert err.value.code == 2
