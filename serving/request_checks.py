"""The request side of the HTTP API (``serving.app``): the request bodies (``ChatBody``, ``CompletionBody``), the
parameters the server implements (``CHAT_FIELDS``, ``COMPLETION_FIELDS``) and the "not used" values of those it
does not (``NO_OPS``), every check a request passes before the engine sees it, the prompt's token ids, and
``ApiError``: a refusal in OpenAI's error shape."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from engine.inputs import MAX_SEED
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
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        elif self.status in (408, 413):  # a body left unread, or still arriving: the connection ends
            headers = {"Connection": "close"}
        # ASCII JSON: a message quoting client text can never fail to encode
        return Response(json.dumps(body), self.status, headers, media_type="application/json")


class RequestBody(BaseModel):
    """Strict types, as OpenAI's API checks them: a string or a boolean where a number belongs (``"10"``,
    ``true``), a string where a boolean belongs (``"yes"``) are 400s naming the field, never coerced; a float
    field takes an integer (``temperature: 1``)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat = 1.0
    top_p: StrictFloat = 1.0
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: StrictInt = 1
    user: StrictStr | None = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False


class ChatBody(RequestBody):
    messages: list[dict[str, Any]]
    parse_special_tokens: StrictBool = False
    """An extension: read control tokens typed in the messages' content (``<|im_start|>``...) as control
    tokens. Off by default: the content is text, and only the chat template places control tokens."""


class CompletionBody(RequestBody):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]


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
    for key, value in (body.stream_options or {}).items():
        if not isinstance(value, bool):
            raise ApiError(
                400, f"stream_options.{key} must be a boolean, got {json.dumps(value)}", "stream_options"
            )


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
    check_size(state, body, [m["content"] for m in messages])
    return chat_ids(state, messages, body.parse_special_tokens)


def _ids(encoded) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):  # a BatchEncoding
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def tokenizer_facts(state: ServerState) -> tuple[re.Pattern | None, int]:
    """(a pattern of the tokenizer's special tokens' text, longest first, or None when it has none; the most
    UTF-8 bytes one token of its vocabulary spells), measured once and kept on ``state``."""
    if not state.max_token_bytes:
        tokenizer = state.pair.tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        texts = sorted(
            {t.content for t in decoder.values() if getattr(t, "special", False)}, key=len, reverse=True
        )
        state.specials = re.compile("|".join(map(re.escape, texts))) if texts else None
        # a vocabulary string spells at least the bytes its token stands for (byte-level BPE: one character
        # a byte; "<0x41>"-style byte tokens and SentencePiece's "\u2581" more): a safe bound
        state.max_token_bytes = max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1) or 1
    return state.specials, state.max_token_bytes


def check_size(state: ServerState, body: RequestBody, texts: list[str]) -> None:
    """A 400 for a prompt that cannot fit the context whatever its tokens, judged from its UTF-8 size before
    it is tokenized: no token spells more than ``max_token_bytes`` bytes, so ``bytes / max_token_bytes`` is
    at least its token count. A prompt that could fit always passes on to the exact check on its tokens."""
    _, per_token = tokenizer_facts(state)
    size = sum(len(t.encode("utf-8")) for t in texts)
    least = -(-size // per_token)
    if least + 1 > state.max_context:  # not even one token of room (max_tokens is judged on the tokens)
        raise ApiError(
            400, f"this model's maximum context length is {state.max_context} tokens; the prompt alone is "
            f"{size} bytes of text, at least {least} tokens (a token spells at most {per_token} bytes)",
            "messages" if isinstance(body, ChatBody) else "prompt", "context_length_exceeded",
        )  # fmt: skip


def chat_ids(state: ServerState, messages: list[dict[str, str]], parse_specials: bool) -> list[int]:
    """The chat template applied to ``messages``, tokenized so that only the template places control tokens:
    a content's text is text, even where it spells one (``<|im_start|>system``), unless ``parse_specials``.

    A content without any special token's text (nearly all) is tokenized as it always was, with the template
    (the same ids by construction). Otherwise the template is rendered with a placeholder for each content to
    find the control tokens it places itself; the text between two of them (template text and contents) is
    tokenized with special-token parsing off (``split_special_tokens``). A tokenizer splits its input at its
    special tokens before anything else, so those runs are the pieces the tokenizer sees for ordinary text:
    the ids are what the template gives, with the contents' would-be control tokens spelled as text."""
    tokenizer = state.pair.tokenizer
    specials, _ = tokenizer_facts(state)
    if parse_specials or specials is None or not any(specials.search(m["content"]) for m in messages):
        return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return template_ids(tokenizer, messages, specials)


def template_ids(tokenizer, messages: list[dict[str, str]], specials: re.Pattern) -> list[int]:
    """``chat_ids`` where a content spells a control token: its text stays text (``specials``: the
    tokenizer's special tokens' text). A 400 where the template changes a content (it cannot be found)."""
    template = tokenizer.apply_chat_template
    rendered = template(messages, add_generation_prompt=True, tokenize=False)
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    marked = template(
        [{**m, "content": mark} for m, mark in zip(messages, marks)],
        add_generation_prompt=True,
        tokenize=False,
    )
    pieces = re.split("(\ue000[0-9]+\ue001)", marked)  # template text, mark, template text, ...
    if (
        pieces[1::2] != marks
        or "".join(messages[marks.index(p)]["content"] if k % 2 else p for k, p in enumerate(pieces))
        != rendered
    ):  # the template changes a content (strips it, say): where it went is not known
        found = [hit.group() for m in messages for hit in [specials.search(m["content"])] if hit] or ["?"]
        raise ApiError(
            400, f"a message's content holds the control token {found[0]!r}, which this model's chat template "
            "cannot keep as text (set parse_special_tokens to read it as a control token)", "messages",
        )  # fmt: skip
    ids: list[int] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            text = "".join(run)
            run.clear()
            ids.extend(_ids(tokenizer(text, add_special_tokens=False, split_special_tokens=True)))

    for k, piece in enumerate(pieces):
        if k % 2:  # a content: text, whatever it spells
            run.append(messages[marks.index(piece)]["content"])
            continue
        at = 0
        for special in specials.finditer(piece):  # the template's own control tokens
            run.append(piece[at : special.start()])
            flush()
            ids.append(int(tokenizer.convert_tokens_to_ids(special.group())))
            at = special.end()
        run.append(piece[at:])
    flush()
    return ids


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
        check_size(state, body, [prompt])
        # the caller writes the template: control tokens spelled in a raw prompt are control tokens
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
