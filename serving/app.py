"""The OpenAI-compatible HTTP API over an ``EngineWorker``: FastAPI routes, SSE streams (sse-starlette),
Prometheus metrics.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Every error, whatever raised it (a check here, the body parser, the
router, an unexpected exception), has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
and is counted in ``/metrics`` by status: 400 for bad input (malformed JSON, invalid Unicode included), 404
for an unknown model or route, 413 for a body over ``max_body_bytes`` (refused before it is parsed), 429 when
the waiting line is full, 503 while draining, 500 for an engine failure or a bug. Every check that can be
made before the engine sees a request is made here, so a bad request never reaches the batch and never
disturbs the others.

Accepted parameters (``CHAT_FIELDS``, ``COMPLETION_FIELDS``): ``model``, ``messages`` / ``prompt`` (a
string, or token ids for completions), ``max_tokens`` (``max_completion_tokens``), ``temperature`` (default
1, as OpenAI's; below ``engine.sampling.MIN_TEMPERATURE`` greedy), ``top_p``, ``top_k`` (an extension, as
vLLM's: 0 or -1 for no limit), ``seed``, ``stop`` (up to 4 strings), ``stop_token_ids``, ``ignore_eos``,
``return_token_ids`` (extensions), ``stream``, ``stream_options`` (``include_usage``, and
``continuous_usage_stats``: usage in every chunk, as vLLM's), ``n`` = 1, ``user``. OpenAI parameters the
engine does not implement are accepted at the value that means "not used" (``NO_OPS``: ``logprobs`` false,
penalties 0, ...) and refused otherwise; any other field is refused. A refusal is a 400 naming the
parameter: nothing is ignored silently.

Prompts are checked and tokenized on a thread of their own (``TOKENIZE_THREADS``), not on the event loop, so
a long prompt never holds up the other streams or ``/health``.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

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
MAX_BODY_BYTES = 4 * 1024 * 1024
"""Request bodies larger than this are refused (413) unless ``ServerState.max_body_bytes`` says otherwise."""
TOKENIZE_THREADS = 1
"""Threads that check and tokenize prompts off the event loop. One: prompts are tokenized in arrival order,
and a tokenizer (a Hugging Face fast tokenizer among them) is never called from two threads at once."""

_SURROGATE = re.compile("[\ud800-\udfff]")
"""A lone UTF-16 surrogate: JSON can carry one (``"\\ud800"``), UTF-8 cannot encode it."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> Response:
        if self.status == 429:
            kind = "rate_limit_error"
        elif self.status == 503:
            kind = "server_unavailable"
        else:
            kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        # ASCII JSON: a message quoting client text can never fail to encode
        return Response(json.dumps(body), self.status, headers, media_type="application/json")


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is refused with a 413 before anything parses it, at
    once when its Content-Length says so, else (a chunked body) as soon as the bytes received pass the limit.
    ``on_refuse(status)`` counts each refusal."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refuse: Callable[[int], None]):
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413, f"the request body is {size}, over this server's limit of {self.max_bytes} bytes "
            "(--max-body-bytes)", None, "request_too_large",
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            self.on_refuse(413)
            await self._too_large(f"{int(length)} bytes").response()(scope, receive, send)
            return
        received = 0

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # raised into the body parser: the 413 handler answers
                    raise HTTPException(413, self._too_large(f"at least {received} bytes").message)
            return message

        await self.app(scope, limited, send)


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
    max_body_bytes: int = MAX_BODY_BYTES
    """Request bodies larger than this are refused with a 413 before they are parsed."""


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


COMMON_FIELDS = frozenset(_Body.model_fields)
CHAT_FIELDS = COMMON_FIELDS | {"messages"}
"""The chat parameters the server implements."""
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
"""The completion parameters the server implements."""

