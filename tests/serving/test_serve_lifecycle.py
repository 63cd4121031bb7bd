"""The server under pressure and at its end, as a user meets it: a one-slot server (``--max-requests 1
--max-waiting 1``) refuses a third request at once with 429 while it decodes one and holds one, and then
finishes both; SIGTERM drains it (the stream in flight completes while the server still listens and answers
503 to /health and to new requests) and it exits 0.
The shutdown test ends this module's server, so it comes last."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from serving.faults import FAULTS_ENV
from tests_serving_helpers import (
    MODEL,
    assert_matches_reference,
    collect_stream,
    completion_body,
    reference,
    sse_events,
    streamed,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # the reference, as the server (--threads 1)

LONG = 1000
SLOW = "@@slow@@"
"""A prompt holding it decodes 5 ms a step slower (``serving.faults``, ``slow``): ~5 s for LONG tokens whatever
the machine's speed, so a client can leave the line while it runs."""
"""Tokens of a request that must still be decoding while the test does something else (a second or more;
the server's context is the tiny pair's, 1024)."""
EXIT_S = 60.0


@pytest.fixture(scope="module")
def launched(launch_server):
    # requests marked SLOW take 5 ms more a step (serving/faults.py): a margin for the tests that leave mid-way
    return launch_server("--max-requests", "1", "--max-waiting", "1", env={FAULTS_ENV: f"slow={SLOW}"})


@pytest.fixture(scope="module")
def server(launched, served_pair):
    return launched.wait_ready()


def _errors(server, status: int) -> float:
    return server.metrics().get(f'draftpilot_request_errors_total{{status="{status}"}}', 0.0)


def test_a_full_waiting_line_gets_429_at_once_and_the_others_complete(server, served_pair):
    server.wait_idle()
    ids = served_pair.tokenizer.encode
    first_prompt, second_prompt, n2 = ids("first in"), ids("second, waiting"), 48
    first_ref = reference(served_pair, first_prompt, LONG).tokens
    second_ref = reference(served_pair, second_prompt, n2).tokens
    second: dict = {}

    def wait_in_line():
        with httpx.Client(timeout=120) as http:
            second["response"] = http.post(
                server.url("/v1/completions"), json=completion_body(second_prompt, n2)
            )

    client = server.openai(timeout=30)
    refused_before = _errors(server, 429)
    with streamed(server, "/v1/completions", completion_body(first_prompt, LONG, stream=True)) as r:
        assert r.status_code == 200
        events = sse_events(r)
        head = [next(events)]  # the first request is decoding
        waiter = threading.Thread(target=wait_in_line, daemon=True)
        waiter.start()
        server.wait_health(lambda h: h["running"] == 1 and h["waiting"] == 1, timeout_s=20)
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="third", max_tokens=4)
        refused_in = time.monotonic() - started
        raw = httpx.post(
            server.url("/v1/chat/completions"),
            json={"model": MODEL, "messages": [{"role": "user", "content": "fourth"}], "max_tokens": 4},
            timeout=30,
        )
        assert server.health()["running"] == 1  # the refusals did meet a full server
        got = collect_stream(iter([*head, *events]))
    waiter.join(120)
    assert not waiter.is_alive()
    assert refused_in < 3.0
    assert err.value.status_code == 429
    assert err.value.code == "overloaded"
    assert err.value.type == "rate_limit_error"
    assert raw.status_code == 429
    assert raw.headers.get("retry-after") == "1"
    assert "retry later" in raw.json()["error"]["message"]
    assert _errors(server, 429) - refused_before == 2  # counted in /metrics
    # the running and the waiting request are unharmed
    assert got["done"] and got["finish_reason"] == "length"
    assert_matches_reference(got["token_ids"], first_ref, LONG, served_pair.eos_token_ids)
    response = second["response"]
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert_matches_reference(choice["token_ids"], second_ref, n2, served_pair.eos_token_ids)
    server.wait_idle()


