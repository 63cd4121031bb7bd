"""peers/vllm_peer.py without vLLM: the per-batch-size table file (``policies.static``) against the format
vLLM 0.32.0 parses (its rules restated below from ``vllm/v1/spec_decode/dynamic/utils.py``, not imported),
the command line, and the one-line skip where the vLLM environment is absent."""

from __future__ import annotations

import json

import pytest

from peers import vllm_peer
from policies.static import batch_size_table, read_batch_size_table, write_batch_size_table


def vllm_parse(schedule: object) -> list[tuple[int, int, int]]:
    """``validate_and_normalize_dynamic_sd_schedule`` of vLLM 0.32.0, restated: a non-empty list of 3-item
    sequences (range_start, range_end, k), inclusive positive ranges with start <= end, k >= 0, sorted by
    start, non-overlapping, the first starting at 1."""
    assert isinstance(schedule, list) and schedule
    parsed = []
    for entry in schedule:
        assert isinstance(entry, list | tuple) and len(entry) == 3
        start, end, k = (int(x) for x in entry)
        assert start > 0 and end > 0 and start <= end and k >= 0
        parsed.append((start, end, k))
    parsed.sort(key=lambda e: e[0])
    previous_end = 0
    for start, end, _ in parsed:
        assert start > previous_end
        previous_end = end
    assert parsed[0][0] == 1
    return parsed


def vllm_lookup(schedule: object, max_batch: int, num_speculative_tokens: int) -> list[int]:
    """``build_dynamic_sd_schedule_lookup`` of vLLM 0.32.0, restated: batch size -> k, k carried forward
    through gaps and past the last range, clamped to ``num_speculative_tokens``."""
    parsed = vllm_parse(schedule)
    dense, last = [0] * (max_batch + 1), None
    for b in range(1, max_batch + 1):
        covering = [k for s, e, k in parsed if s <= b <= e]
        if covering:  # the first range starts at 1: a batch size past it has a range at or before it
            last = covering[0]
        dense[b] = min(num_speculative_tokens, last)
    return dense


def test_written_table_is_the_list_vllm_parses(tmp_path):
    path = write_batch_size_table({(5, 16): 1, (1, 1): 3, (2, 4): 2}, tmp_path / "t.json")
    rows = json.loads(path.read_text())
    assert rows == [[1, 1, 3], [2, 4, 2], [5, 16, 1]]  # a JSON list of [start, end, k], sorted
    assert vllm_parse(rows) == [(1, 1, 3), (2, 4, 2), (5, 16, 1)]
    config = vllm_peer.speculative_config("/d", table=path)
    assert config["method"] == "draft_model" and config["model"] == "/d"
    assert config["num_speculative_tokens_per_batch_size"] == rows
    assert config["num_speculative_tokens"] == 3  # vLLM clamps every k to it: the table's largest
    assert vllm_lookup(rows, 16, config["num_speculative_tokens"])[1:] == [3, 2, 2, 2] + [1] * 12
    assert json.loads(json.dumps(config)) == config  # what --speculative-config carries (json.loads)


def test_gaps_carry_the_previous_k_as_vllm_does(tmp_path):
    path = write_batch_size_table({(1, 2): 3, (8, 8): 1}, tmp_path / "t.json")
    rows = read_batch_size_table(path)
    assert vllm_lookup(rows, 10, 3)[1:] == [3] * 7 + [1, 1, 1]


@pytest.mark.parametrize(
    "table, message",
    [
        ({}, "empty"),
        ({(2, 4): 2}, "starts at 2"),
        ({(1, 4): 2, (3, 8): 1}, "overlaps"),
        ({(1, 0): 2}, "first <= last"),
        ({(0, 3): 2}, "positive"),
        ({(1, 3): -1}, ">= 0"),
        ({(1, 3): 0}, "every draft length is 0"),
    ],
)
def test_tables_vllm_would_refuse_are_refused(tmp_path, table, message):
    with pytest.raises(ValueError, match=message):
        write_batch_size_table(table, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_zero_draft_length_entries_are_kept():
    assert batch_size_table({(1, 4): 2, (5, 64): 0}) == [[1, 4, 2], [5, 64, 0]]


def test_command_lines():
    argv, env = vllm_peer.vllm_command("/v/bin/python", "/t", threads=2, port=8123)
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/t" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--port") + 1] == "8123"
    assert "--speculative-config" not in argv
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["HF_HUB_OFFLINE"] == "1"
    argv, _ = vllm_peer.vllm_command("/p", "/t", draft="/d", k=2)
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}
    with pytest.raises(ValueError):
        vllm_peer.vllm_command("/p", "/t", k=2)  # a draft length without a draft model
    with pytest.raises(ValueError):
        vllm_peer.speculative_config("/d")  # neither k nor table


def test_missing_environment_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTPILOT_VLLM_VENV", raising=False)
    python, why = vllm_peer.vllm_python(tmp_path / "none")
    assert python is None and "no vLLM environment" in why and "\n" not in why
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    python, why = vllm_peer.vllm_python(tmp_path / "venv")
    assert python is None and "no vllm package" in why
    with pytest.raises(RuntimeError, match="no vLLM environment"):
        vllm_peer.VllmServer(8000, tmp_path / "log", venv=tmp_path / "none")


def test_intel_openmp_of_the_environment_is_preloaded(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    _, env = vllm_peer.vllm_command(tmp_path / "bin" / "python", "/t")
    assert "LD_PRELOAD" not in env
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    _, env = vllm_peer.vllm_command(tmp_path / "bin" / "python", "/t")
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")


def test_a_file_that_is_no_table_is_one_error(tmp_path):
    (tmp_path / "bad.json").write_text("not json")
    with pytest.raises(ValueError, match="not a table file"):
        read_batch_size_table(tmp_path / "bad.json")


@pytest.mark.parametrize("rows", [[[1, None, 2]], [[1, 2.5, 2]], [[1, 4, "2"]], [[True, 4, 2]]])
def test_a_table_of_other_than_integers_is_one_error(tmp_path, rows):
    (tmp_path / "t.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match="integer entries"):
        read_batch_size_table(tmp_path / "t.json")
