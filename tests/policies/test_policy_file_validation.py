"""Policy files are validated and hashed (issue 14): ``load_policy`` refuses NaN or infinite weights, an
unusable normaliser, a size ladder, depth cap or width out of range, a missing entry, and any change to the
payload after ``save_policy`` (a flipped byte, an edited value); files from before the hash load with a
warning; a policy trained for another pair is reported. Each refusal is one ``PolicyFileError`` naming what
is wrong, and a re-hashed copy of each edit shows the hash check is not what caught it."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.costs.observation import DEPTH_OBS_DIM, SIZE_OBS_DIM
from engine.costs.speedup_model import SIZE_LADDER
from policies.learned import HASH_KEY, load_policy, payload_digest
from policies.learned_controller import PolicyFileError, PolicyFileWarning
from tests_helpers import make_policy

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture()
def good(tmp_path) -> Path:
    return make_policy(tmp_path / "good.pt")


def payload_of(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def write(path: Path, payload: dict, rehash: bool = True) -> Path:
    """Save ``payload``; ``rehash``: with its hash brought up to date (the edit itself is what must fail)."""
    if rehash and HASH_KEY in payload:
        payload = {**payload, HASH_KEY: payload_digest(payload)}
    torch.save(payload, path)
    return path


def load_quietly(path: Path, **kw):
    """``load_policy`` with every warning an error: a good, hashed file loads without any."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_policy(path, **kw)


def test_a_saved_policy_carries_its_hash_and_loads_cleanly(good, tmp_path):
    payload = payload_of(good)
    assert payload[HASH_KEY] == payload_digest(payload) and len(payload[HASH_KEY]) == 64
    ctrl = load_quietly(good)
    assert ctrl.size_ladder == SIZE_LADDER and ctrl.max_depth == 4 and ctrl.tree_width == 2
    assert not list(tmp_path.glob("*.tmp")) and not list(
        tmp_path.glob(".*")
    )  # atomic save left nothing behind


def _actor_edit(part: str, key: str, value):
    def edit(payload):
        return {**payload, part: {**payload[part], key: value}}

    return edit


def _weights_with(value):
    def edit(payload):
        weights = [w.clone() for w in payload["depth"]["weights"]]
        weights[0][0, 0] = value
        return {**payload, "depth": {**payload["depth"], "weights": weights}}

    return edit


BAD_EDITS = {
    "nan weight": (_weights_with(math.nan), "NaN or infinite"),
    "inf weight": (_weights_with(math.inf), "NaN or infinite"),
    "nan mean": (_actor_edit("size", "obs_mean", torch.full((SIZE_OBS_DIM,), math.nan)), "observation mean"),
    "negative variance": (_actor_edit("size", "obs_var", -torch.ones(SIZE_OBS_DIM)), "variance"),
    "zero scale": (
        lambda p: _actor_edit("size", "epsilon", 0.0)(
            _actor_edit("size", "obs_var", torch.zeros(SIZE_OBS_DIM))(p)
        ),
        "variance",
    ),
    "nan epsilon": (_actor_edit("depth", "epsilon", math.nan), "epsilon"),
    "nan clip": (_actor_edit("depth", "clip_obs", math.nan), "clip_obs"),
    "zero clip": (_actor_edit("depth", "clip_obs", 0.0), "clip_obs"),
    "int weights": (
        _actor_edit("depth", "weights", [torch.ones(16, DEPTH_OBS_DIM, dtype=torch.long)]),
        "floating-point",
    ),
    "issue ladder": (lambda p: {**p, "size_ladder": [-3, 0, 1e9]}, "size_ladder"),
    "negative size": (lambda p: {**p, "size_ladder": [-3] + list(SIZE_LADDER[1:])}, "size_ladder"),
    "size above cap": (lambda p: {**p, "size_ladder": list(SIZE_LADDER[:-1]) + [65]}, "size_ladder"),
    "float size": (lambda p: {**p, "size_ladder": [float(s) for s in SIZE_LADDER]}, "size_ladder"),
    "unsorted ladder": (lambda p: {**p, "size_ladder": list(SIZE_LADDER[::-1])}, "size_ladder"),
    "duplicate size": (lambda p: {**p, "size_ladder": [1] + list(SIZE_LADDER[:-1])}, "size_ladder"),
    "empty ladder": (lambda p: {**p, "size_ladder": []}, "size_ladder"),
    "max_depth -1": (lambda p: {**p, "max_depth": -1}, "max_depth"),
    "max_depth 0": (lambda p: {**p, "max_depth": 0}, "max_depth"),
    "max_depth 1000": (lambda p: {**p, "max_depth": 1000}, "max_depth"),
    "max_depth float": (lambda p: {**p, "max_depth": 4.5}, "max_depth"),
    "tree_width 0": (lambda p: {**p, "tree_width": 0}, "tree_width"),
    "depth_zero str": (lambda p: {**p, "depth_zero": "yes"}, "depth_zero"),
    "nan device feature": (
        lambda p: {**p, "device_features": [0.0, math.nan, 1.0, 1.0, 1.0, 1.0]},
        "device_features",
    ),
    "short device features": (lambda p: {**p, "device_features": [0.0]}, "device_features"),
    "pair not str": (lambda p: {**p, "pair": 3}, "pair"),
    "no depth actor": (lambda p: {k: v for k, v in p.items() if k != "depth"}, "missing depth"),
    "no size actor": (lambda p: {k: v for k, v in p.items() if k != "size"}, "missing size"),
    "no ladder": (lambda p: {k: v for k, v in p.items() if k != "size_ladder"}, "missing size_ladder"),
}


