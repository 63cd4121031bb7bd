"""Text of a stream: token ids to text deltas, and OpenAI ``stop`` strings.

``Detokenizer`` turns the tokens a request commits, a step at a time, into text deltas whose concatenation is
the decode of all of them: a token that ends inside a multi-byte character (the tokenizer decodes it to
U+FFFD) is held until the character completes. Decoding a window of the last few tokens, not the whole
output, keeps a step's cost constant in the output length.

``StopMatcher`` cuts the text before the first stop string to complete (the stop string itself is not
returned, as OpenAI's API does; the cut is the same however the text is chunked) and holds back a tail that
could still become one, so a streamed delta never has to be taken back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # tokens before the window: their text is out
        self._read = 0  # tokens whose text is out

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def feed(self, ids: Iterable[int]) -> str:
        """The text the new tokens ``ids`` complete ("" while a character is still incomplete)."""
        self.ids.extend(int(i) for i in ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text still held at the end of the stream (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""


class StopMatcher:
    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` that can be sent now; ``stopped`` turns true at a stop string, after which
        nothing more is returned."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        # the stop that completes first (of those completing at the same character, the longest): the cut a
        # character-at-a-time stream would make, so it does not depend on how many tokens a step commits
        first = min(((i + len(s), i) for s in self.stops if (i := buffer.find(s)) >= 0), default=None)
        if first is not None:
            self.stopped, self._held = True, ""
            return buffer[: first[1]]
        hold = 0  # the longest tail of buffer that begins some stop string
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:k]):
                    hold = k
                    break
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """The held tail at the end of the stream (no stop string came)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
