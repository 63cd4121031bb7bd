"""The catch-all error handler: an exception nothing expected (a bug) still answers OpenAI-shaped JSON with a
500 and is counted in /metrics. A served process has no request that reaches one (each known failure is a
4xx, tested in test_serve_api.py), so this drives the app in-process (Starlette's test client over ASGI) with
a tokenizer that raises."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests_serving_helpers import MODEL, parse_metrics


@pytest.fixture
def app_client(served_pair):
    from serve import ServeConfig, build_state
    from serving.app import create_app

    state = build_state(ServeConfig(pair="tiny", policy="none"), pair=served_pair)
    with TestClient(create_app(state), raise_server_exceptions=False, base_url="http://localhost") as client:
        yield client


def test_an_unexpected_exception_is_an_openai_shaped_500_and_counted(app_client, served_pair, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ok = app_client.post("/v1/chat/completions", json=body)  # the negative control: it works untouched
    assert ok.status_code == 200, ok.text
    monkeypatch.setattr(served_pair.tokenizer, "apply_chat_template", broken)
    response = app_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    metrics = parse_metrics(app_client.get("/metrics").text)
    assert metrics['draftpilot_request_errors_total{status="500"}'] == 1
    assert app_client.get("/health").status_code == 200  # the server goes on