def test_a_waiting_request_whose_client_leaves_leaves_the_line(server):
    """A client that gives up while its request waits for the slot frees its place in the line: the request
    is never decoded (its prompt never counts in the metrics), the running one goes on."""
    server.wait_idle()
    before = server.metrics()["draftpilot_prompt_tokens_total"]
    outcome = []

    def impatient():
        try:
            with httpx.Client(timeout=httpx.Timeout(30, read=0.2)) as http:
                outcome.append(http.post(server.url("/v1/completions"), json=completion_body("impatient", 8)))
        except httpx.ReadTimeout as err:
            outcome.append(err)

    with streamed(server, "/v1/completions", completion_body(f"{SLOW} busy", LONG, stream=True)) as r:
        events = sse_events(r)
        head = [next(events)]
        thread = threading.Thread(target=impatient, daemon=True)
        thread.start()
        server.wait_health(lambda h: h["waiting"] == 1, timeout_s=10)
        thread.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], httpx.ReadTimeout), outcome
        server.wait_health(lambda h: h["waiting"] == 0, timeout_s=10)
        rest = collect_stream(iter([*head, *events]))
    assert rest["done"] and rest["finish_reason"] == "length"
    server.wait_idle()
    assert server.metrics()["draftpilot_prompt_tokens_total"] - before == len(f"{SLOW} busy")


def _wait_draining(server, timeout_s: float = 10.0) -> httpx.Response:
    """Poll /health on new connections until it is no longer 200; that answer (it must be one: the server
    keeps listening while it drains)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(server.url("/health"), timeout=2)
        except httpx.TransportError as err:
            pytest.fail(f"/health refused a connection while the server drained: {err!r}")
        if response.status_code != 200:
            return response
        time.sleep(0.02)
    pytest.fail(f"/health still answered 200 {timeout_s} s after SIGTERM")


def test_sigterm_drains_the_stream_in_flight_refuses_new_requests_and_exits_0(server, served_pair):
    """The server keeps listening while it drains (/health and new requests: 503 on new connections), the
    stream in flight and the request waiting behind it (which keeps the engine busy longer than the
    checks take) both complete, then it exits 0."""
    server.wait_idle()
    prompt = served_pair.tokenizer.encode("until the end")
    ref = reference(served_pair, prompt, LONG).tokens
    body = completion_body(prompt, LONG, stream=True, stream_options={"include_usage": True})
    waiting: dict = {}

    def wait_in_line():
        with httpx.Client(timeout=120) as http:
            waiting["response"] = http.post(server.url("/v1/completions"), json=completion_body("next", LONG))

    with streamed(server, "/v1/completions", body) as r:
        assert r.status_code == 200
        events = sse_events(r)
        head = [next(events)]
        waiter = threading.Thread(target=wait_in_line, daemon=True)
        waiter.start()
        server.wait_health(lambda h: h["waiting"] == 1 or h["running"] == 0, timeout_s=20)
        unavailable_before = _errors(server, 503)
        server.proc.send_signal(signal.SIGTERM)
        health = _wait_draining(server)  # the signal has been handled
        # a new request, on a new connection, is refused at once with 503, never left hanging
        started = time.monotonic()
        try:
            with httpx.Client(timeout=10) as late:
                refused = late.post(server.url("/v1/completions"), json=completion_body("too late", 4))
        except httpx.TimeoutException:
            pytest.fail("a request sent after SIGTERM hung")
        refused_in = time.monotonic() - started
        still_draining = httpx.get(server.url("/health"), timeout=5)
        unavailable = _errors(server, 503) - unavailable_before  # /metrics answers while draining
        got = collect_stream(iter([*head, *events]))
    assert health.status_code == 503, health.text
    assert health.json()["status"] in ("draining", "stopped")  # stopped: the engine is done, the stream not
    assert refused_in < 5.0
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "unavailable"
    assert unavailable == 1  # the refused request; /health's 503 is its state, not an error
    assert still_draining.status_code == 503
    assert got["done"] and got["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == LONG
    waiter.join(120)
    assert waiting["response"].status_code == 200, waiting["response"].text
    assert waiting["response"].json()["usage"]["completion_tokens"] == LONG
    assert_matches_reference(got["token_ids"], ref, LONG, served_pair.eos_token_ids)
    try:
        code = server.proc.wait(EXIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within {EXIT_S} s of SIGTERM")
    assert code == 0, server.log()[-3000:]