NO_OPS = {
    # OpenAI parameter the engine does not implement: the values that mean "not used", accepted as such
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
CHAT_NO_OPS = ("logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "tools",
               "tool_choice", "functions", "function_call", "response_format")  # fmt: skip
COMPLETION_NO_OPS = ("logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "echo", "suffix",
                     "best_of")  # fmt: skip
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
MESSAGE_FIELDS = ("role", "content")
"""The fields of a message the server uses; any other must be null (as a client echoing a response sends)."""


def create_app(state: ServerState) -> FastAPI:
    tokenize = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="draftpilot-tokenize")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.worker.state == "new":
            state.worker.start()
        yield
        state.worker.drain()
        await asyncio.to_thread(state.worker.join, 30.0)
        tokenize.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="draftpilot", lifespan=lifespan)
    app.state.server = state

    def count(status: int) -> None:
        state.metrics.errors.labels(str(status)).inc()

    app.add_middleware(BodyLimit, max_bytes=state.max_body_bytes, on_refuse=count)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        count(err.status)
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        message = "; ".join(problems) or "invalid request"
        if any(e.get("type") == "json_invalid" for e in err.errors()):
            message = f"the request body is not valid JSON ({message})"
        return await _api_error(request, ApiError(400, message))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException):
        """The router's and the body parser's errors (404, 405, a body that is not UTF-8, a 413)."""
        message = err.detail if isinstance(err.detail, str) else json.dumps(err.detail)
        if err.status_code == 400:
            message = "the request body could not be parsed (it must be a UTF-8 JSON object)"
        elif err.status_code == 404:
            message = f"no route {request.url.path} (the API is under /v1)"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        code = "request_too_large" if err.status_code == 413 else None
        return await _api_error(request, ApiError(err.status_code, message, None, code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        """A bug: a 500 in OpenAI's shape (Starlette still logs the traceback)."""
        message = f"internal server error ({type(err).__name__}); the server's log has the details"
        return await _api_error(request, ApiError(500, message))

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

    async def off_loop(fn, body):
        return await asyncio.get_running_loop().run_in_executor(tokenize, fn, state, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        prompt_ids = await off_loop(_chat_prompt, body)
        return await _serve(state, request, body, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompt_ids = await off_loop(_completion_prompt, body)
        return await _serve(state, request, body, prompt_ids, chat=False)

    return app


# ----------------------------------------------------------------------------------------- requests
def _stops(body: _Body) -> list[str]:
    """The request's stop strings as a list (``stop`` is a string, a list or absent)."""
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def _check_text(text: str, where: str) -> None:
    """A 400 for a string UTF-8 cannot encode (a lone surrogate, which JSON's ``\\uXXXX`` escapes allow)."""
    found = _SURROGATE.search(text)
    if found:
        raise ApiError(
            400, f"{where} is not valid Unicode: it holds a lone surrogate (U+{ord(found.group()):04X}) at "
            f"character {found.start()}", where.split("[")[0].split(".")[0],
        )  # fmt: skip


def _check_fields(body: _Body, no_ops: tuple[str, ...]) -> None:
    """A 400 naming every parameter the request gives that the server does not implement: a field outside
    the body's model, an OpenAI parameter of ``no_ops`` at a value other than its "not used" ones, an
    unknown ``stream_options`` key."""
    unknown, used = [], []
    for name, value in (body.model_extra or {}).items():
        if name not in no_ops:
            unknown.append(name)
        elif not any(type(value) is not bool and value == v or value is v for v in NO_OPS[name]):
            used.append(name)
    if unknown:
        unknown.sort()
        several = len(unknown) > 1
        raise ApiError(
            400, f"unsupported parameter{'s' if several else ''}: {', '.join(unknown)} (this server does not "
            f"implement {'them' if several else 'it'}; docs/serving.md lists what it does)",
            unknown[0], "unsupported_parameter",
        )  # fmt: skip
    if used:
        name = used[0]
        allowed = " or ".join(json.dumps(v) for v in NO_OPS[name])
        raise ApiError(
            400, f"{name} is not supported by this server (accepted only as {allowed}, which means unused)",
            name, "unsupported_parameter",
        )  # fmt: skip
    options = [k for k in body.stream_options or {} if k not in STREAM_OPTIONS]
    if options:
        raise ApiError(
            400, f"stream_options: unsupported key{'s' if len(options) > 1 else ''} {', '.join(sorted(options))} "
            f"(supported: {', '.join(STREAM_OPTIONS)})", "stream_options", "unsupported_parameter",
        )  # fmt: skip


def _check_common(state: ServerState, body: _Body, no_ops: tuple[str, ...]) -> None:
    if body.model not in state.model_names:
        raise ApiError(
            404, f"the model {body.model!r} does not exist; this server serves {state.model_names[0]!r}",
            "model", "model_not_found",
        )  # fmt: skip
    _check_fields(body, no_ops)
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
    for i, stop in enumerate(stops):
        _check_text(stop, f"stop[{i}]")
    if body.top_k < -1:
        raise ApiError(
            400, f"top_k must be -1 or 0 (no limit) or a positive integer, got {body.top_k}", "top_k"
        )
    vocab = state.pair.vocab_size
    if any(not 0 <= t < vocab for t in body.stop_token_ids or []):
        raise ApiError(400, f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")


def _chat_prompt(state: ServerState, body: ChatBody) -> list[int]:
    """The checked request's prompt ids: the chat template applied to its messages, tokenized."""
    _check_common(state, body, CHAT_NO_OPS)
    if not body.messages:
        raise ApiError(400, "messages must hold at least one message", "messages")
    messages = []
    for i, message in enumerate(body.messages):
        others = sorted(k for k, v in message.items() if k not in MESSAGE_FIELDS and v not in (None, [], ""))
        if others:
            raise ApiError(
                400, f"messages[{i}]: unsupported field{'s' if len(others) > 1 else ''} {', '.join(others)} "
                "(a message has a role and a content)", "messages", "unsupported_parameter",
            )  # fmt: skip
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
        _check_text(content, f"messages[{i}].content")
        messages.append({"role": role, "content": content})
    ids = state.pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _completion_prompt(state: ServerState, body: CompletionBody) -> list[int]:
    """The checked request's prompt ids: its string tokenized, or its token ids."""
    _check_common(state, body, COMPLETION_NO_OPS)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt a request (a list of several is not supported)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_text(prompt, "prompt")
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
    try:  # top_k -1 is vLLM's "no limit", the engine's 0; a temperature below MIN_TEMPERATURE is greedy
        sampling = SamplingConfig(body.temperature, max(body.top_k, 0), body.top_p)
    except InputError as err:
        raise ApiError(400, str(err), str(err).split()[0]) from None
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
        if not self.done:
            self.done = True
            self.state.worker.cancel(self.job)

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
            if isinstance(item, Failed):  # after the 200: an error event, counted as any error
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
