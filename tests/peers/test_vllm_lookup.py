"""The engine's context lookup as a vLLM custom proposer (peers/vllm_lookup.py), called as vLLM 0.32.0's
model runner calls it (``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``),
without vLLM: its proposals are the engine's ``NgramIndex`` proposals, its load limit empties every proposal
above the limit (and not at it; no limit as the control), and a batch row that changes request is indexed
afresh."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from engine.lookup import NgramIndex, parse_lookup
from peers import vllm_peer
from peers.vllm_lookup import CLASS_PATH, SETTING_ENV, LookupProposer, proposer_config

REPEATING = [5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7, 8, 9, 4, 5, 6, 7]  # "6 7" / "5 6 7" repeat: a lookup match


def batch(rows: list[list[int]], width: int = 64) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """(sampled_token_ids, num_tokens_no_spec, token_ids_cpu) of a step in which every row just committed
    its last token."""
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return [row[-1:] for row in rows], np.array([len(r) for r in rows]), tokens


def engine_proposal(setting: str, tokens: list[int], limit: int) -> list[int]:
    return NgramIndex(parse_lookup(setting).rules, tokens).propose(limit)


def test_proposals_are_the_engines_lookup():
    setting = "3-4:2+8:4"
    proposer = LookupProposer(config=parse_lookup(setting))
    rows = [REPEATING, REPEATING[:10], list(range(20))]  # a match, a shorter match, no match
    out = proposer.propose(*batch(rows))
    expected = [engine_proposal(setting, row, 4) for row in rows]
    assert out == expected
    assert out[0] and out[2] == []  # the check compares real proposals, and a miss is empty


def test_vllm_caps_the_proposal_length():
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=1), model_config=None)
    proposer = LookupProposer(config, config=parse_lookup("3-4:2"))
    (out,) = proposer.propose(*batch([REPEATING]))
    assert len(out) == 1 and out == engine_proposal("3-4:2", REPEATING, 1)


def test_the_load_limit_counts_the_requests_decoding_in_the_step():
    rows = [REPEATING] * 3
    limited = LookupProposer(config=parse_lookup("3-4:2@2"))
    assert limited.propose(*batch(rows)) == [[], [], []]  # 3 decode: over the limit
    sampled, lengths, tokens = batch(rows)
    sampled[2] = []  # the third row skips speculation (mid prefill): 2 decode, at the limit
    out = limited.propose(sampled, lengths, tokens)
    assert out[0] and out[0] == out[1] and out[2] == []
    unlimited = LookupProposer(config=parse_lookup("3-4:2"))  # the control: no limit, proposals at 3
    assert all(unlimited.propose(*batch(rows)))


def test_a_row_that_changes_request_is_indexed_afresh():
    proposer = LookupProposer(config=parse_lookup("3-4:2"))
    proposer.propose(*batch([REPEATING[:12]]))
    proposer.propose(*batch([REPEATING[:14]]))  # the same request two tokens on: the index extends
    other = [9, 9, 1, 2, 3, 4, 1, 2, 3]  # another request in the row
    (out,) = proposer.propose(*batch([other]))
    assert out == engine_proposal("3-4:2", other, 2) == [4, 1]
    (again,) = proposer.propose(*batch([REPEATING]))
    assert again == engine_proposal("3-4:2", REPEATING, 2)


def test_no_proposal_past_the_context_room():
    config = SimpleNamespace(
        speculative_config=None, model_config=SimpleNamespace(max_model_len=len(REPEATING) + 2)
    )
    (out,) = LookupProposer(config, config=parse_lookup("3-4:2")).propose(*batch([REPEATING]))
    assert out == engine_proposal("3-4:2", REPEATING, 1)  # room for one token besides the bonus token
    tight = SimpleNamespace(
        speculative_config=None, model_config=SimpleNamespace(max_model_len=len(REPEATING) + 1)
    )
    assert LookupProposer(tight, config=parse_lookup("3-4:2")).propose(*batch([REPEATING])) == [[]]


def test_the_setting_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(SETTING_ENV, "3-4:2+8:4@2")
    proposer = LookupProposer(SimpleNamespace())
    assert proposer.config == parse_lookup("3-4:2+8:4@2")
    monkeypatch.setenv(SETTING_ENV, "off")
    with pytest.raises(ValueError, match="off"):
        LookupProposer(SimpleNamespace())


def test_command_line_and_config():
    assert proposer_config("3-4:2+8:4@2") == {
        "method": "custom_class",
        "model": CLASS_PATH,
        "num_speculative_tokens": 4,
    }
    with pytest.raises(ValueError, match="off"):
        proposer_config("off")
    argv, env = vllm_peer.vllm_command("/venv/bin/python", "/ckpt/target", lookup="3-4:2@2", dtype="bfloat16")
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config["model"] == CLASS_PATH and config["num_speculative_tokens"] == 2
    assert env[SETTING_ENV] == "3-4:2@2" and env["PYTHONPATH"] == str(vllm_peer.REPO)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    with pytest.raises(ValueError, match="not both"):
        vllm_peer.vllm_command("/venv/bin/python", "/ckpt/target", draft="/ckpt/draft", k=2, lookup="on")
