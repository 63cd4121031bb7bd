"""The OpenAI-compatible server as a user meets it: ``python serve.py --pair tiny`` in a subprocess, driven by
the ``openai`` client and by concurrent raw HTTP clients. Greedy outputs are checked token for token against
``SpeculativeEngine.generate`` of the same request alone, on the same pair, in the test process."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.sampling import SamplingConfig
from serving.faults import FAULTS_ENV
from serving.text import Detokenizer, StopMatcher
from tests_serving_helpers import (
    DEFAULT_CONTROLLER,
    MODEL,
    assert_matches_reference,
    collect_stream,
    completion_body,
    metric_sum,
    reference,
    sse_events,
    streamed,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # the reference, as the server (--threads 1)

MAX_CONTEXT = 1000
MAX_REQUESTS = 4
PROMPTS = (
    "def main():",
    "The quick brown fox",
    "x",
    "Hello, world",
    "import numpy as np\n",
    "aaaa",
    "<b>",
    "SELECT * FROM",
)
GREEDY = {"temperature": 0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
LONG = MAX_CONTEXT - 32
SLOW = "@@slow@@"
"""A prompt holding it decodes 5 ms a step slower (``serving.faults``, ``slow``): a request that lasts ~5 s
whatever the machine's speed, so a client can leave while it runs."""
"""Tokens of a request meant to still be running while the test does something else (a few seconds)."""


@pytest.fixture(scope="module")
def launched(launch_server):
    # requests marked SLOW take 5 ms more a step (serving/faults.py): a margin for the tests that leave mid-way
    return launch_server(
        "--max-requests",
        str(MAX_REQUESTS),
        "--max-context",
        str(MAX_CONTEXT),
        env={FAULTS_ENV: f"slow={SLOW}"},
    )


@pytest.fixture(scope="module")
def server(launched, served_pair):
    """Started before the reference pair loads in this process, so the two overlap."""
    return launched.wait_ready()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def ids_of(served_pair):
    return lambda text: list(served_pair.tokenizer.encode(text))


@pytest.fixture(scope="module")
def chat_ids(served_pair):
    def ids(messages):
        return list(served_pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    return ids


def token_ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


# ------------------------------------------------------------------------------------ routes, metrics
def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "draftpilot"


def test_health_describes_the_server(server, served_pair):
    response = httpx.get(server.url("/health"), timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert (body["running"], body["waiting"]) == (0, 0)
    assert body["pair"] == "tiny"
    assert body["weights"] == served_pair.precision  # the reference runs on the same weight formats
    assert body["controller"] == DEFAULT_CONTROLLER
    assert body["lookup"] == "off"
    assert (body["max_requests"], body["max_context"]) == (MAX_REQUESTS, MAX_CONTEXT)


def test_metrics_are_prometheus_text_and_grow(server, client, ids_of):
    response = httpx.get(server.url("/metrics"), timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for line in (
        "# TYPE draftpilot_time_to_first_token_seconds histogram",
        "# TYPE draftpilot_inter_token_latency_seconds histogram",
        "# TYPE draftpilot_requests_total counter",
        "# TYPE draftpilot_requests_running gauge",
    ):
        assert line in text
    assert "draftpilot_time_to_first_token_seconds_count" in text
    before = server.metrics()
    prompt = ids_of("metrics")
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    after = server.metrics()

    def grew(name):
        return metric_sum(after, name) - metric_sum(before, name)

    assert grew("draftpilot_time_to_first_token_seconds_count") == 1
    assert grew("draftpilot_request_latency_seconds_count") == 1
    assert grew("draftpilot_inter_token_latency_seconds_count") > 0
    assert (
        after['draftpilot_requests_total{finish_reason="length"}']
        - before.get('draftpilot_requests_total{finish_reason="length"}', 0)
        == 1
    )
    assert grew("draftpilot_generation_tokens_total") == 12
    assert grew("draftpilot_prompt_tokens_total") == len(prompt)
    assert grew("draftpilot_cycles_total") > 0
    assert (
        after['draftpilot_request_errors_total{status="404"}']
        - before.get('draftpilot_request_errors_total{status="404"}', 0)
        == 1
    )


# ----------------------------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("prompt", PROMPTS[:5])
def test_greedy_completion_is_generate_alone(client, served_pair, ids_of, prompt):
    ids, n = ids_of(prompt), 40
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=n, **GREEDY)
    (choice,) = out.choices
    got = token_ids(choice)
    assert_matches_reference(got, reference(served_pair, ids, n).tokens, n, served_pair.eos_token_ids)
    assert choice.text == served_pair.tokenizer.decode(got)
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), n)
    assert out.usage.total_tokens == len(ids) + n


