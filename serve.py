"""Command line: an OpenAI-compatible server over the continuous-batching exact engine.

python serve.py                                            # default pair, runs/main/policy.pt if trained
python serve.py --pair tiny --port 8001                    # the tiny test pair (no weights to fetch)
python serve.py --autoregressive --max-requests 16         # no speculation, 16 requests batched
python serve.py --policy runs/main/policy.pt --lookup on   # a trained policy, context lookup on

Every request decodes in one shared batch (``engine.batch.BatchedEngine``); a greedy request's tokens are
those of the same request decoded alone, whoever else is in the batch. Routes, parameters and errors:
docs/serving.md. The server listens on loopback unless --host says otherwise; Ctrl-C (SIGINT/SIGTERM) drains
it: new requests get 503 while the ones in flight finish, then it exits (a second Ctrl-C: at once).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass

from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, format_bytes
from engine.cli import (
    CLI_ERRORS,
    ArgumentParser,
    ModelConfig,
    check_output_file,
    check_positive,
    report_error,
    warn,
)
from engine.config_flags import add_dataclass_args, from_args
from engine.control import StaticController
from engine.errors import InputError
from engine.inputs import EngineConfig
from engine.lookup import describe_lookup, resolve_lookup
from policies.selection import (
    DEFAULT_POLICY,
    SERVE_KEYWORDS,
    PolicyChoice,
    Selection,
    check_policy,
    parse_policy,
    read_policy_table,
    select_controller,
)
from serving.worker import off_main_thread

GRACE_S = 120
"""After a signal, how long the server waits for the requests in flight to finish, then for their responses to
be sent (each wait at most this long)."""


@dataclass
class ServeConfig(ModelConfig):
    """The server: the pair (``ModelConfig``), where it listens, how each request is controlled, the batch."""

    host: str = "127.0.0.1"
    """Address to listen on (loopback by default)."""
    port: int = 8000
    """TCP port."""
    served_model_name: str = "draftpilot"
    """The model name clients send and /v1/models lists (the pair's name is accepted too)."""
    policy: str = "auto"
    """Every request's controller: an exported policy file; "auto": runs/main/policy.pt when it exists, else
    the static setting (--depth/--verify); "none": the static setting; "analytic": the analytic controller
    given the load, costed with --profile (at --tree-width), else with the settings of the trained policy
    runs/main/policy.pt (its cost profile, tree width, depth cap, and lookup under --lookup auto), as the
    main job's analytic baseline ran; "analytic:FILE": with those of the policy file FILE; "table:FILE": a
    chain of the depth a per-batch-size table FILE gives the requests in the step (vLLM's
    num_speculative_tokens_per_batch_size JSON; train.py writes the per-load baseline's as
    runs/NAME/tuned_batch_size_table.json); "goodput" (or "goodput:FILE"): the goodput controller
    (policies.goodput: each request's draft length from its own acceptance and the step's cost at the load),
    costed as "analytic" is."""
    profile: str | None = None
    """Cost profile JSON (python -m engine.costs.measure_costs --batch-axis --out FILE) that --policy analytic
    and --policy goodput cost their choices with."""
    autoregressive: bool = False
    """No speculation: every request decodes autoregressively (lookup cycles only, with --lookup)."""
    depth: int = 1
    """Static draft depth (without a policy)."""
    verify: int | None = None
    """Static nodes to verify (none: the depth)."""
    tree_width: int = 1
    """Static drafting: 1 drafts a chain, k > 1 a tree of width k."""
    lookup: str = "auto"
    """Context lookup drafting: "auto" (the policy's trained setting with its load limit, else off), "off", "on",
    or MIN-MAX:K[+L:J] as in generate.py; a suffix @N looks up only while at most N requests decode in a step."""
    draft_mode: str = "deterministic"
    """deterministic (top-k trees, argmax chains) or sampled (chains drawn from the draft)."""
    max_requests: int = 8
    """Requests decoded together at most; more wait for a slot."""
    max_rows: int = 64
    """Rows of one forward at most (every request's row plus the drafted nodes they verify)."""
    max_prefill_tokens: int = BatchConfig.max_prefill_tokens
    """Prompt tokens prefilled a step at most: chunks of the waiting prompts ride in the step's forward next
    to the running requests' rows (whole prompts, at least one a step, where the native decoder does not
    run), so a long prompt or a burst of arrivals delays each running stream a bounded time a step."""
    idle_prefill_tokens: int = BatchConfig.idle_prefill_tokens
    """Prompt tokens prefilled a step while no request decodes: the budget follows the load, from this when
    none decodes down to --max-prefill-tokens when many do (max(--max-prefill-tokens, min(this, 65 // d)) with
    d requests decoding), so a lone long prompt runs at the prefill's full speed and a busy server's streams
    wait a bounded time a step. At most --max-prefill-tokens: a fixed budget."""
    prefix_cache: bool = True
    """Keep the KV of earlier prompts and answers (target and draft) and compute only the rest of a prompt that
    starts with one of them (``engine.prefix_cache``); --no-prefix-cache computes every prompt in full."""
    prefix_cache_memory: str = "auto"
    """Bytes the prefix cache may hold, as a size (2GiB, 512MiB); "auto": the whole --kv-memory budget (the
    cache holds what the requests' reservations leave and gives way to them, least recently used first), or
    2GiB when --kv-memory is off; "off": as --no-prefix-cache."""
    max_waiting: int = 64
    """Requests waiting for a slot at most; past it a request gets HTTP 429."""
    max_context: int = 4096
    """Prompt plus generated tokens of one request at most (a longer request gets HTTP 400)."""
    kv_memory: str = "auto"
    """KV cache memory the requests in flight may reserve together, as a size (2GiB, 512MiB, 1e9: bytes);
    each request reserves what prompt + max_tokens can reach at admission, one that does not fit waits for
    memory, one past the whole budget gets HTTP 400. "auto": half the memory available once the pair has
    loaded (so the weights are already out of it): MemAvailable of /proc/meminfo (psutil's available where
    there is no /proc), on CUDA half the device's free memory; "off": no bound."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Request body size at most, in bytes; a larger body gets HTTP 413 before it is parsed."""
    log_level: str = "info"
    """uvicorn's log level (critical, error, warning, info, debug)."""
    api_key: str | None = None
    """API key every /v1/* request must give as "Authorization: Bearer KEY"; several: comma-separated or the
    flag repeated (the environment variable DRAFTPILOT_API_KEY adds more, likewise)."""
    api_key_file: str | None = None
    """A file of API keys, one a line (blank lines and lines starting with # skipped)."""
    allow_unauthenticated: bool = False
    """Listen on a non-loopback --host without an API key (refused otherwise)."""
    step_log: str | None = None
    """Write every batched step to this file, one JSON line each (its prefill chunks, each request's cycle,
    rows, contexts and seconds: serving/step_log.py), to fit or check the batch cost model and the server replay
    against the live server."""
    metrics_auth: bool = False
    """With API keys, /metrics needs one too (open by default, as vLLM's; /health is always open)."""
    allowed_hosts: str | None = None
    """Host header names the server answers to, comma-separated ("*.example.com": its subdomains; "*": any);
    others get HTTP 400, a guard against DNS rebinding. Default: localhost, 127.0.0.1, ::1 and --host."""
    api_docs: bool = False
    """Serve the interactive API pages (/docs, /redoc, /openapi.json)."""
    header_timeout: float = 10.0
    """Seconds a connection has to send a whole request header, from its opening or its previous response;
    then it is closed."""
    body_timeout: float = 30.0
    """Seconds a request body has to arrive whole after its header (HTTP 408 past it)."""
    max_connections: int = 256
    """Open connections served at most; the request of a connection past it gets HTTP 503 and the connection
    is closed."""


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python serve.py", description=__doc__)
    add_dataclass_args(ap, ServeConfig)
    return ap


def policy_choice(config: ServeConfig) -> PolicyChoice:
    """What ``--policy`` names (``policies.selection``: serve.py reads its keywords)."""
    return parse_policy(config.policy, keywords=SERVE_KEYWORDS)


def read_table(config: ServeConfig) -> dict[int, int]:
    """``--policy table:FILE``'s table, checked as vLLM checks it: the first batch size of each range -> its
    depth (a gap or the sizes past the last range keep the previous depth)."""
    return read_policy_table(policy_choice(config))


def controller_factory(config: ServeConfig, pair) -> Selection:
    """(a callable giving each request a fresh controller, its description, the policy's trained lookup)."""
    device = "cpu" if pair.device.type == "cpu" else pair.device
    return select_controller(
        policy_choice(config),
        lambda: StaticController(depth=config.depth, verify=config.verify, tree_width=config.tree_width),
        autoregressive=config.autoregressive,
        tree_width=config.tree_width,
        profile=config.profile,
        default_policy=DEFAULT_POLICY,
        pair=pair,
        device=device,
    )


SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12})


