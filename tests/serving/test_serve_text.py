"""``serving.text``: the incremental detokenizer (deltas that concatenate to the decode of every token, a
split multi-byte character held until it completes) on the tiny pair's byte-level tokenizer, and the stop
string matcher (stops split across feeds, overlapping prefixes, the same cut however the text is chunked)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from serving.text import Detokenizer, StopMatcher

EXAMPLES = settings(max_examples=300, deadline=None, database=None)


@pytest.fixture(scope="module")
def tokenizer(tiny_pair_f32):
    """The tiny pair's tokenizer: UTF-8 bytes as ids 0..255, EOS 256, padding ids up to 271 (decoded to
    nothing), invalid UTF-8 decoded with U+FFFD."""
    tok = tiny_pair_f32.tokenizer
    assert tok.encode("é") == [0xC3, 0xA9]  # byte-level: a multi-byte character is several ids
    return tok


def feed_in_chunks(detok: Detokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Deltas of feeding ``ids`` split at ``cuts``, then the flush."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    deltas = [detok.feed(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return deltas + [detok.flush()]


# --------------------------------------------------------------------------------------- Detokenizer
@pytest.mark.parametrize(
    "text",
    ["plain ascii", "héllo wörld", "你好，世界", "emoji 🎉🚀 and more", "mixed: aé你🎉z", "\n\t\x00 control"],
)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_deltas_concatenate_to_the_text(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    deltas = feed_in_chunks(Detokenizer(tokenizer), ids, list(range(chunk, len(ids), chunk)))
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # valid UTF-8: a split character never shows as U+FFFD


def test_a_split_character_is_held_until_it_completes(tokenizer):
    detok = Detokenizer(tokenizer)
    ni = tokenizer.encode("你")  # three ids
    party = tokenizer.encode("🎉")  # four ids
    assert (len(ni), len(party)) == (3, 4)
    assert detok.feed([tokenizer.encode("a")[0]]) == "a"
    assert [detok.feed([i]) for i in ni] == ["", "", "你"]
    assert detok.feed(party[:3]) == ""
    # completes one character and starts the next: what is out may wait for the next, never shows U+FFFD
    out = detok.feed(party[3:] + ni[:1])
    assert out in ("", "🎉")
    assert out + detok.feed(ni[1:]) == "🎉你"
    assert detok.flush() == ""


def test_an_incomplete_character_at_the_end_flushes_as_decode_does(tokenizer):
    ids = tokenizer.encode("A") + tokenizer.encode("你")[:2]
    detok = Detokenizer(tokenizer)
    assert [detok.feed([i]) for i in ids] == ["A", "", ""]
    assert detok.flush() == "\ufffd" == tokenizer.decode(ids)[1:]


def test_special_ids_decode_to_nothing(tokenizer):
    eos = tokenizer.eos_token_id
    detok = Detokenizer(tokenizer)
    assert detok.feed([eos]) == ""
    assert detok.feed(tokenizer.encode("ok") + [eos, 271]) == "ok"
    assert detok.flush() == ""


def test_a_long_output_still_decodes_exactly(tokenizer):
    text = "".join(f"line {i}: é你🎉\n" for i in range(300))
    ids = tokenizer.encode(text)
    deltas = feed_in_chunks(Detokenizer(tokenizer), ids, list(range(1, len(ids), 1)))
    assert "".join(deltas) == text


@EXAMPLES
@given(
    ids=st.lists(
        st.one_of(
            st.integers(0, 271),  # anything: invalid UTF-8, EOS, padding
            st.sampled_from([0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x8E, 0x89, 0xC3, 0xA9, 0x41]),  # pieces of chars
        ),
        max_size=60,
    ),
    cuts=st.lists(st.integers(1, 59), max_size=20),
)
def test_any_ids_in_any_chunks_concatenate_to_decode(tokenizer, ids, cuts):
    """What the server streams is the decode of everything it generated, whatever bytes the model emits
    (the tiny pair's are often not UTF-8) and however the steps group them; no delta is ever taken back."""
    detok = Detokenizer(tokenizer)
    deltas = feed_in_chunks(detok, ids, cuts)
    assert "".join(deltas) == tokenizer.decode(ids)


# --------------------------------------------------------------------------------------- StopMatcher
def run_matcher(stops, pieces):
    m = StopMatcher(stops)
    outs = [m.feed(p) for p in pieces]
    return outs, m.flush(), m.stopped


def test_a_stop_split_across_feeds_is_cut_and_never_sent():
    outs, tail, stopped = run_matcher(["END"], ["abcE", "N", "Dxyz", "more"])
    assert outs == ["abc", "", "", ""]
    assert (tail, stopped) == ("", True)


def test_overlapping_prefixes_hold_only_what_may_still_become_a_stop():
    outs, tail, stopped = run_matcher(["aab"], ["a", "a", "a", "b", "c"])
    assert outs == ["", "", "a", "", ""]  # "aaa": the first "a" can no longer begin "aab"
    assert (tail, stopped) == ("", True)


def test_the_earliest_of_several_stops_wins():
    outs, _, stopped = run_matcher(["zz", "cd", "bcd"], ["ab", "cdzz"])
    assert "".join(outs) == "a" and stopped  # "bcd" begins first


def test_a_shorter_stop_completing_first_wins_whatever_the_chunks():
    """The stop "bc" completes before "abcd" does: streamed a character at a time the text stops at "a"; it must
    stop there as well when a step commits the whole text at once."""
    for pieces in (["a", "b", "c", "d"], ["abcd"], ["ab", "cd"], ["abc", "d"]):
        outs, _, stopped = run_matcher(["abcd", "bc"], pieces)
        assert ("".join(outs), stopped) == ("a", True), pieces


def test_negative_control_text_without_a_stop_passes_through():
    pieces = ["xab", "d, almost ", "ab", "x-less", " ... a", "b"]
    outs, tail, stopped = run_matcher(["abc", "STOP"], pieces)
    assert not stopped
    assert "".join(outs) + tail == "".join(pieces)
    assert tail == "ab"  # the end could have begun "abc": held, then flushed
    outs, tail, stopped = run_matcher([], pieces)
    assert outs == pieces and tail == "" and not stopped


def reference_cut(text: str, stops: list[str]) -> str | None:
    """The text before the stop that completes first (of those completing together, the longest), as when
    the text comes one character at a time; None: no stop occurs."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - max(len(s) for s in ending)]
    return None


@EXAMPLES
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(1, 29), max_size=10),
)
@example(text="baa", stops=["a", "baa"], cuts=[])
@example(text="xabcd", stops=["abcd", "bc"], cuts=[2])
def test_the_cut_does_not_depend_on_how_the_text_is_chunked(text, stops, cuts):
    """The server feeds the text a step at a time, and how many tokens a step commits depends on the drafting
    (speculation must never change an output): the matcher cuts the same text whatever the chunks."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    outs, tail, stopped = run_matcher(stops, pieces)
    expected = reference_cut(text, stops)
    if expected is None:
        assert not stopped and "".join(outs) + tail == text
    else:
        assert stopped and tail == ""
        assert "".join(outs) == expected
    assert not any(s in "".join(outs) for s in stops)