@pytest.mark.parametrize("name", list(BAD_EDITS))
def test_out_of_range_values_are_refused(good, tmp_path, name):
    edit, match = BAD_EDITS[name]
    path = write(tmp_path / "edited.pt", edit(payload_of(good)))  # re-hashed: validation must catch it
    with pytest.raises(PolicyFileError, match=match) as info:
        load_quietly(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_edits_without_the_hash_are_refused_by_validation_too(good, tmp_path):
    """Files from before the hash: every check above still applies (they load with a warning only when valid)."""
    edit, _ = BAD_EDITS["issue ladder"]
    payload = {k: v for k, v in edit(payload_of(good)).items() if k != HASH_KEY}
    with (
        pytest.warns(PolicyFileWarning, match="no payload hash"),
        pytest.raises(PolicyFileError, match="size_ladder"),
    ):
        load_policy(write(tmp_path / "old-bad.pt", payload))


def test_a_file_without_hash_loads_with_a_warning(good, tmp_path):
    payload = {k: v for k, v in payload_of(good).items() if k != HASH_KEY}
    path = write(tmp_path / "old.pt", payload)
    with pytest.warns(PolicyFileWarning, match="no payload hash"):
        ctrl = load_policy(path)
    assert ctrl.size_ladder == SIZE_LADDER


@pytest.mark.parametrize(
    "edit",
    [
        lambda p: {**p, "max_depth": 5},  # a valid value, changed after saving
        lambda p: {**p, "pair": "qwen2.5-coder"},
        _weights_with(0.123),
        lambda p: {**p, "metrics": '{"learned_on_val": 1e9}'},
    ],
)
def test_any_change_after_saving_fails_the_integrity_check(good, tmp_path, edit):
    path = write(tmp_path / "tampered.pt", edit(payload_of(good)), rehash=False)
    with pytest.raises(PolicyFileError, match="integrity check"):
        load_quietly(path)
    load_quietly(
        write(tmp_path / "control.pt", edit(payload_of(good)))
    )  # negative control: re-hashed, it loads


def test_a_flipped_byte_in_the_weights_is_caught(good, tmp_path):
    data = bytearray(good.read_bytes())
    needle = payload_of(good)["size"]["weights"][1].numpy().tobytes()[:16]  # raw float32 bytes, stored as is
    at = data.find(needle)
    assert at > 0, "tensor bytes not found in the file"
    data[at + 5] ^= 0x10
    flipped = tmp_path / "flipped.pt"
    flipped.write_bytes(bytes(data))
    with pytest.raises(PolicyFileError, match="integrity check|not a readable policy file"):
        load_quietly(flipped)
    load_quietly(good)  # negative control: the original bytes load


def test_save_refuses_values_load_would_refuse(tmp_path):
    for kw, match in (
        ({"max_depth": 0}, "max_depth"),
        ({"size_ladder": (1, 2, 128)}, "size_ladder"),
        ({"device_feats": np.array([0.0, np.nan, 0.0, 0.0, 0.0, 0.0])}, "device_features"),
    ):
        target = tmp_path / f"{match}.pt"
        with pytest.raises(PolicyFileError, match=match):
            make_policy(target, **kw)
        assert not target.exists()


def test_policy_for_another_pair_is_reported(tmp_path, tiny_pair):
    other = load_quietly(make_policy(tmp_path / "qwen.pt", pair="qwen2.5-coder"))
    assert "trained for pair 'qwen2.5-coder' and runs on 'tiny'" in other.pair_warning(tiny_pair)
    with pytest.warns(PolicyFileWarning, match="qwen2.5-coder"):
        load_policy(tmp_path / "qwen.pt", pair=tiny_pair)
    same = load_quietly(
        make_policy(tmp_path / "tiny.pt", pair="tiny", profile={"meta": {"dtype": "float64"}}), pair=tiny_pair
    )
    assert same.pair_warning(tiny_pair) is None  # negative control: the pair it was trained for
    fmt = load_quietly(make_policy(tmp_path / "int4.pt", pair="tiny", profile={"meta": {"dtype": "int4"}}))
    assert "trained with int4 weights and runs with float64" in fmt.pair_warning(tiny_pair)


def test_generate_warns_about_a_policy_for_another_pair(tmp_path, capsys):
    from generate import main

    path = make_policy(tmp_path / "qwen.pt", pair="qwen2.5-coder")
    assert (
        main(["--pair", "tiny", "--raw", "--prompt", "hi", "--policy", str(path), "--max-new-tokens", "4"])
        == 0
    )
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "qwen2.5-coder" in err and len(err.strip().splitlines()) == 1
    assert (
        main(
            [
                "--pair",
                "tiny",
                "--raw",
                "--prompt",
                "hi",
                "--policy",
                str(make_policy(tmp_path / "t.pt")),
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    assert "warning" not in capsys.readouterr().err  # negative control


def test_generate_reports_a_bad_policy_in_one_line(good, tmp_path, capsys, monkeypatch):
    import generate

    monkeypatch.setattr(
        "engine.cli.load_pair", lambda *a, **k: pytest.fail("models loaded before the policy was checked")
    )
    bad = write(tmp_path / "bad.pt", BAD_EDITS["max_depth -1"][0](payload_of(good)))
    assert generate.main(["--pair", "tiny", "--prompt", "hi", "--policy", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "max_depth" in err and len(err.strip().splitlines()) == 1