def test_text_prompt_is_encoded_as_the_tokenizer_does(client, served_pair, ids_of):
    prompt, n = "The quick brown fox", 24
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids_of(prompt), max_tokens=n, **GREEDY)
    assert by_text.usage.prompt_tokens == len(ids_of(prompt))
    assert token_ids(by_text.choices[0]) == token_ids(by_ids.choices[0])
    assert by_text.choices[0].text == by_ids.choices[0].text


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": "?"}]},
        ],
    ],
    ids=["one-turn", "multi-turn-parts"],
)
def test_greedy_chat_is_generate_alone(client, served_pair, chat_ids, messages):
    flat = [
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "Another?"}
        for m in messages
    ]
    ids, n = chat_ids(flat), 40
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, **GREEDY)
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    got = token_ids(choice)
    assert_matches_reference(got, reference(served_pair, ids, n).tokens, n, served_pair.eos_token_ids)
    assert choice.message.content == served_pair.tokenizer.decode(got)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids)


def test_greedy_stops_at_eos_unless_ignored(client, served_pair, ids_of):
    """Without ``ignore_eos`` the server ends where ``generate`` does, at its EOS, with finish_reason
    "stop"; with it, it goes on to max_tokens."""
    n = 120
    eos = served_pair.eos_token_ids
    found = None
    for prompt in ("12345", "99 bottles", "0", "foo(bar)", "#include <stdio.h>", "A", "zz", "1+1="):
        ref = reference(served_pair, ids_of(prompt), n)
        if ref.finish_reason == "eos":
            found = prompt, ref
            break
    if found is None:
        pytest.skip("no candidate prompt meets EOS within 120 greedy tokens on this pair")
    prompt, ref = found
    out = client.completions.create(
        model=MODEL, prompt=ids_of(prompt), max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
    )
    (choice,) = out.choices
    assert token_ids(choice) == ref.tokens
    assert token_ids(choice)[-1] in eos
    assert choice.finish_reason == "stop"
    assert out.usage.completion_tokens == len(ref.tokens) < n
    assert choice.text == served_pair.tokenizer.decode(ref.tokens)
    ignoring = client.completions.create(model=MODEL, prompt=ids_of(prompt), max_tokens=n, **GREEDY)
    assert ignoring.choices[0].finish_reason == "length"
    assert token_ids(ignoring.choices[0])[: len(ref.tokens)] == ref.tokens
    assert ignoring.usage.completion_tokens == n


def _request(server, client, spec):
    """One request of the concurrency test; (token ids, text, finish reason)."""
    kind, stream, payload, n = spec
    if kind == "chat":
        if not stream:
            out = client.chat.completions.create(model=MODEL, messages=payload, max_tokens=n, **GREEDY)
            c = out.choices[0]
            return token_ids(c), c.message.content, c.finish_reason
        body = {"model": MODEL, "messages": payload, "max_tokens": n, "temperature": 0, "stream": True}
        body.update(return_token_ids=True, ignore_eos=True)
        with streamed(server, "/v1/chat/completions", body) as r:
            assert r.status_code == 200
            got = collect_stream(sse_events(r), chat=True)
        assert got["done"]
        return got["token_ids"], got["text"], got["finish_reason"]
    if not stream:
        out = client.completions.create(model=MODEL, prompt=payload, max_tokens=n, **GREEDY)
        c = out.choices[0]
        return token_ids(c), c.text, c.finish_reason
    with streamed(server, "/v1/completions", completion_body(payload, n, stream=True)) as r:
        assert r.status_code == 200
        got = collect_stream(sse_events(r))
    assert got["done"]
    return got["token_ids"], got["text"], got["finish_reason"]


