"""The server as a user meets it: ``python serve.py --pair tiny`` in a subprocess on a loopback port, and the
reference a request's tokens must equal (``SpeculativeEngine.generate`` of the same request alone, on the same
pair, in the test process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
MODEL = "draftpilot"

STARTUP_S = 300.0
"""Deadline for a server to answer GET /health with 200. A start takes ~15 s on a loaded 2-core machine; the
first one after the compiled kquant kernels' cache was rebuilt elsewhere waits for their build (minutes)."""
STOP_S = 20.0
"""Deadline for a terminated server to exit before it is killed."""

SERVER_FLAGS = ("--pair", "tiny", "--log-level", "warning", "--policy", "none", "--threads", "1")
"""Every test server: the tiny pair with its default weight formats, the static controller (whatever
runs/main holds), one torch thread (the reference runs with one as well)."""

DEFAULT_CONTROLLER = "StaticController(depth=1, verify=1, tree_width=1)"
"""The controller a server without --policy/--depth/--verify gives each request (/health shows it)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``serve.py`` subprocess: ``start`` launches it (without waiting), ``wait_ready`` polls /health
    until 200, ``stop`` terminates it (kills it past ``STOP_S``). Output goes to ``log_path``."""

    def __init__(self, flags: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.flags = list(flags)
        self.log_path = log_path
        self.env = dict(env or {})
        """Variables added to the server's environment."""
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._attempts = 0

    # ------------------------------------------------------------------------------------------ life
    def start(self) -> ServerProcess:
        self.port = free_port()
        self._attempts += 1
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        cmd = [sys.executable, "serve.py", *SERVER_FLAGS, "--port", str(self.port), *self.flags]
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def wait_ready(self, deadline_s: float = STARTUP_S) -> ServerProcess:
        deadline = time.monotonic() + deadline_s
        while True:
            code = self.proc.poll()
            if code is not None:
                log = self.log()
                if "address already in use" in log.lower() and self._attempts < 3:  # lost the port race
                    return self.start().wait_ready(max(deadline - time.monotonic(), 1.0))
                raise RuntimeError(f"the server exited with {code} before it was ready:\n{log[-4000:]}")
            try:
                if httpx.get(self.url("/health"), timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not ready in {deadline_s:.0f} s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def stop(self) -> int | None:
        """Terminate (SIGTERM), kill past ``STOP_S``; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_S)
        return self.proc.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # --------------------------------------------------------------------------------------- clients
    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def url(self, path: str) -> str:
        return f"http://{HOST}:{self.port}{path}"

    def openai(self, timeout: float = 60.0):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=timeout)

    def health(self) -> dict:
        return httpx.get(self.url("/health"), timeout=10.0).json()

    def metrics(self) -> dict[str, float]:
        """/metrics parsed: ``name{labels}`` -> value (comment lines dropped)."""
        response = httpx.get(self.url("/metrics"), timeout=10.0)
        response.raise_for_status()
        return parse_metrics(response.text)

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Poll /health until no request runs or waits; the last /health body."""
        deadline = time.monotonic() + timeout_s
        while True:
            body = self.health()
            if body["running"] == 0 and body["waiting"] == 0:
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is not idle after {timeout_s} s: {body}")
            time.sleep(0.05)

    def wait_health(self, predicate, timeout_s: float = 30.0) -> dict:
        """Poll /health until ``predicate(body)``; the body (AssertionError past the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            body = self.health()
            if predicate(body):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"/health never reached the state in {timeout_s} s: last {body}")
            time.sleep(0.02)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """Sum of a metric over its labels (``name`` or ``name{...}``)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


# ----------------------------------------------------------------------------------- raw SSE streams
@contextmanager
def streamed(
    server: ServerProcess, path: str, body: dict, timeout: float = 120.0
) -> Iterator[httpx.Response]:
    """A raw streaming POST on its own connection (closed when the block ends, read or not)."""
    with httpx.Client(timeout=timeout) as http, http.stream("POST", server.url(path), json=body) as response:
        yield response


def sse_events(response: httpx.Response, deadline_s: float = 120.0) -> Iterator[dict | str]:
    """The ``data:`` payloads of an SSE response, JSON-decoded ("[DONE]" as the string); bounded by the
    response's read timeout per line and ``deadline_s`` overall."""
    deadline = time.monotonic() + deadline_s
    for line in response.iter_lines():
        if time.monotonic() > deadline:
            raise AssertionError(f"the stream did not end in {deadline_s} s")
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        yield data if data == "[DONE]" else json.loads(data)


def completion_body(prompt, max_tokens: int, **extra) -> dict:
    """A greedy /v1/completions body (token ids back, EOS ignored unless ``extra`` says otherwise)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(return_token_ids=True, ignore_eos=True)
    body.update(extra)
    return body


def collect_stream(events: Iterator[dict | str], chat: bool = False) -> dict:
    """Text, token ids, finish reason, usage and [DONE] of a stream of ``sse_events``."""
    out = {"text": "", "token_ids": [], "finish_reason": None, "usage": None, "done": False, "deltas": []}
    for event in events:
        if event == "[DONE]":
            out["done"] = True
            break
        assert "error" not in event, event
        if event.get("usage") is not None and not event["choices"]:
            out["usage"] = event["usage"]
            continue
        (choice,) = event["choices"]
        delta = choice["delta"].get("content") if chat else choice["text"]
        if delta:
            out["deltas"].append(delta)
            out["text"] += delta
        out["token_ids"] += choice.get("token_ids", [])
        if choice["finish_reason"] is not None:
            assert out["finish_reason"] is None, "two finish reasons"
            out["finish_reason"] = choice["finish_reason"]
    return out


# -------------------------------------------------------------------------------------- the reference
def reference(pair, prompt_ids: Sequence[int], max_new_tokens: int, sampling=None, seed: int = 0):
    """``SpeculativeEngine.generate`` of the request alone, with the server's default controller."""
    from engine.control import StaticController
    from engine.engine import SpeculativeEngine
    from engine.sampling import SamplingConfig

    engine = SpeculativeEngine(pair, sampling or SamplingConfig(0.0))
    controller = StaticController(depth=1, verify=1, tree_width=1)
    return engine.generate(list(prompt_ids), max_new_tokens=max_new_tokens, controller=controller, seed=seed)


def assert_matches_reference(ids: Sequence[int], ref: Sequence[int], max_new_tokens: int, eos_ids) -> None:
    """An ``ignore_eos`` output of ``max_new_tokens`` tokens against ``generate``'s: equal, or (where
    ``generate`` met EOS) equal up to and including that EOS."""
    assert len(ids) == max_new_tokens
    if ref and ref[-1] in eos_ids and len(ref) < max_new_tokens:
        assert list(ids[: len(ref)]) == list(ref)
    else:
        assert list(ids) == list(ref)
