"""Server processes for benchmarks and tests: start one, wait until it answers ``/health``, stop it with
SIGTERM (it drains), read its memory; the prompt token ids our server builds for a chat message."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port free on the loopback address now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kb(pid: int, key: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return float(line.split()[1])
    except OSError:
        pass
    return float("nan")


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` now (MB; NaN where /proc does not tell)."""
    return _status_kb(pid, "VmRSS") / 1024


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory of process ``pid`` since it started (MB)."""
    return _status_kb(pid, "VmHWM") / 1024


class ServerProcess:
    """``with ServerProcess(name, command, port, log) as server:`` runs ``command`` (which must listen on
    127.0.0.1:``port`` and answer GET /health with 200 when ready), output to ``log``; ``env``: variables
    added to this process's environment for it."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        log: Path | str,
        ready_s: float = 900,
        cwd=None,
        env: dict[str, str] | None = None,
    ):
        self.name, self.command, self.port, self.log = name, list(command), port, Path(log)
        self.ready_s, self.cwd, self.env = ready_s, cwd, dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{port}"

    def __enter__(self) -> ServerProcess:
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env} if self.env else None,
        )
        deadline = time.time() + self.ready_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._out.close()
                raise RuntimeError(f"{self.name}: the server exited ({self.proc.returncode}), see {self.log}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.name}: not ready in {self.ready_s:.0f} s, see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._out.closed:
            self._out.close()


def prompt_ids(pair: str, text: str) -> list[int]:
    """The token ids our server builds for ``text`` as one user message of a named pair (the tiny pair: its
    byte tokenizer, no chat template, cut to 200 bytes)."""
    if pair == "tiny":
        from engine.backends.tiny import ByteTokenizer

        return ByteTokenizer().encode(text)[:200]
    from engine.backends.weights import pair_tokenizer

    ids = pair_tokenizer(pair).apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