def test_concurrent_clients_each_get_their_alone_result(server, client, served_pair, ids_of, chat_ids):
    """Batch invariance as a user sees it: 8 clients at once (more than --max-requests, so some wait), mixed
    kinds, streaming or not, each gets the tokens of its request decoded alone."""
    server.wait_idle()
    specs = [
        ("completion", False, ids_of(PROMPTS[0]), 48),
        ("completion", True, ids_of(PROMPTS[1]), 40),
        ("chat", False, [{"role": "user", "content": "hello"}], 32),
        ("chat", True, [{"role": "user", "content": "write a poem"}], 44),
        ("completion", True, ids_of(PROMPTS[2]), 56),
        ("completion", False, ids_of(PROMPTS[5]), 36),
        ("chat", True, [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], 30),
        ("completion", False, ids_of(PROMPTS[7]), 52),
    ]
    eos = served_pair.eos_token_ids
    refs = []
    for kind, _, payload, n in specs:
        ids = chat_ids(payload) if kind == "chat" else payload
        refs.append(reference(served_pair, ids, n).tokens)
    before = server.metrics()
    start = threading.Barrier(len(specs), timeout=30)

    def run(spec):
        start.wait()
        return _request(server, client, spec)

    with ThreadPoolExecutor(len(specs)) as pool:
        results = [f.result(timeout=120) for f in [pool.submit(run, s) for s in specs]]
    after = server.metrics()
    for spec, ref, (ids, text, reason) in zip(specs, refs, results):
        assert_matches_reference(ids, ref, spec[3], eos)
        assert text == served_pair.tokenizer.decode(ids)
        assert reason == "length"
    steps = metric_sum(after, "draftpilot_batch_requests_count") - metric_sum(
        before, "draftpilot_batch_requests_count"
    )
    requests_in_steps = metric_sum(after, "draftpilot_batch_requests_sum") - metric_sum(
        before, "draftpilot_batch_requests_sum"
    )
    assert requests_in_steps > 1.5 * steps  # the requests did share steps (else this proves nothing)


# -------------------------------------------------------------------------------------------- streaming
def test_streamed_completion_equals_the_non_streamed_one(client, ids_of):
    prompt, n = ids_of("def main():"), 40
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, **GREEDY).choices[0].text
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=n,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    text, reasons, usage, after_usage = "", [], None, 0
    for chunk in stream:
        if usage is not None:
            after_usage += 1
        if chunk.usage is not None and not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        text += choice.text
        if choice.finish_reason is not None:
            reasons.append(choice.finish_reason)
    assert text == whole
    assert reasons == ["length"]
    assert usage is not None and after_usage == 0  # the usage chunk comes last
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(prompt),
        n,
        len(prompt) + n,
    )


def test_streamed_chat_equals_the_non_streamed_one(client):
    messages, n = [{"role": "user", "content": "Tell me a story."}], 48
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, **GREEDY)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=n,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    text, roles, reasons, usage = "", [], [], None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        if choice.delta.role:
            roles.append(choice.delta.role)
        text += choice.delta.content or ""
        if choice.finish_reason is not None:
            reasons.append(choice.finish_reason)
    assert roles == ["assistant"]
    assert text == whole.choices[0].message.content
    assert reasons == ["length"]
    assert usage is not None and usage.completion_tokens == n == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_usage_has_no_usage_chunk(client):
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True, **GREEDY)
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


# -------------------------------------------------------------------------------------------- sampling
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "extra_body": {"return_token_ids": True, "ignore_eos": True}}


def test_seeded_sampling_is_reproducible_and_is_generates(client, served_pair, ids_of):
    prompt, n = ids_of("Once upon a time"), 32
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, seed=1234, **SAMPLED)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, seed=1234, **SAMPLED)
    assert token_ids(first.choices[0]) == token_ids(again.choices[0])
    assert first.choices[0].text == again.choices[0].text
    # alone, a seeded request is generate's with that seed (the same sampler, the same draws)
    ref = reference(served_pair, prompt, n, sampling=SamplingConfig(0.8, 0, 0.9), seed=1234).tokens
    assert_matches_reference(token_ids(first.choices[0]), ref, n, served_pair.eos_token_ids)


