"""benchmarks/draft_vocab_coverage.py on hand-made traces: the coverage it reports is the share of held-out
target tokens inside each kept vocabulary, counted tokens first for the counted rule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from envs.prompts import load_suite
from envs.trace import Trace
from tests_evaluation_helpers import load_benchmark


def write_trace(folder, prompt_id: str, tokens: list[int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    n = len(tokens)
    Trace(
        prompt_id=prompt_id,
        prompt_len=4,
        tokens=np.array(tokens, dtype=np.int32),
        node_offsets=np.zeros(n + 1, dtype=np.int64),
        node_tokens=np.zeros(0, dtype=np.int32),
        node_parents=np.zeros(0, dtype=np.int16),
        node_depths=np.zeros(0, dtype=np.int8),
        node_scores=np.zeros(0, dtype=np.float32),
        meta={},
    ).save(folder / f"{prompt_id}__s0.npz")


def test_coverage_counts_train_tokens_first(tmp_path, capsys):
    suite = load_suite()
    train = next(p for p in suite if p["split"] == "train")
    test = [p for p in suite if p["split"] == "test"][:2]
    # the tiny tokenizer encodes bytes: train prompts add ids < 300; the train trace adds 1000 and 1001
    write_trace(tmp_path / "train", train["id"], [1000, 1000, 1001])
    write_trace(tmp_path / "train", test[0]["id"], [2000] * 5)  # a test-split trace: not counted
    write_trace(tmp_path / "test", test[0]["id"], [1000, 5, 3000])
    write_trace(tmp_path / "test", test[1]["id"], [1001, 2000])
    out = tmp_path / "coverage.json"
    rc = load_benchmark("draft_vocab_coverage").main(
        [
            "--pair",
            "tiny",
            "--train-traces",
            str(tmp_path / "train"),
            "--test-traces",
            str(tmp_path / "test"),
            "--sizes",
            "600",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = {r["rule"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["lowest"]["all"] == pytest.approx(1 / 5)  # only token 5 is below 600
    assert rows["counted"]["all"] == pytest.approx(3 / 5)  # 1000, 1001 counted; 2000 (test only) is not
    assert rows["counted"][test[0]["language"]] >= rows["lowest"][test[0]["language"]]
    assert "counted" in capsys.readouterr().out


def test_coverage_refuses_folders_without_the_splits(tmp_path):
    suite = load_suite()
    test = next(p for p in suite if p["split"] == "test")
    write_trace(tmp_path / "t", test["id"], [1, 2])
    with pytest.raises(SystemExit):
        load_benchmark("draft_vocab_coverage").main(
            ["--pair", "tiny", "--train-traces", str(tmp_path / "t"), "--test-traces", str(tmp_path / "t")]
        )
