"""The input-grounded prompt suite (prompts/grounded.jsonl), the mixed set, and the prompt-set names each
command takes (train.py, evaluate.py; benchmarks/serve_load.py --prompts: tests/evaluation/test_serve_load.py); no models."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from engine.backends.tiny import ByteTokenizer
from envs.prompts import (
    DEFAULT_SUITE,
    GROUNDED_SUITE,
    GROUNDED_TASKS,
    LANGUAGES,
    SPLITS,
    is_prompt_set,
    load_suite,
    read_suite,
    suite_split,
)

KEYS = {"id", "language", "task", "split", "prompt", "max_tokens"}
SPLIT_SIZES = {"train": 4, "tune": 2, "test": 5}
"""Prompts per language and split."""
TINY_PROMPT_BYTES = (900, 3000)
"""Every prompt's length on the tiny pair's byte tokenizer (its tokens are UTF-8 bytes), inclusive."""
REAL_PROMPT_TOKENS = (150, 900)
"""Every prompt's length on the default pair's tokenizer (the user message alone, no chat template): measured
195-844, median 427 (translations ~200, module edits and tests 340-480, summaries and questions 460-840)."""
MAX_TOKENS = (128, 512)
"""Every prompt's ``max_tokens`` (the answer's expected length)."""


@pytest.fixture(scope="module")
def grounded():
    return load_suite("grounded")


def test_file_is_utf8_jsonl_with_every_key(grounded):
    text = GROUNDED_SUITE.read_text(encoding="utf-8")
    lines = text.split("\n")
    assert lines[-1] == "" and all(line.strip() for line in lines[:-1])
    assert all(set(json.loads(line)) == KEYS for line in lines[:-1])
    assert len(grounded) == 44 and read_suite(GROUNDED_SUITE) == grounded


def test_shape_splits_and_parallel_languages(grounded):
    for item in grounded:
        lang, kind, task, nn = item["id"].split("-")
        assert (lang, kind, task) == (item["language"], "grounded", item["task"]), item["id"]
        assert item["task"] in GROUNDED_TASKS and item["split"] in SPLITS and re.fullmatch(r"\d\d", nn)
    bases = {}
    for lang in LANGUAGES:
        mine = [item for item in grounded if item["language"] == lang]
        assert Counter(item["split"] for item in mine) == SPLIT_SIZES
        bases[lang] = {(item["id"].rsplit("-", 1)[1], item["task"], item["split"]) for item in mine}
    assert all(bases[lang] == bases["en"] for lang in LANGUAGES)  # the same base items, split alike
    test_tasks = {task for _, task, split in bases["en"] if split == "test"}
    assert test_tasks == set(GROUNDED_TASKS) - {"summary"}  # every kind but the summary is measured


def test_splits_are_disjoint_by_id_and_by_content(grounded):
    by_split = {split: [item for item in grounded if item["split"] == split] for split in SPLITS}
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not {i["id"] for i in by_split[a]} & {i["id"] for i in by_split[b]}
                assert not {i["prompt"] for i in by_split[a]} & {i["prompt"] for i in by_split[b]}
                # no given text (the part after the instruction) is shared across splits either
                given = [{i["prompt"].split("\n\n", 1)[1] for i in by_split[s]} for s in (a, b)]
                assert not given[0] & given[1], (a, b)
    assert len({item["prompt"] for item in grounded}) == len(grounded)


def test_lengths_on_the_tiny_tokenizer_and_max_tokens(grounded):
    tokenizer = ByteTokenizer()
    for item in grounded:
        n = len(tokenizer.encode(item["prompt"]))
        assert TINY_PROMPT_BYTES[0] <= n <= TINY_PROMPT_BYTES[1], (item["id"], n)
        assert MAX_TOKENS[0] <= item["max_tokens"] <= MAX_TOKENS[1], item["id"]
    # edits and tests return a whole module or test file: the longest answers
    assert {i["max_tokens"] for i in grounded if i["task"] in ("edit", "tests")} == {512}


def test_given_code_compiles_and_has_40_to_150_lines(grounded):
    for item in grounded:
        match = re.search(r"```python\n(.*?)```", item["prompt"], re.S)
        assert (match is not None) == (item["task"] in ("edit", "tests")), item["id"]
        if match:
            compile(match.group(1), item["id"], "exec")
            assert 40 <= match.group(1).count("\n") <= 150, item["id"]


@pytest.mark.slow
def test_lengths_on_the_default_pairs_tokenizer(grounded):
    from engine.backends.weights import pair_tokenizer

    tokenizer = pair_tokenizer("qwen2.5-coder")
    for item in grounded:
        n = len(tokenizer.encode(item["prompt"]))
        assert REAL_PROMPT_TOKENS[0] <= n <= REAL_PROMPT_TOKENS[1], (item["id"], n)


def test_the_mixed_set_alternates_grounded_and_suite_prompts(grounded):
    suite = load_suite(DEFAULT_SUITE)
    mixed = load_suite("mixed")
    assert len({item["id"] for item in mixed}) == len(mixed) == 2 * len(grounded)
    for lang in LANGUAGES:
        for split in SPLITS:
            mine = [i for i in mixed if i["language"] == lang and i["split"] == split]
            assert [i in grounded for i in mine] == [True, False] * SPLIT_SIZES[split]
            assert all(i in suite for i in mine[1::2])
    # a per-language prefix holds both halves: 2 per language = 1 grounded + 1 open-ended
    quick = suite_split("test", 2, "mixed")
    assert sum(i in grounded for i in quick) == sum(i not in grounded for i in quick) == len(LANGUAGES)


def test_set_names_and_files():
    assert all(is_prompt_set(n) for n in ("suite", "long", "grounded", "mixed"))
    assert not is_prompt_set("grounded.jsonl") and not is_prompt_set(None)
    assert load_suite("suite") == load_suite()
    with pytest.raises(Exception, match="cannot be read"):
        load_suite("no-such-set")


# ------------------------------------------------------------------------------ the commands' flags
def test_train_selects_the_named_sets():
    from training.train_config import TrainConfig, config_differences, effective_config
    from training.train_data import select_prompts

    config = TrainConfig(pair="tiny", prompts="grounded", train_prompts=4, val_prompts=2)
    train, val = select_prompts(config)
    assert len(train) == 16 and len(val) == 8 and all("-grounded-" in p["id"] for p in train + val)
    assert {p["split"] for p in train} == {"train"} and {p["split"] for p in val} == {"tune"}
    stored = effective_config(config)
    assert stored.prompts == "grounded"  # a set's name is stored as a name, not as a path
    assert config_differences({"prompts": "grounded"}, {"prompts": "mixed"}) == [
        "--prompts: 'grounded' -> 'mixed'"
    ]
    train, _ = select_prompts(TrainConfig(pair="tiny", prompts="mixed", train_prompts=2, val_prompts=1))
    assert sum("-grounded-" in p["id"] for p in train) == len(train) // 2


def test_evaluate_selects_the_named_sets():
    from evaluation.config import EvalConfig, select_prompts

    config = EvalConfig(pair="tiny", prompts="grounded", controllers="goodput", tune_prompts_per_language=1)
    tune, test, warnings = select_prompts(config)
    assert len(test) == 20 and len(tune) == 4 and not warnings
    assert config.resolved().prompts == "grounded"
    _, test, _ = select_prompts(EvalConfig(pair="tiny", prompts="mixed", prompts_per_language=2))
    assert sum("-grounded-" in p["id"] for p in test) == 4