def test_different_seeds_give_different_samples(client, ids_of):
    prompt, n = ids_of("Once upon a time"), 32
    texts = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, seed=seed, **SAMPLED)
        .choices[0]
        .text
        for seed in (1, 2, 3, 4)
    ]
    assert len(set(texts)) > 1


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
def test_max_tokens_is_exact(client, ids_of, n):
    out = client.completions.create(model=MODEL, prompt=ids_of("abc"), max_tokens=n, **GREEDY)
    assert len(token_ids(out.choices[0])) == n == out.usage.completion_tokens
    assert out.choices[0].finish_reason == "length"
    sampled = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=n, seed=n, **SAMPLED
    )
    assert len(token_ids(sampled.choices[0])) == n == sampled.usage.completion_tokens


def test_max_completion_tokens_is_max_tokens(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=9, **GREEDY
    )
    assert out.usage.completion_tokens == 9


# ------------------------------------------------------------------------------------------ stop strings
def _pick_stop(text: str, start: int) -> str:
    """A substring of ``text`` (3 chars, else 2) at or after ``start``, free of U+FFFD (the tiny pair's bytes
    are often not UTF-8), not all blank."""
    for length in (3, 2):
        for i in range(start, len(text) - length):
            piece = text[i : i + length]
            if "\ufffd" not in piece and piece.strip():
                return piece
    raise AssertionError(f"no clean piece in {text!r}")


@pytest.mark.parametrize("prompt", ["def main():", "Hello, world", "x"])
def test_stop_string_cuts_before_its_first_occurrence(server, client, prompt):
    n = 64
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, **GREEDY).choices[0].text
    stop = _pick_stop(full, len(full) // 2)
    expected = full[: full.find(stop)]
    assert len(expected) < len(full)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stop=stop, **GREEDY)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    # among other stops that never occur, and streamed: no delta holds the stop or anything after it
    stops = ["\x00never\x00", stop]
    with streamed(server, "/v1/completions", completion_body(prompt, n, stop=stops, stream=True)) as r:
        got = collect_stream(sse_events(r))
    assert got["done"] and got["finish_reason"] == "stop"
    assert got["text"] == expected
    assert all(stop not in d for d in got["deltas"])


def test_stop_string_in_chat_stream(client):
    messages, n = [{"role": "user", "content": "go"}], 64
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, **GREEDY)
    text = full.choices[0].message.content
    stop = _pick_stop(text, len(text) // 3)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=n, stop=[stop], stream=True, **GREEDY
    )
    deltas, reasons = [], []
    for chunk in stream:
        (choice,) = chunk.choices
        deltas.append(choice.delta.content or "")
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    assert "".join(deltas) == text[: text.find(stop)]
    assert all(stop not in d for d in deltas)
    assert reasons == ["stop"]


def test_a_stop_string_that_never_occurs_changes_nothing(client):
    n = 40
    plain = client.completions.create(model=MODEL, prompt="aaaa", max_tokens=n, **GREEDY).choices[0]
    stopped = client.completions.create(
        model=MODEL, prompt="aaaa", max_tokens=n, stop=["\x00\x01not there"], **GREEDY
    ).choices[0]
    assert stopped.text == plain.text
    assert stopped.finish_reason == "length"


