"""The OpenAI-compatible HTTP API over an ``EngineWorker``: FastAPI routes, SSE streams (sse-starlette),
Prometheus metrics. The request bodies and their checks are in ``serving.request_checks``, the streams of text
and SSE events in ``serving.streams``.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Every error, whatever raised it (a check here, the body parser, the
router, an unexpected exception), has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
and is counted in ``/metrics`` by status: 400 for bad input (malformed JSON, invalid Unicode, a value of the
wrong type, a Host header the server does not answer to included), 401 for a missing or wrong API key
(``serving.access``), 404 for an unknown model or route, 408 for a body that does not arrive in time, 413 for
a body over ``max_body_bytes`` (both refused before it is parsed), 429 when the waiting line is full, 503
while draining, 500 for an engine failure or a bug; a client that leaves before its end counts as 499.
Every check that can be made before the engine sees a request is made here, so a bad request never reaches
the batch and never disturbs the others.

Accepted parameters (``serving.request_checks``: ``CHAT_FIELDS``, ``COMPLETION_FIELDS``): ``model``, ``messages`` / ``prompt`` (a
string, or token ids for completions), ``max_tokens`` (``max_completion_tokens``), ``temperature`` (default
1, as OpenAI's; below ``engine.sampling.MIN_TEMPERATURE`` greedy), ``top_p``, ``top_k`` (an extension, as
vLLM's: 0 or -1 for no limit), ``seed``, ``stop`` (up to 4 strings), ``stop_token_ids``, ``ignore_eos``,
``return_token_ids``, ``parse_special_tokens`` (chat; extensions), ``stream``, ``stream_options``
(``include_usage``, and ``continuous_usage_stats``: usage in every chunk, as vLLM's), ``n`` = 1, ``user``.
Their types are strict, as OpenAI's (``"10"`` or ``true`` for ``max_tokens`` is a 400). OpenAI parameters the
engine does not implement are accepted at the value that means "not used" (``NO_OPS``: ``logprobs`` false,
penalties 0, ...) and refused otherwise; any other field is refused. A refusal is a 400 naming the
parameter: nothing is ignored silently.

Prompts are checked and tokenized on a thread of their own (``TOKENIZE_THREADS``), not on the event loop, so
a long prompt never holds up the other streams or ``/health``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.errors import InputError
from engine.sampling import SamplingConfig
from serving.access import AccessGuard
from serving.request_checks import (
    ApiError,
    ChatBody,
    CompletionBody,
    RequestBody,
    chat_prompt,
    completion_prompt,
    max_tokens,
    stop_strings,
)
from serving.state import ServerState
from serving.streams import TextStream, sse_events
from serving.worker import Failed, Job, Overloaded, Unavailable

TOKENIZE_THREADS = 1
"""Threads that check and tokenize prompts off the event loop. One: prompts are tokenized in arrival order,
and a tokenizer (a Hugging Face fast tokenizer among them) is never called from two threads at once."""


class BodyLimit:
    """ASGI middleware: a request body is bounded in size and in time before anything parses it. Over
    ``max_bytes`` it is refused with a 413, at once when its Content-Length says so, else (a chunked body) as
    soon as the bytes received pass the limit; not arrived whole ``timeout_s`` after its header (a client
    trickling it, or stalled), with a 408; still arriving when the server starts draining (``closing`` set),
    with a 503 at once, so an idle client never holds a shutdown. Each answer closes the connection.
    ``on_refuse(status)`` counts each refusal."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        on_refuse: Callable[[int], None],
        timeout_s: float | None = None,
        closing: Callable[[], asyncio.Event | None] = lambda: None,
    ):
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse
        self.timeout_s, self.closing = timeout_s, closing

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
        received, whole = 0, False
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s

        async def next_message() -> dict:
            """``receive()``, bounded by the deadline and cut short by the drain."""
            closing = self.closing()
            if deadline is None and closing is None:
                return await receive()
            waits = {get := asyncio.ensure_future(receive())}
            if closing is not None:
                waits.add(asyncio.ensure_future(closing.wait()))
            timeout = None if deadline is None else max(deadline - loop.time(), 0.0)
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits - {get}:
                wait.cancel()
            if get.done():
                return get.result()
            get.cancel()
            if closing is not None and closing.is_set():
                raise HTTPException(
                    503, "the server is shutting down; the request body had not arrived whole"
                )
            raise HTTPException(
                408, f"the request body did not arrive whole within {self.timeout_s:g} s of its header "
                f"({received} bytes received; serve.py --body-timeout)",
            )  # fmt: skip

        async def limited() -> dict:
            nonlocal received, whole
            if whole:  # the body is in: what follows is the wait for a disconnect, never bounded
                return await receive()
            message = await next_message()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if received > self.max_bytes:  # raised into the body parser: the 413 handler answers
                    raise HTTPException(413, self._too_large(f"at least {received} bytes").message)
            return message

        await self.app(scope, limited, send)


