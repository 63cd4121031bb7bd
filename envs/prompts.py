"""The project's prompt suites (docs/design.md section 7) and a small loader.

``prompts/suite.jsonl`` holds 40 base items written in four parallel languages (Italian, English, Chinese,
Spanish): the same content, task and split in each, so request and answer lengths are comparable across
languages. Each line is ``{"id": "<lang>-<task>-<NN>", "language", "task", "split", "prompt"}``; the
splits are ``train`` (the learned policy, 20 per language), ``tune`` (static grids, 8) and ``test``
(reporting only, 12; never tune on it). ``prompts/long.jsonl`` (``LONG_SUITE``) has the same layout for
long requests: long contexts, long answers.

``prompts/grounded.jsonl`` (``GROUNDED_SUITE``) holds input-grounded requests, whose answers copy much of their
input (the workload where context lookup and a well-accepted draft pay most): edits of a given 44-50 line
Python module (rename, add a parameter, fix a marked bug, add types and docstrings; the whole module comes
back), pytest tests for a given module, a summary of and questions over a given 400-600 word text, and the
translation of a given paragraph; 11 base items in the four languages (train 4, tune 2, test 5 per language),
each with a ``max_tokens`` key: the answer's expected length (256 to 512 tokens). Prompts are 195-844 tokens on
the default pair's tokenizer (median 427): too long for the tiny pair's 1,024-byte context.

Commands name a prompt set by file or by name (``PROMPT_SETS``): ``suite``, ``long``, ``grounded``, or
``mixed``: per language and split, grounded and open-ended suite prompts alternating one to one (the first
as many suite prompts of that language and split as it has grounded ones), so any per-language prefix holds
both halves equally.

    from envs.prompts import suite_split
    quick = suite_split("tune", 2)  # interleave_languages(load_suite(split="tune", limit_per_language=2))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from envs.recording import read_prompts

DEFAULT_SUITE: Path = Path(__file__).resolve().parents[1] / "prompts" / "suite.jsonl"
"""The shipped suite: 160 prompts, 40 per language (20 train, 8 tune, 12 test)."""
LONG_SUITE: Path = DEFAULT_SUITE.with_name("long.jsonl")
"""The shipped long suite: 28 prompts, 7 per language (2 train, 2 tune, 3 test), each an instruction on a
~1.3-2.2k-token context (a frozen copy of one of the project's modules or design sections) asking for a long
answer (tests, a detailed explanation): the length axis of the shift evaluation, 512 new tokens."""
GROUNDED_SUITE: Path = DEFAULT_SUITE.with_name("grounded.jsonl")
"""The shipped input-grounded suite: 44 prompts, 11 per language (4 train, 2 tune, 5 test)."""
PROMPT_SETS: dict[str, Path | None] = {
    "suite": DEFAULT_SUITE,
    "long": LONG_SUITE,
    "grounded": GROUNDED_SUITE,
    "mixed": None,
}
"""The prompt sets a command names instead of a file (``--prompts NAME``); ``mixed`` is made from two of them
(``mixed_suite``)."""
GROUNDED_TASKS = ("edit", "tests", "summary", "qa", "translation")
LANGUAGES = ("it", "en", "zh", "es")
"""The suite's languages, in the order ``interleave_languages`` cycles through them."""
SPLITS = ("train", "tune", "test")
TASKS = ("code", "explanation", "math", "rewrite", "qa")
UNKNOWN_LANGUAGE = "unknown"
"""The language of an item without a ``language`` key (a user's own prompt file)."""


def language_of(item: dict) -> str:
    """The item's ``language``, or ``UNKNOWN_LANGUAGE`` when it has none."""
    return str(item.get("language") or UNKNOWN_LANGUAGE)


def is_prompt_set(value: str | Path | None) -> bool:
    """Whether ``value`` names one of ``PROMPT_SETS`` (rather than a file)."""
    return isinstance(value, str) and value in PROMPT_SETS


def mixed_suite() -> list[dict]:
    """The ``mixed`` set (module docstring): per language and split, grounded and suite prompts alternating,
    grounded first, as many suite prompts as grounded ones."""
    grounded, suite = read_prompts(GROUNDED_SUITE), read_prompts(DEFAULT_SUITE)
    out: list[dict] = []
    for lang in LANGUAGES:
        for split in SPLITS:
            mine = [item for item in grounded if language_of(item) == lang and item.get("split") == split]
            theirs = [item for item in suite if language_of(item) == lang and item.get("split") == split]
            for pair in zip(mine, theirs):
                out.extend(pair)
    return out


def read_suite(path: str | Path | None = None) -> list[dict]:
    """Every prompt of a suite file or of a named set (``PROMPT_SETS``; None: ``DEFAULT_SUITE``), validated by
    ``envs.recording.read_prompts``."""
    if path is None:
        return read_prompts(DEFAULT_SUITE)
    if is_prompt_set(path):
        source = PROMPT_SETS[str(path)]
        return mixed_suite() if source is None else read_prompts(source)
    return read_prompts(path)


def load_suite(
    path: str | Path | None = None,
    *,
    split: str | Sequence[str] | None = None,
    languages: Sequence[str] | None = None,
    limit_per_language: int | None = None,
) -> list[dict]:
    """Prompts of a JSONL suite or a named set (``read_suite``; ``DEFAULT_SUITE`` when ``path`` is None), in
    file order.

    The file is read and validated by ``envs.recording.read_prompts`` (unique, file-name-safe ids, string
    prompts); the items are returned as read. ``split`` keeps the items of that split or those splits (each
    one of ``SPLITS``); an item without a ``split`` key is in no split, and asking for a split from a file
    that has no ``split`` keys at all is an error. ``languages`` keeps those languages (an item without a
    ``language`` key is ``"unknown"``). ``limit_per_language`` then keeps the first N items of each
    language, so a quick run takes a balanced subset. Raises ValueError on an unknown split name, a negative
    limit or an empty selection.
    """
    source = DEFAULT_SUITE if path is None else path if is_prompt_set(path) else Path(path)
    items = read_suite(path)
    splits = (split,) if isinstance(split, str) else None if split is None else tuple(split)
    langs = (languages,) if isinstance(languages, str) else None if languages is None else tuple(languages)
    if splits is not None:
        unknown = [s for s in splits if s not in SPLITS]
        if unknown:
            raise ValueError(f"unknown split(s) {unknown}; the splits are {list(SPLITS)}")
        if not any("split" in item for item in items):
            raise ValueError(
                f"{source}: split={split!r} requested, but no prompt in the file has a 'split' key "
                "(load it without split=)"
            )
        items = [item for item in items if item.get("split") in splits]
    if langs is not None:
        items = [item for item in items if language_of(item) in langs]
    if limit_per_language is not None:
        if limit_per_language < 0:
            raise ValueError(f"limit_per_language must be >= 0, got {limit_per_language}")
        counts: dict[str, int] = {}
        kept = []
        for item in items:
            lang = language_of(item)
            if counts.get(lang, 0) < limit_per_language:
                counts[lang] = counts.get(lang, 0) + 1
                kept.append(item)
        items = kept
    if not items:
        raise ValueError(
            f"{source}: no prompts selected by split={split!r}, languages={languages!r}, "
            f"limit_per_language={limit_per_language!r}"
        )
    return items


def interleave_languages(items: list[dict]) -> list[dict]:
    """``items`` reordered round-robin by language (it, en, zh, es, it, en, ...; languages outside
    ``LANGUAGES`` follow in order of first appearance), each language keeping its own order, so that any
    prefix of the result is balanced across languages."""
    queues: dict[str, list[dict]] = {lang: [] for lang in LANGUAGES}
    for item in items:
        queues.setdefault(language_of(item), []).append(item)
    out: list[dict] = []
    for rank in range(max(map(len, queues.values()), default=0)):
        out.extend(queue[rank] for queue in queues.values() if rank < len(queue))
    return out


def suite_split(split: str, limit: int | None = None, path: str | Path | None = None) -> list[dict]:
    """A split of a suite (``DEFAULT_SUITE`` when ``path`` is None), ``limit`` items per language (None:
    all), interleaved across languages (``interleave_languages``)."""
    return interleave_languages(load_suite(path, split=split, limit_per_language=limit))


def cold_prompts(pair: str, tokens: int, count: int) -> list[list[int]]:
    """``count`` different prompts of exactly ``tokens`` token ids of ``pair``'s tokenizer, for cold-prompt
    timings: the suite's train prompts joined, each prompt cut from its own offset (997 tokens apart; the text
    repeats where it runs out), so no two share a prefix."""
    from engine.backends.weights import pair_tokenizer

    tok = pair_tokenizer(pair)
    text = " ".join(item["prompt"] for item in interleave_languages(load_suite(split="train")))
    ids = tok.encode(text)
    while len(ids) < 997 * (count - 1) + tokens:
        ids = ids + ids
    return [ids[k * 997 : k * 997 + tokens] for k in range(count)]
