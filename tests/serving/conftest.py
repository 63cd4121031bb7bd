"""Fixtures of the server tests: ``serve.py`` subprocesses on loopback ports, and the pair they serve loaded
in the test process for the reference outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests_serving_helpers

from tests_serving_helpers import ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def served_pair():
    """The pair ``serve.py --pair tiny`` serves, loaded by the same code (``ServeConfig.load``: the
    ``ModelConfig`` defaults, so the same weight formats)."""
    from serve import ServeConfig

    return ServeConfig(pair="tiny").load()


@pytest.fixture(scope="module")
def launch_server(tmp_path_factory):
    """``launch_server(*flags, env=None)``: a ``serve.py`` subprocess (``env``: variables added to its
    environment) started (not yet ready: ``.wait_ready()``),
    stopped at the end of the module whatever happened."""
    servers: list[ServerProcess] = []

    def launch(*flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(flags, log, env).start()
        servers.append(server)
        return server

    yield launch
    for server in servers:
        server.stop()
