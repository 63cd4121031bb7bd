"""What the HTTP API's routes share (``serving.app``, ``serving.request_checks``, ``serving.streams``):
``ServerState``, the pair, the worker, the metrics and the limits of one server."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.backends.pair import ModelPair
from engine.control import Controller
from serving.metrics import ServerMetrics
from serving.worker import EngineWorker

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Request bodies larger than this are refused (413) unless ``ServerState.max_body_bytes`` says otherwise."""


@dataclass
class ServerState:
    """What the routes need: the pair (tokenizer, limits), the worker, the controller of each request."""

    pair: ModelPair
    worker: EngineWorker
    metrics: ServerMetrics
    model_names: tuple[str, ...] = ("draftpilot",)
    """Names a request may give as ``model``; the first is the one ``/v1/models`` lists."""
    make_controller: Callable[[], Controller | None] = lambda: None
    """A fresh controller for each request (None: autoregressive)."""
    max_context: int = 4096
    """Prompt plus generated tokens of one request at most."""
    description: dict = field(default_factory=dict)
    """Shown by ``/health`` (pair, weights, controller, batch limits)."""
    created: int = field(default_factory=lambda: int(time.time()))
    max_body_bytes: int = MAX_BODY_BYTES
    """Request bodies larger than this are refused with a 413 before they are parsed."""
    allowed_hosts: tuple[str, ...] | None = None
    """The Host header names the server answers to (``serving.access``; None: any)."""
    api_keys: tuple[str, ...] = ()
    """Keys a ``/v1/*`` request must give as ``Authorization: Bearer KEY`` (empty: none needed)."""
    metrics_auth: bool = False
    """Whether ``/metrics`` needs a key too (with ``api_keys``)."""
    api_docs: bool = False
    """Whether the interactive API pages (``/docs``, ``/redoc``, ``/openapi.json``) are served."""
    body_timeout_s: float | None = None
    """A request body must have arrived whole this long after its headers (else 408); None: no bound."""
    specials: re.Pattern | None = field(default=None, repr=False)
    """The tokenizer's special (control) tokens' text, longest first (``serving.request_checks``; lazily)."""
    max_token_bytes: int = 0
    """The most UTF-8 bytes any token of the vocabulary spells (0: not measured yet)."""
    closing: asyncio.Event | None = field(default=None, repr=False)
    """Set when the server drains: request bodies still arriving are cut short with a 503."""