def parse_size(text: str, flag: str = "--kv-memory") -> int:
    """Bytes of a size such as ``2GiB``, ``512MiB``, ``1.5G``, ``1e9`` (a bare number: bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in SIZE_UNITS or float(match.group(1)) * SIZE_UNITS[unit] < 1:
        raise InputError(
            f"{flag} must be a size such as 2GiB, 512MiB or 1e9 (bytes), auto or off; got {text!r}"
        )
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def available_memory(device) -> int | None:
    """Bytes free for new allocations on ``device`` now (CUDA: the device's free memory; else MemAvailable
    of /proc/meminfo, or psutil's available), None when it cannot be told."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def kv_budget(config: ServeConfig, pair) -> int | None:
    """``--kv-memory`` in bytes (None: "off", or "auto" where the free memory cannot be told)."""
    value = config.kv_memory.strip().lower()
    if value == "off":
        return None
    if value != "auto":
        return parse_size(config.kv_memory)
    free = available_memory(pair.device)
    if free is None:
        warn("--kv-memory auto: the free memory cannot be told here; the KV cache is not bounded")
        return None
    return max(free // 2, 1)


AUTO_PREFIX_CACHE_BYTES = 2 * 1024**3
"""``--prefix-cache-memory auto`` where the KV cache has no budget (``--kv-memory off``)."""


def prefix_cache_bytes(config: ServeConfig, kv_bytes: int | None) -> int:
    """The prefix cache's size in bytes (0: off): ``--no-prefix-cache``, ``--prefix-cache-memory``."""
    if not config.prefix_cache:
        return 0
    value = config.prefix_cache_memory.strip().lower()
    if value == "off":
        return 0
    if value != "auto":
        return parse_size(config.prefix_cache_memory, "--prefix-cache-memory")
    return kv_bytes if kv_bytes is not None else AUTO_PREFIX_CACHE_BYTES


def build_state(config: ServeConfig, pair=None):
    """The server's state for ``config`` (loads the pair unless given): worker not started yet."""
    from serving.faults import FAULTS_ENV, faulty_engine_factory
    from serving.metrics import ServerMetrics
    from serving.state import ServerState
    from serving.worker import EngineWorker

    pair = pair if pair is not None else config.load()
    make, described, trained = controller_factory(config, pair)
    lookup = resolve_lookup(config.lookup, trained)
    kv_bytes = kv_budget(config, pair)
    batch = BatchConfig(
        max_requests=config.max_requests,
        max_rows=config.max_rows,
        max_prefill_tokens=config.max_prefill_tokens,
        idle_prefill_tokens=config.idle_prefill_tokens,
        engine=EngineConfig(draft_mode=config.draft_mode, lookup=lookup),
        max_kv_bytes=kv_bytes,
        prefix_cache_bytes=prefix_cache_bytes(config, kv_bytes),
    )
    metrics = ServerMetrics()
    factory = BatchedEngine
    if os.environ.get(FAULTS_ENV):  # the tests' fault injection (serving/faults.py), never set otherwise
        factory = faulty_engine_factory(os.environ[FAULTS_ENV])
        warn(f"{FAULTS_ENV} is set: injecting faults into marked requests (a test facility)")
    worker = EngineWorker(
        pair, batch, max_waiting=config.max_waiting, on_step=metrics.on_step, engine_factory=factory
    )
    if config.step_log is not None:
        from serving.step_log import StepLog

        log = StepLog(config.step_log)

        def on_step(requests: int, seconds: float, events: list) -> None:
            metrics.on_step(requests, seconds, events)
            log.record(worker.engine, seconds, events)

        worker.on_step = on_step
    names = tuple(dict.fromkeys([config.served_model_name, pair.name]))
    description = {
        "model": config.served_model_name,
        "pair": pair.name,
        "weights": pair.precision,
        "device": str(pair.device),
        "controller": described,
        "lookup": describe_lookup(lookup),
        "max_requests": config.max_requests,
        "max_rows": config.max_rows,
        "max_prefill_tokens": config.max_prefill_tokens,
        "idle_prefill_tokens": config.idle_prefill_tokens,
        "max_context": min(config.max_context, pair.max_context),  # the bound enforced
        "kv_budget_bytes": batch.max_kv_bytes,
        "prefix_cache_max_bytes": batch.prefix_cache_bytes,
    }
    return ServerState(
        pair,
        worker,
        metrics,
        names,
        make,
        description["max_context"],
        description,
        max_body_bytes=config.max_body_bytes,
        body_timeout_s=config.body_timeout,
        allowed_hosts=allowed_hosts(config),
        api_keys=api_keys(config),
        metrics_auth=config.metrics_auth,
        api_docs=config.api_docs,
    )


API_KEY_ENV = "DRAFTPILOT_API_KEY"
"""Environment variable of more API keys (comma-separated), next to --api-key and --api-key-file."""


def api_keys(config: ServeConfig) -> tuple[str, ...]:
    """Every API key the server accepts: --api-key (comma-separated), DRAFTPILOT_API_KEY, --api-key-file."""
    keys = (config.api_key or "").split(",") + os.environ.get(API_KEY_ENV, "").split(",")
    if config.api_key_file is not None:
        try:
            with open(config.api_key_file, encoding="utf-8") as f:
                keys += [line for line in f.read().splitlines() if not line.lstrip().startswith("#")]
        except (OSError, UnicodeDecodeError) as err:
            raise InputError(f"--api-key-file: cannot read {config.api_key_file}: {err}") from None
    keys = [k.strip() for k in keys if k.strip()]
    if any(any(c.isspace() for c in k) or not k.isprintable() for k in keys):
        raise InputError("an API key must be printable and hold no spaces")
    return tuple(dict.fromkeys(keys))


def allowed_hosts(config: ServeConfig) -> tuple[str, ...] | None:
    """The Host header names the server answers to (None: any)."""
    from serving.access import LOOPBACK_HOSTS, host_name

    if config.allowed_hosts is not None:
        names = tuple(dict.fromkeys(host_name(h) for h in config.allowed_hosts.split(",") if h.strip()))
        if not names:
            raise InputError("--allowed-hosts must name at least one host (or *)")
        return None if "*" in names else names
    extra = () if config.host in ("0.0.0.0", "::", "") else (host_name(config.host),)
    return tuple(dict.fromkeys(LOOPBACK_HOSTS + extra))


def check(config: ServeConfig) -> ServeConfig:
    """Everything checkable before the pair loads."""
    check_positive(
        port=config.port,
        max_requests=config.max_requests,
        max_rows=config.max_rows,
        max_prefill_tokens=config.max_prefill_tokens,
        idle_prefill_tokens=config.idle_prefill_tokens,
        max_waiting=config.max_waiting,
        max_context=config.max_context,
        max_body_bytes=config.max_body_bytes,
        max_connections=config.max_connections,
        depth=config.depth,
        tree_width=config.tree_width,
    )
    if config.port > 65535:
        raise InputError(f"--port must be in [1, 65535], got {config.port}")
    if config.max_rows < config.max_requests:
        raise InputError(f"--max-rows ({config.max_rows}) must be >= --max-requests ({config.max_requests})")
    if config.log_level not in ("critical", "error", "warning", "info", "debug"):
        raise InputError(
            f"--log-level must be critical, error, warning, info or debug, got {config.log_level!r}"
        )
    if config.kv_memory.strip().lower() not in ("auto", "off"):
        parse_size(config.kv_memory)
    if config.prefix_cache_memory.strip().lower() not in ("auto", "off"):
        if not config.prefix_cache:
            raise InputError("--prefix-cache-memory sizes the prefix cache that --no-prefix-cache turns off")
        parse_size(config.prefix_cache_memory, "--prefix-cache-memory")
    if config.step_log is not None:
        check_output_file(config.step_log, "--step-log")
    check_policy(policy_choice(config), config.profile, DEFAULT_POLICY)
    resolve_lookup(config.lookup)
    for name in ("header_timeout", "body_timeout"):
        value = getattr(config, name)
        if not value > 0 or value == float("inf"):
            raise InputError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {value}")
    from serving.access import is_loopback

    keys = api_keys(config)
    allowed_hosts(config)  # checked before the pair loads
    if not keys and not is_loopback(config.host) and not config.allow_unauthenticated:
        raise InputError(
            f"--host {config.host} is reachable from other machines and no API key is set: give --api-key "
            f"(or --api-key-file, or {API_KEY_ENV}), or --allow-unauthenticated to serve anyone"
        )
    if config.metrics_auth and not keys:
        raise InputError("--metrics-auth needs an API key (--api-key, --api-key-file or DRAFTPILOT_API_KEY)")
    config.check()
    return config


def merge_repeated(argv: list[str], flag: str = "--api-key") -> list[str]:
    """``argv`` with every ``flag VALUE`` / ``flag=VALUE`` joined into one, comma-separated: the flag may be
    repeated (argparse would keep the last one alone)."""
    values, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1 :])
        else:
            rest.append(arg)
        i += 1
    return rest + ([flag, ",".join(values)] if values else [])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(merge_repeated(argv))
    try:
        config = check(from_args(ServeConfig, args))
        from serving.access import is_loopback

        if not is_loopback(config.host) and not api_keys(config):
            warn(
                f"listening on {config.host} without authentication (--allow-unauthenticated): anyone may use it"
            )
        if config.host in ("0.0.0.0", "::") and config.allowed_hosts is None:
            warn(
                f"--host {config.host}: the server answers only to the Host names localhost, 127.0.0.1 and ::1; "
                "give the names clients reach it by with --allowed-hosts"
            )
        state = off_main_thread(build_state, config)  # the main thread forks no OpenMP team
    except CLI_ERRORS as err:
        return report_error(err)
    import uvicorn
    from sse_starlette.sse import AppStatus

    from serving.app import create_app

    # in-flight streams end by themselves once the worker drains (Server.handle_exit below), not at the signal
    AppStatus.disable_automatic_graceful_drain()
    app = create_app(state)

    class Server(uvicorn.Server):
        """uvicorn's server, drained at a signal: it keeps listening (``/health`` and new requests answer
        503) until the engine thread has finished every request in flight and no response is still being
        sent, then shuts down as uvicorn does (it stops listening, closes the idle connections)."""

        draining_since: float | None = None

        def handle_exit(self, sig, frame):
            # uvicorn.Server.handle_exit, less its record of the signal: uvicorn re-raises a recorded signal once
            # it has shut down, so a drained server would die of its SIGTERM (exit -15) or end on a
            # KeyboardInterrupt traceback; the drain is the shutdown the signal asked for, so main returns 0
            if self.draining_since is None:
                state.worker.drain()  # new requests get 503 at once; those in flight finish
                self.draining_since = time.monotonic()
            elif sig == signal.SIGINT:  # a second Ctrl-C: stop waiting for the requests in flight
                self.should_exit = self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.draining_since is not None:
                if state.closing is not None:
                    state.closing.set()  # request bodies still arriving: 503 at once (serving.app.BodyLimit)
                drained = state.worker.join(0) and not self.server_state.tasks  # no request being served
                if drained or time.monotonic() - self.draining_since > GRACE_S:
                    self.should_exit = True
            return await super().on_tick(counter)

    from serving.access import connection_protocol

    def refused(status: int) -> None:
        state.metrics.errors.labels(str(status)).inc()

    protocol = connection_protocol(config.header_timeout, config.max_connections, refused)
    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=GRACE_S,
        http=protocol,
    )
    d = state.description
    batch_budget = d["kv_budget_bytes"]
    print(
        f"serving {d['model']} ({d['pair']}, {d['weights']}, {d['device']}) on http://{config.host}:{config.port}/v1 "
        f"controller={d['controller']} lookup={d['lookup']} max_requests={config.max_requests} "
        f"kv_memory={'unbounded' if batch_budget is None else format_bytes(batch_budget)} "
        f"prefix_cache={format_bytes(d['prefix_cache_max_bytes']) if d['prefix_cache_max_bytes'] else 'off'}",
        flush=True,
    )
    hosts = "any host" if state.allowed_hosts is None else ", ".join(state.allowed_hosts)
    keys = f"{len(state.api_keys)} API key(s) on /v1/*" + (" and /metrics" if state.metrics_auth else "")
    print(
        f"access: {keys if state.api_keys else 'no API key'}; Host header: {hosts}; "
        f"API pages {'on' if state.api_docs else 'off'}; header timeout {config.header_timeout:g} s, "
        f"body timeout {config.body_timeout:g} s, {config.max_connections} connections at most",
        flush=True,
    )
    Server(uv).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
