"""The server's Prometheus metrics (``prometheus_client``), served at ``/metrics`` in the text format every
Prometheus-compatible scraper reads (vLLM and llama-server expose theirs the same way).

One registry per server (tests start several in one process). Latencies are measured where the client sees
them: time to first token from the request's arrival, inter-token latency amortised over the tokens a step
commits together (a step that commits n tokens after a gap T counts n samples of T / n, as
``engine.results.summarize`` does for one request).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60)
TOKEN_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "draftpilot_"
        self.requests = Counter(
            p + "requests", "Requests that ended, by finish reason", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            p + "request_errors", "Requests answered with an error, by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Gap between tokens, amortised per step",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            p + "request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            p + "queue_time_seconds",
            "Arrival to admission into the batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.accepted = Histogram(
            p + "accepted_tokens_per_cycle",
            "Drafted tokens accepted by a drafting or lookup cycle",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.cycles = Counter(
            p + "cycles", "Cycles by kind (draft, lookup, autoregressive)", ["kind"], registry=r
        )
        self.batch = Histogram(
            p + "batch_requests",
            "Requests in one batched step",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.step = Histogram(
            p + "step_seconds", "Wall time of one batched step", buckets=LATENCY_BUCKETS, registry=r
        )
        self.running = Gauge(p + "requests_running", "Requests in the batch", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests waiting for a slot", registry=r)
        self.kv_reserved = Gauge(
            p + "kv_cache_reserved_bytes", "KV cache bytes the admitted requests reserve", registry=r
        )
        self.kv_allocated = Gauge(
            p + "kv_cache_allocated_bytes", "KV cache bytes the admitted requests' caches hold", registry=r
        )
        self.kv_budget = Gauge(
            p + "kv_cache_budget_bytes",
            "KV cache bytes the requests may reserve (--kv-memory; 0: no bound)",
            registry=r,
        )

        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens the prefix cache gave (the target's KV)", registry=r
        )
        self.prefix_draft_hits = Counter(
            p + "prefix_cache_draft_hits",
            "Prompt tokens of the draft's prefill the prefix cache gave",
            registry=r,
        )
        self.prefix_requests = Counter(
            p + "prefix_cache_requests", "Requests whose prompt was looked up in the prefix cache", registry=r
        )
        self.prefix_evictions = Counter(
            p + "prefix_cache_evictions", "Entries (runs of tokens) evicted from the prefix cache", registry=r
        )
        self.prefix_bytes = Gauge(p + "prefix_cache_bytes", "Bytes the prefix cache holds", registry=r)
        self.prefix_max_bytes = Gauge(
            p + "prefix_cache_max_bytes", "Bytes the prefix cache may hold (0: no prefix cache)", registry=r
        )
        self._prefix_seen: dict[str, int] = {}

    def prefix_cache(self, figures: dict[str, int]) -> None:
        """Bring the prefix-cache series up to ``figures`` (``EngineWorker.prefix``: the engine's running totals;
        a rebuilt engine starts them at 0 again, so a total below the last one seen counts from 0)."""
        counters = {
            "query_tokens": self.prefix_queries,
            "hit_tokens": self.prefix_hits,
            "draft_hit_tokens": self.prefix_draft_hits,
            "queries": self.prefix_requests,
            "evictions": self.prefix_evictions,
        }
        for name, counter in counters.items():
            now = figures.get(name, 0)
            last = self._prefix_seen.get(name, 0)
            counter.inc(now - last if now >= last else now)
            self._prefix_seen[name] = now
        self.prefix_bytes.set(figures.get("bytes", 0))
        self.prefix_max_bytes.set(figures.get("max_bytes", 0))

    def on_step(self, requests: int, seconds: float, events: list) -> None:
        """Engine-thread hook of ``EngineWorker``: one batched step."""
        self.batch.observe(requests)
        self.step.observe(seconds)
        for event in events:
            record = event.record
            if record is None:
                continue
            kind = "lookup" if record.lookup else ("draft" if record.depth > 0 else "autoregressive")
            self.cycles.labels(kind).inc()
            if record.num_verified > 0:
                self.accepted.observe(record.accepted)

    def text(self) -> bytes:
        return generate_latest(self.registry)
