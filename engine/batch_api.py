"""What the batched engine (``engine.batch``) takes and gives: ``BatchConfig``, ``BatchRequest``, ``StepEvent``,
its errors (``CapacityError``, ``MemoryFull``, ``RequestFailed``, ``EngineFailed``) and how it names an error
and a size in one line (``one_line``, ``format_bytes``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.control import Controller
from engine.errors import DraftpilotError, InputError, is_int, short_repr
from engine.inputs import EngineConfig
from engine.results import CycleRecord
from engine.sampling import SamplingConfig


class CapacityError(DraftpilotError):
    """A request was refused because the batch holds ``BatchConfig.max_requests`` requests already."""


class MemoryFull(CapacityError):
    """A request's KV reservation does not fit next to those of the admitted requests
    (``BatchConfig.max_kv_bytes``): retry when one finishes."""


class RequestFailed(DraftpilotError):
    """One request failed alone on an error that is not one of the project's own (a bug in its controller, an
    allocation failure in its forward); the original exception is the ``__cause__``."""


class EngineFailed(DraftpilotError):
    """A forward shared by several requests failed, and so did each one's forward alone: the engine, not one
    request, is broken (``step`` raises it; build a new ``BatchedEngine``)."""


def one_line(err: BaseException, limit: int = 300) -> str:
    """``Type: message`` of an exception on one line, cut to ``limit`` characters."""
    text = " ".join(str(err).split()) or "(no message)"
    text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class BatchConfig:
    max_requests: int = 8
    """Requests admitted at once (added and not finished); ``add`` past it raises ``CapacityError``."""
    max_rows: int = 64
    """Rows of one target forward (each request's root plus its granted nodes; the rule is in the module
    docstring) and of one draft forward; at least ``max_requests``."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Caps, draft mode and lookup, as for ``SpeculativeEngine`` (every request shares them)."""
    max_prefill_tokens: int = 16
    """Prompt tokens prefilled in one step (the module docstring, step 1): chunks of the waiting prompts, in
    admission order, ride in the step's target forward, so a long prompt or a burst of arrivals costs every
    running request a bounded delay a step instead of a stall for all the prefills. Without chunks (the
    torch path) whole prompts while they fit, at least one a step."""
    idle_prefill_tokens: int = 512
    """Prompt tokens prefilled in one step while no request decodes (the budget follows the load: module
    docstring, step 1): a lone prompt runs at the prefill's full speed, in chunks of ``MAX_ROWWISE_ROWS`` rows
    within the step; with d requests decoding the budget is max(``max_prefill_tokens``, min(this,
    ``MAX_ROWWISE_ROWS`` // d)). At most ``max_prefill_tokens``: a fixed budget (the larger of the two
    applies when none decodes)."""
    max_kv_bytes: int | None = None
    """KV cache bytes the admitted requests may reserve together (module docstring, "Memory"); None: no
    bound (each request still reserves, and its caches never outgrow, what it can reach)."""
    prefix_cache_bytes: int = 0
    """Bytes the prefix cache may hold (``engine.prefix_cache``: the KV of earlier prompts and answers, target
    and draft, reused by later requests); 0: no prefix cache. Within ``max_kv_bytes`` when that is set: the
    cache holds what the slots' reservations leave, and gives way (least recently used first) to them."""

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_rows", "max_prefill_tokens", "idle_prefill_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InputError(f"BatchConfig.{name} must be an integer >= 1, got {short_repr(value)}")
        if self.max_kv_bytes is not None and (not is_int(self.max_kv_bytes) or self.max_kv_bytes < 1):
            raise InputError(
                f"BatchConfig.max_kv_bytes must be an integer >= 1 or None, got {short_repr(self.max_kv_bytes)}"
            )
        if not is_int(self.prefix_cache_bytes) or self.prefix_cache_bytes < 0:
            raise InputError(
                f"BatchConfig.prefix_cache_bytes must be an integer >= 0 (0: off), got {short_repr(self.prefix_cache_bytes)}"
            )
        if self.max_rows < self.max_requests:
            raise InputError(
                f"BatchConfig.max_rows ({self.max_rows}) must be >= max_requests ({self.max_requests}): every "
                "request needs a row in each target forward"
            )
        if not isinstance(self.engine, EngineConfig):
            raise InputError(f"BatchConfig.engine must be an EngineConfig, got {short_repr(self.engine)}")


@dataclass
class BatchRequest:
    """One request: the arguments of ``SpeculativeEngine.generate`` plus its own sampling and stop tokens."""

    prompt: str | list[int]
    max_new_tokens: int = 128
    controller: Controller | None = None
    """None: autoregressive. A controller instance serves one request at a time (it keeps per-request state)."""
    seed: int = 0
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: Iterable[int] = frozenset()
    """Token ids that end the request (committed, finish reason "stop"), besides the pair's EOS ids."""
    ignore_eos: bool = False
    """Decode past the pair's EOS ids (to ``max_new_tokens``, the context or a stop token): fixed-length
    outputs for benchmarks; the law of every token is still the target's."""


@dataclass(frozen=True)
class StepEvent:
    """What one ``step`` did for one request."""

    rid: int
    tokens: tuple[int, ...]
    """Tokens committed by this step (the prefill's first token included)."""
    finished: bool
    finish_reason: str | None
    """As ``GenerationResult.finish_reason``, or "error" (the request failed alone: ``result`` raises why)."""
    record: CycleRecord | None
    """The cycle this step ran for the request (None: it finished at its prefill)."""
    cached_tokens: int = 0
    """Prompt tokens the request took from the prefix cache (``GenerationResult.cached_tokens``)."""


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units (``12.5 MiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
