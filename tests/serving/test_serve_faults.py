"""Fault isolation and memory-bounded admission on a real server (``serve.py --pair tiny`` in a subprocess).
Faults are injected through ``DRAFTPILOT_FAULTS`` (``serving/faults.py``: a request whose prompt holds a
marker fails in a chosen way): the marked request gets a 500 with a one-line reason, the requests decoding
next to it finish with exactly their alone tokens, and the server keeps serving. Under a small
``--kv-memory`` the reserved bytes never pass the budget, requests wait for memory and finish exact, and one
that could never fit gets a 400 saying how much it needs."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests_serving_helpers import (
    assert_matches_reference,
    collect_stream,
    completion_body,
    reference,
    sse_events,
    streamed,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # the reference, as the server (--threads 1)

FAULTS = {"controller": "@@ctl@@", "alloc": "@@oom@@", "nan": "@@nan@@"}
REASONS = {"controller": "RuntimeError", "alloc": "MemoryError", "nan": "not finite"}
BYTES_PER_POSITION = 2 * 512  # tiny pair: target and draft, 2 layers x 2 kv heads x 32 x 2 x 4 bytes
LONG_N = 160
BUDGET = 300 * 1024
"""Fits four short requests (N = 24) at once, one long one (LONG_N), never one of 400 tokens."""
N = 24
PROMPTS = ("def main():", "The quick brown fox", "x")


@pytest.fixture(scope="module")
def server(launch_server, served_pair):
    spec = ",".join(f"{kind}={marker}" for kind, marker in FAULTS.items())
    launched = launch_server(
        "--max-requests", "4", "--kv-memory", str(BUDGET), env={"DRAFTPILOT_FAULTS": spec}
    )
    return launched.wait_ready()


def _post(server, body: dict) -> httpx.Response:
    with httpx.Client(timeout=120) as http:
        return http.post(server.url("/v1/completions"), json=body)


def _check_others(responses, refs, eos_ids, n=N) -> None:
    for response, ref in zip(responses, refs):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert_matches_reference(choice["token_ids"], ref, n, eos_ids)


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_failing_request_gets_a_500_alone_and_the_others_are_exact(server, served_pair, kind):
    server.wait_idle()
    ids = served_pair.tokenizer.encode
    refs = [reference(served_pair, ids(p), N).tokens for p in PROMPTS]
    bodies = [completion_body(ids(p), N) for p in PROMPTS]
    culprit = completion_body(f"{FAULTS[kind]} hello", N)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_post, server, b) for b in bodies[:1] + [culprit] + bodies[1:]]
        responses = [f.result() for f in futures]
    failed = responses.pop(1)
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["type"] == "server_error"
    assert REASONS[kind] in error["message"] and "\n" not in error["message"], error
    _check_others(responses, refs, served_pair.eos_token_ids)
    body = server.wait_idle()
    assert body["status"] == "ok" and body["kv_reserved_bytes"] == 0
    after = _post(server, bodies[0])  # the server keeps serving
    _check_others([after], refs[:1], served_pair.eos_token_ids)


def test_a_failing_stream_ends_with_an_error_event_and_the_stream_next_to_it_is_exact(server, served_pair):
    server.wait_idle()
    prompt = served_pair.tokenizer.encode("while True:")
    ref = reference(served_pair, prompt, 200).tokens
    with streamed(server, "/v1/completions", completion_body(prompt, 200, stream=True)) as good:
        events = sse_events(good)
        head = [next(events)]
        with streamed(
            server, "/v1/completions", completion_body(f"{FAULTS['controller']} x", 200, stream=True)
        ) as bad:
            assert bad.status_code == 200  # the first tokens went out before the fault
            got_bad = list(sse_events(bad))
        got = collect_stream(iter([*head, *events]))
    errors = [e for e in got_bad if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "RuntimeError" in errors[0]["error"]["message"]
    assert got["done"] and got["finish_reason"] == "length"
    assert_matches_reference(got["token_ids"], ref, 200, served_pair.eos_token_ids)


def test_requests_wait_for_kv_memory_and_the_budget_is_never_exceeded(server, served_pair):
    server.wait_idle()
    ids = served_pair.tokenizer.encode
    prompts = [ids(p) for p in PROMPTS]
    need = [BYTES_PER_POSITION * (len(p) + LONG_N - 1) for p in prompts]
    assert max(need) <= BUDGET < 2 * min(need)  # one at a time
    refs = [reference(served_pair, p, LONG_N).tokens for p in prompts]
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            m, h = server.metrics(), server.health()
            seen.append(
                (
                    m["draftpilot_kv_cache_reserved_bytes"],
                    m["draftpilot_kv_cache_allocated_bytes"],
                    h["waiting"],
                )
            )
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(lambda p: _post(server, completion_body(p, LONG_N)), prompts))
    stop.set()
    watcher.join(10)
    _check_others(responses, refs, served_pair.eos_token_ids, LONG_N)
    assert seen and all(alloc <= reserved <= BUDGET for reserved, alloc, _ in seen)
    assert max(r for r, _, _ in seen) > 0 and max(w for _, _, w in seen) > 0  # memory held, a request waited
    assert server.metrics()["draftpilot_kv_cache_budget_bytes"] == BUDGET
    assert server.health()["kv_budget_bytes"] == BUDGET


def test_a_request_that_could_never_fit_gets_a_400_saying_why(server):
    response = _post(server, completion_body("x", 400))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "KV cache" in error["message"] and "budget" in error["message"] and "KiB" in error["message"]
    ok = _post(server, completion_body("x", 8))
    assert ok.status_code == 200