# --------------------------------------------------------------------------------------------- bad input
def _bad_cases(ids_of):
    """(name, path, JSON body or raw bytes, status, fragment of the message, code or None)."""
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    hi = [{"role": "user", "content": "hi"}]
    long_prompt = ids_of("y" * (MAX_CONTEXT + 40))
    return [
        ("unknown-model", comp, {"model": "gpt-17", "prompt": "x"}, 404, "gpt-17", "model_not_found"),
        (
            "negative-max-tokens",
            comp,
            {"model": MODEL, "prompt": "x", "max_tokens": -3},
            400,
            "max_tokens",
            None,
        ),
        ("malformed-json", comp, b'{"model": "draftpilot", "prompt": "x",', 400, "JSON", None),
        (
            "past-context",
            comp,
            {"model": MODEL, "prompt": long_prompt},
            400,
            "context",
            "context_length_exceeded",
        ),
        (
            "prompt-plus-max-tokens-past-context",
            comp,
            {"model": MODEL, "prompt": ids_of("y" * (MAX_CONTEXT - 50)), "max_tokens": 100},
            400,
            "maximum context length",
            "context_length_exceeded",
        ),
        ("n-2", chat, {"model": MODEL, "messages": hi, "n": 2}, 400, "n must be 1", None),
        (
            "logprobs",
            chat,
            {"model": MODEL, "messages": hi, "logprobs": True},
            400,
            "logprobs",
            "unsupported_parameter",
        ),
        (
            "wrong-role",
            chat,
            {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
            400,
            "role",
            None,
        ),
        ("no-messages", chat, {"model": MODEL, "messages": []}, 400, "messages", None),
        ("missing-model", chat, {"messages": hi}, 400, "model", None),
        ("temperature-3", chat, {"model": MODEL, "messages": hi, "temperature": 3}, 400, "temperature", None),
        ("top-p-0", comp, {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", None),
        ("token-id-out-of-range", comp, {"model": MODEL, "prompt": [1, 99999]}, 400, "token ids", None),
        ("five-stops", comp, {"model": MODEL, "prompt": "x", "stop": list("abcde")}, 400, "stop", None),
        (
            "unimplemented-parameter",
            chat,
            {"model": MODEL, "messages": hi, "min_p": 0.1},
            400,
            "min_p",
            "unsupported_parameter",
        ),
        (
            "penalty-not-at-its-default",
            comp,
            {"model": MODEL, "prompt": "x", "presence_penalty": 0.5},
            400,
            "presence_penalty",
            "unsupported_parameter",
        ),
        (
            "lone-surrogate",
            chat,
            b'{"model": "draftpilot", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
            400,
            "surrogate",
            None,
        ),
        ("not-utf-8", comp, b'{"model": "draftpilot", "prompt": "\xff\xfe"}', 400, "UTF-8", None),
        ("top-k-minus-2", comp, {"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k", None),
    ]


def _send_bad(http: httpx.Client, server, case) -> httpx.Response:
    _, path, body, *_ = case
    if isinstance(body, bytes):
        return http.post(server.url(path), content=body, headers={"content-type": "application/json"})
    return http.post(server.url(path), json=body)


def _check_bad(case, response: httpx.Response) -> None:
    name, _, _, status, fragment, code = case
    assert response.status_code == status, (name, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and fragment.lower() in error["message"].lower(), (name, error)
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, (name, error)


def test_bad_requests_get_openai_shaped_4xx(server, ids_of):
    with httpx.Client(timeout=30) as http:
        for case in _bad_cases(ids_of):
            _check_bad(case, _send_bad(http, server, case))
    assert server.health()["status"] == "ok"


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert "max_tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="y" * (MAX_CONTEXT + 1))
    assert err.value.code == "context_length_exceeded"


def test_bad_requests_do_not_disturb_a_running_stream(server, served_pair, ids_of):
    """Every bad request fired, concurrently, at a server decoding a long greedy stream: each gets its 4xx,
    the stream's output is still exactly its alone result."""
    server.wait_idle()
    prompt, n = ids_of("while True:"), LONG
    ref = reference(served_pair, prompt, n).tokens
    cases = _bad_cases(ids_of)
    with streamed(server, "/v1/completions", completion_body(prompt, n, stream=True)) as r:
        assert r.status_code == 200
        events = sse_events(r)
        first = next(events)
        assert server.health()["running"] == 1
        with httpx.Client(timeout=30) as bad, ThreadPoolExecutor(len(cases)) as pool:
            responses = list(pool.map(lambda c: _send_bad(bad, server, c), cases))
        still_running = server.health()["running"] == 1
        got = collect_stream(iter([first, *events]))
    for case, response in zip(cases, responses):
        _check_bad(case, response)
    assert still_running  # the bad requests did meet the stream in flight
    assert got["done"] and got["finish_reason"] == "length"
    assert_matches_reference(got["token_ids"], ref, n, served_pair.eos_token_ids)
    assert got["text"] == served_pair.tokenizer.decode(got["token_ids"])


# ------------------------------------------------------------------------------------------- disconnects
def _counts(server) -> tuple[float, float]:
    """(cycles the engine ran, requests that ended with a finish reason: a dropped one never does)."""
    metrics = server.metrics()
    return metric_sum(metrics, "draftpilot_cycles_total"), metric_sum(metrics, "draftpilot_requests_total")


def test_a_stream_whose_client_leaves_frees_its_slot(server, client, served_pair, ids_of):
    """The client reads two chunks and closes the connection: the request leaves the batch at once (it never
    finishes, and runs far fewer cycles than the whole request needs), and the server goes on serving."""
    server.wait_idle()
    n = LONG
    whole = len(reference(served_pair, ids_of("loop"), n).cycles)  # the cycles of the whole request
    cycles, ended = _counts(server)
    with streamed(server, "/v1/completions", completion_body("loop", n, stream=True)) as r:
        events = sse_events(r)
        next(events), next(events)
        assert server.health()["running"] == 1
    # the block closed the connection with the stream unread
    left = time.monotonic()
    server.wait_health(lambda h: h["running"] == 0, timeout_s=10)
    assert time.monotonic() - left < 5
    cycles_now, ended_now = _counts(server)
    assert ended_now == ended  # dropped, not finished
    assert cycles_now - cycles < whole / 2  # and well before its end
    prompt = ids_of("after the disconnect")
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    assert_matches_reference(
        token_ids(out.choices[0]), reference(served_pair, prompt, 24).tokens, 24, served_pair.eos_token_ids
    )


def test_a_non_streamed_request_whose_client_leaves_frees_its_slot(server, client, served_pair, ids_of):
    """The client gives up waiting (a read timeout closes the connection) while the request decodes: the
    server notices within its disconnect poll (0.5 s) and drops the request before its end."""
    server.wait_idle()
    n = LONG
    whole = len(reference(served_pair, ids_of(f"{SLOW} abandoned"), n).cycles)
    cycles, ended = _counts(server)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(30, read=0.2)) as http:
        http.post(server.url("/v1/completions"), json=completion_body(f"{SLOW} abandoned", n))
    left = time.monotonic()
    server.wait_health(lambda h: h["running"] == 0 and h["waiting"] == 0, timeout_s=10)
    assert time.monotonic() - left < 5
    cycles_now, ended_now = _counts(server)
    assert ended_now == ended  # dropped, not finished
    assert cycles_now - cycles < whole
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=3, **GREEDY)
    assert out.usage.completion_tokens == 3


# ------------------------------------------------------------------------------------- an honest API
def test_unimplemented_parameters_are_refused_by_name(client, server):
    """Any field the server does not implement is a 400 naming it (all of them, when several), never
    ignored; OpenAI parameters at the value that means "unused" are accepted and change nothing."""
    for extra, names in (
        ({"repetition_penalty": 1.1}, ["repetition_penalty"]),
        ({"min_tokens": 3, "min_p": 0.05}, ["min_p", "min_tokens"]),
        ({"frequency_penalty": 0.3}, ["frequency_penalty"]),
        ({"stream_options": {"include_usage": True, "bogus": 1}}, ["bogus"]),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
        assert err.value.code == "unsupported_parameter", extra
        assert all(name in err.value.message for name in names), err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x", "name": "bob"}], max_tokens=2
        )
    assert "name" in err.value.message
    # the negative control: the no-op values pass and give the plain request's output
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "no-ops"}], max_tokens=8, **GREEDY
    )
    no_ops = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "no-ops", "name": None}],
        max_tokens=8,
        presence_penalty=0,
        frequency_penalty=0.0,
        logprobs=False,
        n=1,
        **GREEDY,
    )
    assert token_ids(no_ops.choices[0]) == token_ids(plain.choices[0])
    echo = client.completions.create(model=MODEL, prompt="x", max_tokens=3, echo=False, best_of=1, **GREEDY)
    assert echo.usage.completion_tokens == 3


