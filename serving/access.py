"""Who and what the server answers (``serving.app`` installs it): the Host guard against DNS rebinding, the API
keys of ``/v1/*``, and a connection that has not sent a whole request header within a timeout is closed.

``AccessGuard`` is a pure ASGI middleware, outermost, so a refusal costs no body read and no parsing: a Host
header that is not one the server answers to gets a 400 (code ``invalid_host``); with API keys, a ``/v1/*``
request (and ``/metrics`` when asked) without ``Authorization: Bearer KEY`` naming one of them gets OpenAI's
401 (code ``invalid_api_key``). Both are counted by status, as every error is.

``connection_protocol`` gives uvicorn an HTTP/1.1 protocol (its own h11 one) that closes a connection whose
request header has not arrived whole ``header_timeout`` seconds after the connection opened or after its
previous response: uvicorn bounds a header's size (h11, 16 KiB) but not its time, and its keep-alive timer
is cancelled by the first byte of the next request, so a client sending a header a byte a minute, or
nothing at all, held its connection for as long as it liked. It also answers the request of a connection
past ``max_connections`` with a counted 503.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.request_checks import ApiError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""The names a loopback server answers to by default (with any port)."""


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches this machine only."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host of a Host header, lowercase, without its port or a trailing dot: ``[::1]:8000`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal, maybe with a port
        return header[1:].partition("]")[0]
    if header.count(":") == 1:
        header = header.partition(":")[0]
    return header.rstrip(".")


def host_allowed(name: str, allowed: Iterable[str]) -> bool:
    """Whether ``name`` (``host_name``) matches one of ``allowed``: an exact name, ``*.domain`` (its
    subdomains) or ``*`` (any)."""
    for pattern in allowed:
        if pattern == "*" or name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


def key_matches(given: str, keys: tuple[bytes, ...]) -> bool:
    """Whether ``given`` is one of ``keys``, compared in constant time (every key is compared)."""
    candidate = given.encode("utf-8", "surrogateescape")
    found = False
    for key in keys:
        found |= hmac.compare_digest(candidate, key)
    return found


class AccessGuard:
    """ASGI middleware: the Host guard (``allowed_hosts``; None: any host) and the API keys (``api_keys``;
    empty: none needed) of the ``/v1/*`` routes, and of ``/metrics`` when ``metrics_auth``. ``on_refuse``
    counts each refusal by status."""

    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: tuple[str, ...] | None,
        api_keys: tuple[str, ...],
        metrics_auth: bool,
        on_refuse: Callable[[int], None],
    ):
        self.app, self.allowed_hosts, self.metrics_auth, self.on_refuse = (
            app,
            allowed_hosts,
            metrics_auth,
            on_refuse,
        )
        self.api_keys = tuple(k.encode("utf-8", "surrogateescape") for k in api_keys)

    def refusal(self, scope: Scope) -> ApiError | None:
        headers = dict(scope.get("headers") or ())
        if self.allowed_hosts is not None:
            raw = headers.get(b"host", b"").decode("latin-1")
            if not host_allowed(host_name(raw), self.allowed_hosts):
                return ApiError(
                    400, f"the Host header {raw!r} is not a name this server answers to (it answers to "
                    f"{', '.join(self.allowed_hosts)}; serve.py --allowed-hosts)", None, "invalid_host",
                )  # fmt: skip
        path = scope.get("path", "")
        if self.api_keys and (
            path == "/v1" or path.startswith("/v1/") or (self.metrics_auth and path == "/metrics")
        ):
            scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not given.strip():
                return ApiError(
                    401, "You didn't provide an API key. You need to provide your API key in an Authorization "
                    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", None, "invalid_api_key",
                )  # fmt: skip
            if not key_matches(given.strip(), self.api_keys):
                return ApiError(401, "Incorrect API key provided.", None, "invalid_api_key")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.refusal(scope)
            if refused is not None:
                self.on_refuse(refused.status)
                await refused.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def connection_protocol(
    header_timeout: float, max_connections: int, on_refuse: Callable[[int], None]
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with two bounds. A connection that does not send a whole request header within
    ``header_timeout`` seconds of opening or of its previous response is closed (the keep-alive timer, 5 s
    after a response, still closes an idle connection first). A connection opened while ``max_connections``
    are open has its request answered with a 503 in OpenAI's shape, counted (``on_refuse``), and is closed:
    uvicorn's ``limit_concurrency`` does the same with a plain-text 503 that never reaches the app, so no
    counter saw it."""

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        on_refuse(503)
        response = ApiError(
            503, f"the server has {max_connections} connections open, its limit (serve.py --max-connections); "
            "retry later", None, "unavailable",
        ).response()  # fmt: skip
        response.headers["Connection"] = "close"
        await response(scope, receive, send)

    class GuardedH11(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self.header_timer = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _expired(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:  # this one is past the bound: its request gets a 503
                self.app = refuse
            self._arm()

        def handle_events(self) -> None:
            scope = self.scope
            super().handle_events()
            if self.scope is not scope:  # a request's header arrived whole
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # before: a pipelined request is handled at once below, and disarms it
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11
