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
        ("on@2", LookupConfig(max_requests=2)),
        ("3-4:2+8:4@4", LookupConfig(3, 4, 2, 8, 4, max_requests=4)),
        ("2:5@1", LookupConfig(2, 2, 5, 0, 0, max_requests=1)),
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
        ("on@", "load limit after @"),
        ("3-4:2@x", "load limit after @"),
        ("3-4:2@-1", "load limit after @"),
        ("3-4@2", "expected"),
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


def test_the_load_limit_gates_lookup_by_the_requests_decoding():
    """``max_requests`` N: lookup runs alone and while at most N requests decode in a step, never above; 0 (the
    default) at every load. The proposals themselves do not depend on it (``rules``)."""
    from engine.load import LoadState

    limited, free = LookupConfig(max_requests=2), LookupConfig()
    assert limited.runs_at(None) and free.runs_at(None)
    assert limited.runs_at(LoadState(requests=1)) and limited.runs_at(LoadState(requests=2))
    assert not limited.runs_at(LoadState(requests=3))
    assert free.runs_at(LoadState(requests=64))
    assert limited.rules == free and free.rules is free
    with pytest.raises(InputError, match="max_requests"):
        LookupConfig(max_requests=-1)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("limit", [1, 0])
def test_a_batched_engine_looks_up_only_within_the_load_limit(limit):
    """In a batch, a request's cycle runs a lookup only while the step's decoding requests are within the limit
    (limit 1: never while two decode; 0, the control: lookup cycles under load too); alone it always looks
    up; every request's greedy tokens are its tokens alone either way (a lookup changes speed, not tokens)."""
    from engine.backends.models import load_pair
    from engine.batch import BatchedEngine
    from engine.batch_api import BatchConfig, BatchRequest
    from engine.control import StaticController
    from engine.engine import SpeculativeEngine
    from engine.inputs import EngineConfig

    pair = load_pair("tiny", device="cpu")
    lookup = LookupConfig(
        min_ngram=1, max_ngram=2, max_tokens=3, long_ngram=0, long_tokens=0, max_requests=limit
    )
    prompts = ["a b a b a b a b a b", "x y z x y z x y z x y z"]
    makers = [lambda: None, lambda: StaticController(0)]
    alone = SpeculativeEngine(pair, config=EngineConfig(lookup=lookup))
    want = [alone.generate(p, 24, m()) for p, m in zip(prompts, makers)]
    assert any(c.lookup for r in want for c in r.cycles), "alone, lookup cycles happen (the test's premise)"
    batch = BatchedEngine(pair, BatchConfig(max_requests=2, engine=EngineConfig(lookup=lookup)))
    rids = [batch.add(BatchRequest(p, 24, m())) for p, m in zip(prompts, makers)]
    under_load, done = [], {}
    while batch.active or batch.pending:
        for ev in batch.step():
            load = batch.load_of(ev.rid)  # None once it finished (its last cycle is left out)
            if ev.record is not None and load is not None and load.requests > 1:
                under_load.append(ev.record.lookup)
            if ev.finished:
                done[ev.rid] = batch.result(ev.rid).tokens
    assert len(under_load) >= 10
    if limit == 1:
        assert not any(under_load)
    else:
        assert any(under_load)
    assert [done[r] for r in rids] == [r.tokens for r in want]
