"""The request side of the HTTP API (``serving.app``): the request bodies (``ChatBody``, ``CompletionBody``), the
parameters the server implements (``CHAT_FIELDS``, ``COMPLETION_FIELDS``) and the "not used" values of those it
does not (``NO_OPS``), every check a request passes before the engine sees it, the prompt's token ids, and
``ApiError``: a refusal in OpenAI's error shape."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from engine.engine import MAX_SEED
from serving.state import ServerState

SURROGATE = re.compile("[\ud800-\udfff]")
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


class RequestBody(BaseModel):
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


class ChatBody(RequestBody):
    messages: list[dict[str, Any]]


class CompletionBody(RequestBody):
    prompt: str | list[int] | list[str]


COMMON_FIELDS = frozenset(RequestBody.model_fields)
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


def stop_strings(body: RequestBody) -> list[str]:
    """The request's stop strings as a list (``stop`` is a string, a list or absent)."""
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def check_text(text: str, where: str) -> None:
    """A 400 for a string UTF-8 cannot encode (a lone surrogate, which JSON's ``\\uXXXX`` escapes allow)."""
    found = SURROGATE.search(text)
    if found:
        raise ApiError(
            400, f"{where} is not valid Unicode: it holds a lone surrogate (U+{ord(found.group()):04X}) at "
            f"character {found.start()}", where.split("[")[0].split(".")[0],
        )  # fmt: skip


def check_fields(body: RequestBody, no_ops: tuple[str, ...]) -> None:
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


def check_common(state: ServerState, body: RequestBody, no_ops: tuple[str, ...]) -> None:
    if body.model not in state.model_names:
        raise ApiError(
            404, f"the model {body.model!r} does not exist; this server serves {state.model_names[0]!r}",
            "model", "model_not_found",
        )  # fmt: skip
    check_fields(body, no_ops)
    if body.n != 1:
        raise ApiError(400, f"n must be 1 (one choice a request), got {body.n}", "n")
    if not 0.0 <= body.temperature <= 2.0:
        raise ApiError(400, f"temperature must be in [0, 2], got {body.temperature}", "temperature")
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED:
        raise ApiError(400, f"seed must be in [0, 2**64), got {body.seed}", "seed")
    stops = stop_strings(body)
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(
            400, "stop must be a non-empty string or a list of at most 4 non-empty strings", "stop"
        )
    for i, stop in enumerate(stops):
        check_text(stop, f"stop[{i}]")
    if body.top_k < -1:
        raise ApiError(
            400, f"top_k must be -1 or 0 (no limit) or a positive integer, got {body.top_k}", "top_k"
        )
    vocab = state.pair.vocab_size
    if any(not 0 <= t < vocab for t in body.stop_token_ids or []):
        raise ApiError(400, f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")


def chat_prompt(state: ServerState, body: ChatBody) -> list[int]:
    """The checked request's prompt ids: the chat template applied to its messages, tokenized."""
    check_common(state, body, CHAT_NO_OPS)
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
        check_text(content, f"messages[{i}].content")
        messages.append({"role": role, "content": content})
    ids = state.pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def completion_prompt(state: ServerState, body: CompletionBody) -> list[int]:
    """The checked request's prompt ids: its string tokenized, or its token ids."""
    check_common(state, body, COMPLETION_NO_OPS)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt a request (a list of several is not supported)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        ids = list(state.pair.tokenizer.encode(prompt)) if prompt else []
    else:
        ids = [int(t) for t in prompt]
        vocab = state.pair.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    if not ids:
        raise ApiError(400, "prompt is empty", "prompt")
    return ids


def max_tokens(state: ServerState, body: RequestBody, prompt_len: int) -> int:
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
