"""The OpenAI-compatible HTTP API over an ``EngineWorker``: FastAPI routes, SSE streams (sse-starlette),
Prometheus metrics.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Errors have OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``: 400 for bad input (malformed JSON included), 404 for an unknown model, 429 when the waiting line
is full, 503 while draining, 500 for an engine failure. Every check that can be made before the engine sees a
request is made here, so a bad request never reaches the batch and never disturbs the others.

Accepted parameters: ``model``, ``messages`` / ``prompt`` (a string, or token ids for completions),
``max_tokens`` (``max_completion_tokens``), ``temperature`` (default 1, as OpenAI's), ``top_p``, ``top_k``
(an extension, as vLLM's), ``seed``, ``stop`` (up to 4 strings), ``stop_token_ids`` (an extension),
``stream``, ``stream_options`` (``include_usage``, and ``continuous_usage_stats``: usage in every chunk, as
vLLM's), ``n`` = 1, ``user``. Parameters the engine cannot honour (``n`` > 1, ``logprobs``, penalties,
``logit_bias``, ``echo``, ``suffix``, ``best_of`` > 1, tools) are refused with a 400 naming them, never
ignored silently.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict
from sse_starlette import EventSourceResponse

from engine.backends.pair import ModelPair
from engine.control import Controller
from engine.engine import MAX_SEED
from engine.errors import InputError
from engine.sampling import SamplingConfig
from serving.metrics import ServerMetrics
from serving.text import Detokenizer, StopMatcher
from serving.worker import EngineWorker, Failed, Finished, Job, Overloaded, Tokens, Unavailable

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming request checks that its client is still there."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {
            400: "invalid_request_error",
            404: "invalid_request_error",
            429: "rate_limit_error",
            503: "server_unavailable",
        }.get(self.status, "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(body, status_code=self.status, headers=headers)


@dataclass
class ServerState:
    """What the routes need: the pair (tokenizer, limits), the worker, the controller of each request."""

    pair: ModelPair
    worker: EngineWorker
    metrics: ServerMetrics
    model_names: tuple[str, ...] = ("draftpilot",)
    """Names a request may give as ``model``; the first is the one ``/v1/models`` lists."""
    make_controller: Callable[[], Controller | None] = lambda: None
    """A fresh controller for each request (None: autoregressive)."""
    max_context: int = 4096
    """Prompt plus generated tokens of one request at most."""
    description: dict = field(default_factory=dict)
    """Shown by ``/health`` (pair, weights, controller, batch limits)."""
    created: int = field(default_factory=lambda: int(time.time()))


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


class ChatBody(_Body):
    messages: list[dict[str, Any]]


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]


UNSUPPORTED = {
    # parameter: value that means "not used"
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.worker.state == "new":
            state.worker.start()
        yield
        state.worker.drain()
        await asyncio.to_thread(state.worker.join, 30.0)

    app = FastAPI(title="draftpilot", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        state.metrics.errors.labels(str(err.status)).inc()
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        state.metrics.errors.labels("400").inc()
        message = "; ".join(problems) or "invalid request"
        if any(e.get("type") == "json_invalid" for e in err.errors()):
            message = f"the request body is not valid JSON ({message})"
        return ApiError(400, message).response()

    @app.get("/health")
    async def health():
        worker = state.worker
        body = {"status": "ok" if worker.state == "running" else worker.state}
        body.update(running=worker.running, waiting=worker.waiting, **state.description)
        body.update(kv_reserved_bytes=worker.kv_reserved, kv_allocated_bytes=worker.kv_allocated)
        return JSONResponse(body, status_code=200 if worker.state == "running" else 503)

    @app.get("/v1/models")
    async def models():
        data = [
            {
                "id": state.model_names[0],
                "object": "model",
                "created": state.created,
                "owned_by": "draftpilot",
            }
        ]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics():
        state.metrics.running.set(state.worker.running)
        state.metrics.waiting.set(state.worker.waiting)
        state.metrics.kv_reserved.set(state.worker.kv_reserved)
        state.metrics.kv_allocated.set(state.worker.kv_allocated)
        state.metrics.kv_budget.set(state.worker.config.max_kv_bytes or 0)
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        prompt_ids = _chat_prompt(state, body)
        return await _serve(state, request, body, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompt_ids = _completion_prompt(state, body)
        return await _serve(state, request, body, prompt_ids, chat=False)

    return app


# ----------------------------------------------------------------------------------------- requests
def _stops(body: _Body) -> list[str]:
    """The request's stop strings as a list (``stop`` is a string, a list or absent)."""
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def _check_common(state: ServerState, body: _Body) -> None:
    if body.model not in state.model_names:
        raise ApiError(
            404, f"the model {body.model!r} does not exist; this server serves {state.model_names[0]!r}",
            "model", "model_not_found",
        )  # fmt: skip
    extra = body.model_extra or {}
    for name, unused in UNSUPPORTED.items():
        if name in extra and extra[name] not in unused:
            raise ApiError(400, f"{name} is not supported by this server", name, "unsupported_parameter")
    if body.n != 1:
        raise ApiError(400, f"n must be 1 (one choice a request), got {body.n}", "n")
    if not 0.0 <= body.temperature <= 2.0:
        raise ApiError(400, f"temperature must be in [0, 2], got {body.temperature}", "temperature")
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED:
        raise ApiError(400, f"seed must be in [0, 2**64), got {body.seed}", "seed")
    stops = _stops(body)
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(
            400, "stop must be a non-empty string or a list of at most 4 non-empty strings", "stop"
        )
    vocab = state.pair.vocab_size
    if any(not 0 <= t < vocab for t in body.stop_token_ids or []):
        raise ApiError(400, f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")


def _chat_prompt(state: ServerState, body: ChatBody) -> list[int]:
    _check_common(state, body)
    if not body.messages:
        raise ApiError(400, "messages must hold at least one message", "messages")
    messages = []
    for i, message in enumerate(body.messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant"):
            raise ApiError(
                400, f"messages[{i}].role must be system, user or assistant, got {role!r}", "messages"
            )
        if isinstance(content, list):  # content parts: only text ones
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        messages.append({"role": role, "content": content})
    ids = state.pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _completion_prompt(state: ServerState, body: CompletionBody) -> list[int]:
    _check_common(state, body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt a request (a list of several is not supported)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(state.pair.tokenizer.encode(prompt)) if prompt else []
    else:
        ids = [int(t) for t in prompt]
        vocab = state.pair.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    if not ids:
        raise ApiError(400, "prompt is empty", "prompt")
    return ids


def _max_tokens(state: ServerState, body: _Body, prompt_len: int) -> int:
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    room = state.max_context - prompt_len
    if asked is not None and asked < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {asked}", "max_tokens")
    if room < 1 or (asked is not None and asked > room):
        wanted = prompt_len + (asked if asked is not None else 1)
        raise ApiError(
            400,
            f"this model's maximum context length is {state.max_context} tokens; the request needs {wanted} "
            f"({prompt_len} in the prompt, {wanted - prompt_len} to generate)",
            "max_tokens"
            if asked is not None and room >= 1
            else ("messages" if isinstance(body, ChatBody) else "prompt"),
            "context_length_exceeded",
        )
    return asked if asked is not None else room


async def _serve(state: ServerState, request: Request, body: _Body, prompt_ids: list[int], chat: bool):
    max_new = _max_tokens(state, body, len(prompt_ids))
    try:
        sampling = SamplingConfig(body.temperature, body.top_k, body.top_p)
    except InputError as err:
        raise ApiError(400, str(err)) from None
    stops = _stops(body)
    job = Job(
        prompt_ids,
        max_new,
        sampling,
        seed=body.seed if body.seed is not None else secrets.randbits(63),
        stop_token_ids=frozenset(body.stop_token_ids or ()),
        controller=state.make_controller(),
        ignore_eos=body.ignore_eos,
    )
    try:
        state.worker.submit(job)
    except Overloaded as err:
        raise ApiError(429, str(err), code="overloaded") from None
    except Unavailable as err:
        raise ApiError(503, str(err), code="unavailable") from None
    stream = _Stream(state, job, stops, request)
    first = await stream.next_item()  # an error before the first token is still an HTTP error
    if isinstance(first, Failed):
        raise ApiError(first.status, first.message)
    if first is None:  # the client left while the request waited
        return Response(status_code=499)
    created, rid = int(time.time()), ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    options = body.stream_options or {}
    if body.stream:
        events = _sse(stream, first, chat, rid, created, body.model, options, body.return_token_ids)
        return EventSourceResponse(events, sep="\n", ping=15)
    text, reason = [], None
    item = first
    while True:
        delta, reason = stream.consume(item)
        text.append(delta)
        if reason is not None:
            break
        item = await stream.next_item()
        if item is None:
            return Response(status_code=499)
        if isinstance(item, Failed):
            raise ApiError(item.status, item.message)
    usage = stream.usage()
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "logprobs": None}
        obj = "chat.completion"
    else:
        choice, obj = {"index": 0, "text": "".join(text), "logprobs": None}, "text_completion"
    choice["finish_reason"] = reason
    if body.return_token_ids:
        choice["token_ids"] = stream.ids
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": body.model,
        "choices": [choice],
        "usage": usage,
    }


class _Stream:
    """One job's output as text: tokens through the detokenizer and the stop strings, timing into the
    metrics; ``consume`` an item at a time."""

    def __init__(self, state: ServerState, job: Job, stops: list[str], request: Request):
        self.state, self.job, self.request = state, job, request
        self.detok = Detokenizer(state.pair.tokenizer)
        self.stops = StopMatcher(stops)
        self.tokens = 0
        self.ids: list[int] = []
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
        if not self.done:
            self.done = True
            self.state.worker.cancel(self.job)

    def consume(self, item: Tokens | Finished) -> tuple[str, str | None]:
        """(text to send, finish reason or None)."""
        m = self.state.metrics
        if isinstance(item, Tokens):
            n = len(item.ids)
            if self.last is None:
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
            self.ids.extend(item.ids)
            m.generation_tokens.inc(n)
            text = self.stops.feed(self.detok.feed(item.ids))
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

    def usage(self) -> dict[str, int]:
        prompt = len(self.job.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.tokens,
            "total_tokens": prompt + self.tokens,
        }


async def _sse(
    stream: _Stream, first, chat: bool, rid: str, created: int, model: str, options: dict, token_ids: bool
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
            if isinstance(item, Failed):
                error = {"message": item.message, "type": "server_error", "param": None, "code": None}
                yield {"data": json.dumps({"error": error})}
                break
            delta, reason = stream.consume(item)
            ids = item.ids if isinstance(item, Tokens) else ()
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
