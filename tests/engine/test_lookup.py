"""Context lookup proposals (``engine.lookup``): which occurrence, which n, how many tokens, incremental
updates equal to a fresh index, and the command-line setting parser."""

from __future__ import annotations

import random

import pytest

from engine.errors import InputError
from engine.lookup import LookupConfig, NgramIndex, describe_lookup, parse_lookup


def brute_force(config: LookupConfig, seq: list[int], limit: int) -> list[int]:
    """The definition, written out: if the context's last ``long_ngram`` tokens occur earlier, the tokens after
    their latest earlier occurrence, up to ``long_tokens``; else the longest n in [min, max] whose suffix n-gram
    occurs earlier, the latest such occurrence, up to ``max_tokens``; never more than ``limit``."""
    rules = [(config.long_ngram, config.long_tokens)] if config.long_ngram else []
    rules += [(n, config.max_tokens) for n in range(config.max_ngram, config.min_ngram - 1, -1)]
    for n, tokens in rules:
        if len(seq) < n + 1:
            continue
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + min(limit, tokens)]
    return []


def lookup_proposal(config: LookupConfig, tokens: list[int], limit: int) -> list[int]:
    return NgramIndex(config, tokens).propose(limit)


def test_latest_occurrence_and_longest_ngram_win():
    cfg = LookupConfig(1, 3, 4)
    #            0  1  2  3  4  5  6  7  8  9
    seq = [7, 1, 2, 9, 1, 2, 5, 6, 3, 1, 2]
    # suffix (1, 2): 3-gram (3, 1, 2) never occurred before; 2-gram (1, 2) at 1 and 4: the latest (4) wins
    assert lookup_proposal(cfg, seq, 4) == [5, 6, 3, 1]
    assert lookup_proposal(cfg, seq, 2) == [5, 6]
    assert lookup_proposal(cfg, seq, 0) == []
    # a longer match beats a later shorter one: (9, 1, 2) occurred at 3..5 -> [5, 6], (1, 2) later would give 8
    seq2 = [9, 1, 2, 5, 6, 1, 2, 8, 9, 1, 2]
    assert lookup_proposal(cfg, seq2, 2) == [5, 6]
    assert lookup_proposal(LookupConfig(1, 2, 2), seq2, 2) == [8, 9]


def test_no_match_below_min_ngram_and_the_suffix_itself_never_matches():
    assert lookup_proposal(LookupConfig(2, 3, 4), [1, 2, 3, 4, 5, 1], 4) == []  # only a 1-gram repeats
    assert lookup_proposal(LookupConfig(1, 1, 4), [1, 2, 3, 4, 5, 1], 4) == [2, 3, 4, 5]
    assert lookup_proposal(LookupConfig(1, 1, 4), [1, 2, 3], 4) == []
    assert lookup_proposal(LookupConfig(1, 1, 4), [], 4) == []
    # the latest earlier occurrence overlaps the suffix: its continuation runs to the end of the context
    assert lookup_proposal(LookupConfig(2, 2, 5), [4, 4, 4, 4], 5) == [4]


def test_a_long_match_goes_first_and_proposes_its_own_number_of_tokens():
    cfg = LookupConfig(1, 2, 1, long_ngram=4, long_tokens=3)
    #      0  1  2  3  4  5  6  7  8  9 10 11 12
    seq = [1, 2, 3, 4, 5, 6, 7, 9, 3, 4, 8, 1, 2, 3, 4]
    # the 4-gram (1, 2, 3, 4) occurred at 0..3: its 3 followers, although (3, 4) occurred later (at 8..9)
    assert lookup_proposal(cfg, seq, 10) == [5, 6, 7]
    assert lookup_proposal(cfg, seq, 2) == [5, 6]  # the cycle's cap still bounds it
    # without a long match, the short rule: (3, 4) latest at 8..9, one token
    assert lookup_proposal(cfg, seq[:11] + [0, 3, 4], 10) == [8]
    assert lookup_proposal(LookupConfig(1, 2, 1, 0, 0), seq, 10) == [8]  # long_ngram 0: no long rule
    assert cfg.most_tokens == 3 and LookupConfig(1, 2, 5, 4, 3).most_tokens == 5
    assert LookupConfig(1, 2, 1, 0, 7).most_tokens == 1


def test_incremental_index_equals_the_definition():
    rng = random.Random(0)
    for config in (
        LookupConfig(1, 1, 3, 3, 5),
        LookupConfig(2, 4, 2, 0, 0),
        LookupConfig(3, 5, 6, 7, 2),
        LookupConfig(),
    ):
        seq = [rng.randrange(5) for _ in range(6)]
        index = NgramIndex(config, seq)
        for _ in range(300):
            for limit in (1, config.max_tokens, 10):
                assert index.propose(limit) == brute_force(config, seq, limit), (config, seq, limit)
            grow = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
            seq = seq + grow
            index.sync(seq)
            assert index.tokens == seq


@pytest.mark.parametrize(
    "spec, want",
    [
        ("off", None),
        ("", None),
        ("on", LookupConfig()),
        ("on", LookupConfig(3, 4, 2, 8, 4)),
        ("3-4:2", LookupConfig(3, 4, 2, 0, 0)),  # an explicit rule alone: no long-match rule
        ("2:5", LookupConfig(2, 2, 5, 0, 0)),
        ("3-4:2+8:4", LookupConfig(3, 4, 2, 8, 4)),
        ("1-2:3+5:6", LookupConfig(1, 2, 3, 5, 6)),
    ],
)
def test_setting_parser(spec, want):
    assert parse_lookup(spec) == want
    assert parse_lookup(describe_lookup(want)) == want


@pytest.mark.parametrize(
    "spec, message",
    [
        ("3-4", "expected"),
        ("a", "expected"),
        ("-1:2", "expected"),
        ("0-1:2", "min_ngram must be an integer >= 1"),
        ("4-3:2", "max_ngram (3) must be >= min_ngram (4)"),
        ("3-4:0", "max_tokens must be an integer >= 1"),
        ("3-4:2+8", "expected"),
        ("3-4:2+4:4", "must be longer than max_ngram (4)"),
        ("3-4:2+8:0", "propose at least one token"),
        ("3-4:2+8-9:4", "expected"),
    ],
)
def test_bad_settings_are_clear_errors(spec, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_lookup(spec)
    with pytest.raises(InputError):
        LookupConfig(2, 1, 1)


def test_a_stored_on_means_the_setting_of_its_day():
    """Policy files written before the long-match rule store "on" for 3-4:2; train.py now stores the resolved
    setting, so a stored "on" is always the old one."""
    from engine.lookup import stored_lookup

    assert stored_lookup("on") == LookupConfig(3, 4, 2, 0, 0)
    assert stored_lookup("3-4:2+8:4") == LookupConfig() and stored_lookup("off") is None
    assert stored_lookup(None) is None