def _error_count(server, status: int) -> float:
    return server.metrics().get(f'draftpilot_request_errors_total{{status="{status}"}}', 0.0)


def test_every_error_is_openai_shaped_and_counted(server):
    """From the body parser to the router: each error is {"error": {message, type, param, code}} in JSON,
    and counted under its status in /metrics (a lone surrogate was a plain-text 500 before)."""
    chat = server.url("/v1/chat/completions")
    json_header = {"content-type": "application/json"}
    surrogate = b'{"model": "draftpilot", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    cases = [
        ("post", chat, surrogate, 400, "surrogate"),
        ("post", chat, b'{"model": "draftpilot", "messages": [', 400, "JSON"),
        ("post", chat, b'{"model": "draftpilot", "messages": "\xff"}', 400, "UTF-8"),
        ("post", chat, b"[1, 2]", 400, ""),
        ("post", server.url("/v1/no-such-route"), b"{}", 404, "no route"),
        ("get", chat, None, 405, "GET"),
    ]
    statuses = {status for *_, status, _ in cases}
    before = {status: _error_count(server, status) for status in statuses}
    with httpx.Client(timeout=30) as http:
        for method, url, body, status, fragment in cases:
            response = http.request(method.upper(), url, content=body, headers=json_header)
            assert response.status_code == status, (url, body, response.text)
            assert response.headers["content-type"] == "application/json"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert fragment.lower() in error["message"].lower(), error
            assert error["type"] == "invalid_request_error"
    for status in statuses:
        expected = sum(1 for *_, s, _ in cases if s == status)
        assert _error_count(server, status) - before[status] == expected, status
    assert "Traceback" not in server.log()
    assert server.health()["status"] == "ok"


