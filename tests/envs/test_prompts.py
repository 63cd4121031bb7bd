"""The shipped prompt suite (prompts/suite.jsonl) and its loader (envs.prompts); no models."""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter

import pytest

from envs.prompts import DEFAULT_SUITE, LANGUAGES, SPLITS, TASKS, interleave_languages, load_suite

CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
KEYS = {"id", "language", "task", "split", "prompt"}
SPLIT_SIZES = {"train": 20, "tune": 8, "test": 12}


@pytest.fixture(scope="module")
def suite():
    return load_suite()


def test_file_is_utf8_jsonl_without_blank_lines():
    text = DEFAULT_SUITE.read_text(encoding="utf-8")
    lines = text.split("\n")
    assert lines[-1] == "" and all(line.strip() for line in lines[:-1])  # one final newline, no blank lines
    assert CJK.search(text)  # written with ensure_ascii=False
    assert all(set(json.loads(line)) == KEYS for line in lines[:-1])


def test_suite_shape(suite):
    assert len(suite) == 160
    for item in suite:
        assert set(item) == KEYS
        assert all(isinstance(item[k], str) and item[k].strip() for k in KEYS), item
        assert item["language"] in LANGUAGES and item["task"] in TASKS and item["split"] in SPLITS
        lang, task, nn = item["id"].split("-")
        assert (lang, task) == (item["language"], item["task"]) and re.fullmatch(r"\d\d", nn), item["id"]
        assert 1 <= int(nn) <= 40
    for lang in LANGUAGES:
        mine = [item for item in suite if item["language"] == lang]
        assert len(mine) == 40
        assert Counter(item["split"] for item in mine) == SPLIT_SIZES
        for split in SPLITS:
            tasks = Counter(item["task"] for item in mine if item["split"] == split)
            assert set(tasks) == set(TASKS), (lang, split, tasks)
            if split == "test":
                assert min(tasks.values()) >= 2, (lang, tasks)


def test_languages_are_parallel(suite):
    def base(lang):
        return {
            (item["id"].rsplit("-", 1)[1], item["task"], item["split"])
            for item in suite
            if item["language"] == lang
        }

    reference = base("en")
    assert {nn for nn, _, _ in reference} == {f"{i:02d}" for i in range(1, 41)}
    for lang in LANGUAGES:
        assert base(lang) == reference, lang
    by_nn: dict[str, set[str]] = {}
    for item in suite:
        by_nn.setdefault(item["id"].rsplit("-", 1)[1], set()).add(item["prompt"])
    assert all(len(prompts) == 4 for prompts in by_nn.values())  # four different texts per base item


def test_scripts_and_lengths(suite):
    for item in suite:
        assert bool(CJK.search(item["prompt"])) == (item["language"] == "zh"), item["id"]
    median = {
        lang: statistics.median(len(item["prompt"]) for item in suite if item["language"] == lang)
        for lang in LANGUAGES
    }
    latin = [median[lang] for lang in ("it", "en", "es")]
    assert max(latin) <= 1.6 * min(latin), median
    assert median["zh"] >= 0.2 * median["en"], median


def test_load_suite_filters(suite):
    tune_test = load_suite(split=["tune", "test"])
    assert len(tune_test) == 80 and {item["split"] for item in tune_test} == {"tune", "test"}
    assert tune_test == [item for item in suite if item["split"] != "train"]  # file order kept
    assert len(load_suite(split="test")) == 48
    zh_es = load_suite(languages=["zh", "es"], split="train")
    assert len(zh_es) == 40 and {item["language"] for item in zh_es} == {"zh", "es"}
    assert [item["id"] for item in load_suite(languages="it", split="tune")][:2] == [
        "it-code-21",
        "it-explanation-22",
    ]
    quick = load_suite(split="test", limit_per_language=3)
    assert Counter(item["language"] for item in quick) == {lang: 3 for lang in LANGUAGES}
    assert [item["id"] for item in quick if item["language"] == "en"] == [
        "en-code-29",
        "en-explanation-30",
        "en-math-31",
    ]
    with pytest.raises(ValueError, match="unknown split"):
        load_suite(split="valid")
    with pytest.raises(ValueError, match="no prompts selected"):
        load_suite(languages=["fr"])
    with pytest.raises(ValueError, match="no prompts selected"):
        load_suite(split="tune", limit_per_language=0)


def test_user_file_without_splits(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"id": "a", "prompt": "Hello"},
        {"id": "b", "prompt": "Ciao", "language": "it"},
        {"id": "c", "prompt": "Hi again"},
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    assert [item["id"] for item in load_suite(path)] == ["a", "b", "c"]
    assert [item["id"] for item in load_suite(str(path), languages=["unknown"])] == ["a", "c"]
    assert [item["id"] for item in load_suite(path, limit_per_language=1)] == ["a", "b"]
    with pytest.raises(ValueError, match="no prompt in the file has a 'split' key"):
        load_suite(path, split="test")
    rows[2]["id"] = "a"  # the shared validator rejects duplicate ids
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="duplicate"):
        load_suite(path)


def test_interleave_languages():
    items = (
        [{"id": f"es{i}", "language": "es"} for i in range(3)]
        + [{"id": "x0"}]
        + [{"id": f"it{i}", "language": "it"} for i in range(2)]
        + [{"id": "en0", "language": "en"}]
        + [{"id": "zh0", "language": "zh"}]
    )
    assert [item["id"] for item in interleave_languages(items)] == [
        "it0",
        "en0",
        "zh0",
        "es0",
        "x0",
        "it1",
        "es1",
        "es2",
    ]
    assert interleave_languages([]) == []


def test_interleaved_suite_prefixes_are_balanced(suite):
    mixed = interleave_languages(load_suite(split="tune"))
    assert sorted(item["id"] for item in mixed) == sorted(
        item["id"] for item in suite if item["split"] == "tune"
    )
    for n in (4, 8, 12):
        assert Counter(item["language"] for item in mixed[:n]) == {lang: n // 4 for lang in LANGUAGES}
    assert [item["language"] for item in mixed[:4]] == list(LANGUAGES)


@pytest.mark.slow
def test_cold_prompts_have_the_length_asked_and_no_shared_prefix():
    from envs.prompts import cold_prompts

    for tokens, count in ((512, 3), (1500, 6)):
        prompts = cold_prompts("qwen2.5-coder", tokens, count)
        assert [len(p) for p in prompts] == [tokens] * count
        # prefix caches must find nothing to reuse between them
        assert len({tuple(p[:16]) for p in prompts}) == count