def create_app(state: ServerState) -> FastAPI:
    tokenize = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="draftpilot-tokenize")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.worker.state == "new":
            state.worker.start()
        state.closing = asyncio.Event()  # set by serve.py's drain: request bodies still arriving get a 503
        yield
        state.worker.drain()
        await asyncio.to_thread(state.worker.join, 30.0)
        tokenize.shutdown(wait=False, cancel_futures=True)

    pages = {} if state.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="draftpilot", lifespan=lifespan, **pages)
    app.state.server = state

    def count(status: int) -> None:
        state.metrics.errors.labels(str(status)).inc()

    app.add_middleware(
        BodyLimit,
        max_bytes=state.max_body_bytes,
        on_refuse=count,
        timeout_s=state.body_timeout_s,
        closing=lambda: state.closing,
    )
    app.add_middleware(  # outermost: a refused request costs no body read
        AccessGuard,
        allowed_hosts=state.allowed_hosts,
        api_keys=state.api_keys,
        metrics_auth=state.metrics_auth,
        on_refuse=count,
    )

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
        fields = [p for e in err.errors() for p in e.get("loc", ())[1:2] if isinstance(p, str)]
        return await _api_error(request, ApiError(400, message, fields[0] if fields else None))

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
        code = {408: "request_timeout", 413: "request_too_large", 503: "unavailable"}.get(err.status_code)
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
        body.update(prefix_cache_bytes=worker.prefix.get("bytes", 0))
        return JSONResponse(body, status_code=200 if worker.state == "running" else 503)

    @app.get("/v1/models")
    async def models():
        data = [
            {
                "id": state.model_names[0],
                "object": "model",
                "created": state.created,
                "owned_by": "draftpilot",
                "max_model_len": state.max_context,  # as vLLM names it: the context length enforced
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
        state.metrics.prefix_cache(dict(state.worker.prefix))
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def off_loop(fn, body):
        return await asyncio.get_running_loop().run_in_executor(tokenize, fn, state, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        prompt_ids = await off_loop(chat_prompt, body)
        return await _serve(state, request, body, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompt_ids = await off_loop(completion_prompt, body)
        return await _serve(state, request, body, prompt_ids, chat=False)

    return app


async def _serve(state: ServerState, request: Request, body: RequestBody, prompt_ids: list[int], chat: bool):
    max_new = max_tokens(state, body, len(prompt_ids))
    try:  # top_k -1 is vLLM's "no limit", the engine's 0; a temperature below MIN_TEMPERATURE is greedy
        sampling = SamplingConfig(body.temperature, max(body.top_k, 0), body.top_p)
    except InputError as err:
        raise ApiError(400, str(err), str(err).split()[0]) from None
    stops = stop_strings(body)
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
    stream = TextStream(state, job, stops, request)
    first = await stream.next_item()  # an error before the first token is still an HTTP error
    if isinstance(first, Failed):
        raise ApiError(first.status, first.message)
    if first is None:  # the client left while the request waited
        return Response(status_code=499)
    created, rid = int(time.time()), ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    options = body.stream_options or {}
    if body.stream:
        events = sse_events(stream, first, chat, rid, created, body.model, options, body.return_token_ids)
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