def _long_stream(server, served_pair, ids_of, prompt: str):
    """The prompt ids of a long greedy stream and its reference tokens."""
    ids = ids_of(prompt)
    return ids, reference(served_pair, ids, LONG).tokens


def test_a_body_over_the_limit_is_refused_at_once_and_a_stream_goes_on(server, served_pair, ids_of):
    server.wait_idle()
    prompt, ref = _long_stream(server, served_pair, ids_of, "body limit")
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "z" * 10_000_000}]}
    before = _error_count(server, 413)
    with streamed(server, "/v1/completions", completion_body(prompt, LONG, stream=True)) as r:
        events = sse_events(r)
        first = next(events)
        with httpx.Client(timeout=30) as http:
            started = time.monotonic()
            sized = http.post(server.url("/v1/chat/completions"), json=huge)  # with its Content-Length
            sized_in = time.monotonic() - started

            def chunks():  # no Content-Length: the limit counts the bytes as they arrive
                yield b'{"model": "draftpilot", "prompt": "'
                for _ in range(100):
                    yield b"z" * 100_000
                yield b'"}'

            chunked = http.post(server.url("/v1/completions"), content=chunks())
        assert server.health()["running"] == 1  # the refusals did meet the stream in flight
        got = collect_stream(iter([first, *events]))
    for response in (sized, chunked):
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and str(4 * 1024 * 1024) in error["message"]
    assert sized_in < 5.0
    assert _error_count(server, 413) - before == 2
    assert got["done"] and got["finish_reason"] == "length"
    assert_matches_reference(got["token_ids"], ref, LONG, served_pair.eos_token_ids)


def test_health_answers_while_long_prompts_are_refused(server):
    """Prompts are checked off the event loop: /health answers promptly while four prompts of 3.5 MB (under
    the body limit, far past the context) are received and checked; each gets its 400 from its size, before
    it is tokenized."""
    server.wait_idle()
    content = "y" * 3_500_000
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    gaps: list[float] = []
    done = threading.Event()

    def poll():
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                started = time.monotonic()
                assert http.get(server.url("/health")).status_code == 200
                gaps.append(time.monotonic() - started)
                time.sleep(0.01)

    def send(_):
        with httpx.Client(timeout=60) as http:
            return http.post(server.url("/v1/chat/completions"), json=body)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(send, range(4)))
    finally:
        done.set()
        poller.join(30)
    for response in responses:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert "maximum context length" in error["message"] and "3500000 bytes" in error["message"]
    assert gaps
    assert max(gaps) < 0.5, sorted(gaps)[-5:]


