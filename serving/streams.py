"""The response side of the HTTP API (``serving.app``): one job's output as text (``TextStream``: the detokenizer,
the stop strings, the client's disconnection, the metrics' timings and ``usage``) and its Server-Sent Events
(``sse_events``: OpenAI's chunks, ``[DONE]``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request

from serving.state import ServerState
from serving.text import Detokenizer, StopMatcher
from serving.worker import Failed, Finished, Job, Tokens

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming request checks that its client is still there."""


class TextStream:
    """One job's output as text: tokens through the detokenizer and the stop strings, timing into the
    metrics; ``consume`` an item at a time."""

    def __init__(self, state: ServerState, job: Job, stops: list[str], request: Request):
        self.state, self.job, self.request = state, job, request
        self.detok = Detokenizer(state.pair.tokenizer)
        self.stops = StopMatcher(stops)
        self.tokens = 0
        self.cached = 0
        """Prompt tokens the request took from the prefix cache (set with its first tokens)."""
        self.ids: list[int] = []
        self.step_ids: tuple[int, ...] = ()
        """The ids of the last ``Tokens`` consumed that count (up to the stop string's, when one hit)."""
        self.last: float | None = None
        self.done = False
        self._check_at = time.monotonic() + DISCONNECT_POLL_S  # next check of the client (next_item)

    async def next_item(self) -> Tokens | Finished | Failed | None:
        """The job's next item; None (and the job cancelled) when the client has disconnected. The client is
        checked every ``DISCONNECT_POLL_S`` whether or not items keep coming (a request decoding steadily
        never leaves the queue empty that long)."""
        while True:
            now = time.monotonic()
            if now >= self._check_at:
                self._check_at = now + DISCONNECT_POLL_S
                if await self.request.is_disconnected():
                    self.abandon()
                    return None
            try:
                return await asyncio.wait_for(self.job.queue.get(), self._check_at - now)
            except asyncio.TimeoutError:
                pass

    def abandon(self) -> None:
        """The client left before the end: the job is cancelled and counted under status 499 (nginx's
        "client closed request"), as the response a non-streamed request gets then."""
        if not self.done:
            self.done = True
            self.state.worker.cancel(self.job)
            self.state.metrics.errors.labels("499").inc()

    def _text(self, ids: tuple[int, ...]) -> tuple[str, int]:
        """(the text of ``ids`` through the detokenizer and the stop strings, how many of ``ids`` count).

        With stop strings the ids go one at a time, as a decoder committing one token a step would give
        them: a stop string completed by the k-th id of a step counts k ids, not the ones the step committed
        after it (the usage, ``token_ids`` and the metrics count the tokens the text came from)."""
        if not self.stops.stops:
            return self.stops.feed(self.detok.feed(ids)), len(ids)
        text = []
        for k, token in enumerate(ids, 1):
            text.append(self.stops.feed(self.detok.feed((token,))))
            if self.stops.stopped:
                return "".join(text), k
        return "".join(text), len(ids)

    def consume(self, item: Tokens | Finished) -> tuple[str, str | None]:
        """(text to send, finish reason or None)."""
        m = self.state.metrics
        if isinstance(item, Tokens):
            text, n = self._text(item.ids)
            self.step_ids = item.ids[:n]
            if self.last is None:
                self.cached = item.cached_tokens
                m.ttft.observe(item.at - self.job.submitted)
                if self.job.admitted is not None:
                    m.queue_time.observe(self.job.admitted - self.job.submitted)
                m.prompt_tokens.inc(len(self.job.prompt_ids))
            else:
                gap = (item.at - self.last) / n
                for _ in range(n):
                    m.itl.observe(gap)
            self.last = item.at
            self.tokens += n
            self.ids.extend(self.step_ids)
            m.generation_tokens.inc(n)
            if self.stops.stopped:
                self._end("stop", item.at)
                self.state.worker.cancel(self.job)  # frees the slot before the next step
                return text, "stop"
            return text, None
        # Finished
        text = self.stops.feed(self.detok.flush())
        text += self.stops.flush()
        reason = "stop" if item.reason in ("eos", "stop") or self.stops.stopped else "length"
        self._end(reason, item.at)
        return text, reason

    def _end(self, reason: str, at: float) -> None:
        self.done = True
        self.state.metrics.requests.labels(reason).inc()
        self.state.metrics.latency.observe(at - self.job.submitted)

    def usage(self) -> dict:
        """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens taken from the
        prefix cache instead of computed."""
        prompt = len(self.job.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.tokens,
            "total_tokens": prompt + self.tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }


async def sse_events(
    stream: TextStream, first, chat: bool, rid: str, created: int, model: str, options: dict, token_ids: bool
) -> AsyncIterator[dict]:
    include_usage = bool(options.get("include_usage"))
    continuous = bool(options.get("continuous_usage_stats"))

    def chunk(delta: str | None, reason: str | None, role: bool = False, ids: tuple = ()) -> dict:
        if chat:
            d = (
                {"role": "assistant", "content": delta or ""}
                if role
                else ({"content": delta} if delta else {})
            )
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        if token_ids and ids:
            choice["token_ids"] = list(ids)
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if continuous:
            out["usage"] = stream.usage()
        return {"data": json.dumps(out)}

    try:
        if chat:
            yield chunk(None, None, role=True)
        item = first
        while True:
            if isinstance(item, Failed):  # after the 200: an error event, counted as any error
                stream.done = True  # ended: not a client that left
                stream.state.metrics.errors.labels(str(item.status)).inc()
                error = {"message": item.message, "type": "server_error", "param": None, "code": None}
                yield {"data": json.dumps({"error": error})}
                break
            delta, reason = stream.consume(item)
            ids = stream.step_ids if isinstance(item, Tokens) else ()
            if delta or (ids and (token_ids or continuous)):
                yield chunk(delta, None, ids=ids)
            if reason is not None:
                yield chunk(None, reason)
                if include_usage:
                    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion"}
                    out.update(created=created, model=model, choices=[], usage=stream.usage())
                    yield {"data": json.dumps(out)}
                break
            item = await stream.job.queue.get()
        yield {"data": "[DONE]"}
    finally:  # the client left (the generator is cancelled) or the stream ended
        stream.abandon()