def test_a_vanishing_temperature_is_greedy_and_disturbs_no_one(server, client, served_pair, ids_of):
    """temperature 1e-40 would overflow logits / T (NaN probabilities, a failed step for the whole batch):
    it is greedy; a stream running beside it keeps its exact output. top_k -1 is "no limit", as 0."""
    server.wait_idle()
    prompt, ref = _long_stream(server, served_pair, ids_of, "vanishing")
    small, n = ids_of("tiny temperature"), 24
    with streamed(server, "/v1/completions", completion_body(prompt, LONG, stream=True)) as r:
        events = sse_events(r)
        first = next(events)
        out = client.completions.create(
            model=MODEL,
            prompt=small,
            max_tokens=n,
            temperature=1e-40,
            seed=5,
            extra_body=GREEDY["extra_body"],
        )
        got = collect_stream(iter([first, *events]))
    greedy = reference(served_pair, small, n).tokens
    assert_matches_reference(token_ids(out.choices[0]), greedy, n, served_pair.eos_token_ids)
    assert got["done"] and got["finish_reason"] == "length"
    assert_matches_reference(got["token_ids"], ref, LONG, served_pair.eos_token_ids)
    sampled = {"model": MODEL, "prompt": small, "max_tokens": n, "seed": 11, **SAMPLED}
    off = client.completions.create(**{**sampled, "extra_body": {**SAMPLED["extra_body"], "top_k": -1}})
    zero = client.completions.create(**{**sampled, "extra_body": {**SAMPLED["extra_body"], "top_k": 0}})
    assert token_ids(off.choices[0]) == token_ids(zero.choices[0])


def _steps_of(server, prompt, n) -> list[list[int]]:
    """The token ids of each step of a greedy stream (one chunk a step with return_token_ids)."""
    with streamed(server, "/v1/completions", completion_body(prompt, n, stream=True)) as r:
        steps = [
            list(e["choices"][0]["token_ids"])
            for e in sse_events(r)
            if e != "[DONE]" and e["choices"] and e["choices"][0].get("token_ids")
        ]
    return steps


def _one_token_at_a_time(tokenizer, ids, stop) -> tuple[int, str] | None:
    """(tokens, text) where a decoder committing one token a step meets ``stop`` (None if never)."""
    detok, matcher, text = Detokenizer(tokenizer), StopMatcher([stop]), ""
    for k, token in enumerate(ids, 1):
        text += matcher.feed(detok.feed([token]))
        if matcher.stopped:
            return k, text
    return None


def test_a_stop_string_counts_the_tokens_up_to_it(server, client, served_pair, ids_of):
    """A stop string completed by the first token of a step that commits several: usage and token_ids
    count the tokens up to that one, not the ones the step committed after it (which they did before)."""
    tokenizer = served_pair.tokenizer
    n, found = 64, None
    for text in PROMPTS:
        prompt = ids_of(text)
        steps = _steps_of(server, prompt, n)
        ids = [t for step in steps for t in step]
        full = tokenizer.decode(ids)
        starts, at = set(), 0  # where a step of several tokens begins, past the first step
        for step in steps:
            if len(step) >= 2 and at > 0:
                starts.add(at)
            at += len(step)
        for i in range(len(full) - 2):
            stop = full[i : i + 2]
            if "\ufffd" in stop or not stop.strip():
                continue
            met = _one_token_at_a_time(tokenizer, ids, stop)
            if met is not None and met[0] - 1 in starts:
                found = prompt, ids, met[0], met[1], stop
                break
        if found:
            break
    if found is None:
        pytest.skip("no stop string completed mid-step in the candidate outputs")
    prompt, ids, count, expected, stop = found
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stop=stop, **GREEDY)
    (choice,) = out.choices
    assert choice.finish_reason == "stop" and choice.text == expected
    assert token_ids(choice) == ids[:count]
    assert out.usage.completion_tokens == count
    body = completion_body(prompt, n, stop=[stop], stream=True, stream_options={"include_usage": True})
    with streamed(server, "/v1/completions", body) as r:
        got = collect_stream(sse_events(r))
    assert got["done"] and got["finish_reason"] == "stop" and got["text"] == expected
    assert got["token_ids"] == ids[:count]
    assert got["usage"]["completion_tokens"] == count
