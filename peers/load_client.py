"""A streaming load client of OpenAI-compatible servers (``benchmarks/serve_load.py``; httpx, a development
dependency): one server under test (``Row``), one streamed request timed chunk by chunk (``one_request``,
``latencies``), closed-loop clients, Poisson arrivals at a rate or a schedule of rates, a long prompt among short
streams, and each level's figures (``summarize``; ``medians`` over repeats). Nothing on the server's path imports
it."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class Row:
    name: str
    command: list[str]
    extra_body: dict = field(default_factory=dict)
    """Fields every request adds (ours: continuous usage, token ids)."""
    weights: str = ""
    """The weight format the row's server runs."""
    env: dict = field(default_factory=dict)
    """Environment variables the server gets (vLLM's threads and KV cache space)."""


@dataclass
class Outcome:
    prompt: int
    ok: bool
    text: str = ""
    tokens: int = 0
    ttft: float = float("nan")
    latency: float = float("nan")
    itl: list[float] = field(default_factory=list)
    error: str = ""
    start: float = float("nan")
    """When it was sent (``time.perf_counter``)."""
    times: list[float] = field(default_factory=list)
    """When each of its chunks arrived (``time.perf_counter``)."""


def request_body(row: Row, ids: list[int], max_tokens: int) -> dict:
    """A benchmark request: the token-id prompt, greedy, streamed with usage, ``max_tokens`` past EOS, the row's
    extra fields."""
    return {
        "model": "draftpilot",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **row.extra_body,
    }


async def one_request(client: httpx.AsyncClient, url: str, row: Row, prompt_index: int, ids: list[int], max_tokens: int) -> Outcome:  # fmt: skip
    body = request_body(row, ids, max_tokens)
    start = time.perf_counter()
    out = Outcome(prompt_index, False, start=start)
    arrivals, parts, counted, usage_total = [], [], 0, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return out
                usage = chunk.get("usage")
                choices = chunk.get("choices") or []
                if not choices:
                    if usage:
                        usage_total = usage.get("completion_tokens")
                    continue
                text = choices[0].get("text") or ""
                if choices[0].get("token_ids") is not None:  # return_token_ids: the chunk's tokens
                    k = len(choices[0]["token_ids"])
                elif usage and usage.get("completion_tokens") is not None:
                    k = usage["completion_tokens"] - counted
                else:
                    k = 1 if (text or choices[0].get("finish_reason") is None) else 0
                if k <= 0:
                    parts.append(text)
                    continue
                arrivals.append((time.perf_counter() - start, k))
                out.times.append(start + arrivals[-1][0])
                counted += k
                parts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        out.error = f"{type(err).__name__}: {err}"
        return out
    out.latency = time.perf_counter() - start
    out.ttft, out.itl = latencies(arrivals)
    out.text, out.tokens, out.ok = "".join(parts), usage_total if usage_total is not None else counted, True
    return out


BURST_S = 0.003
"""Chunks arriving within this of the previous one belong to the same step (llama-server sends a cycle's
tokens as one chunk each, ours as one chunk): they are counted as one arrival of several tokens."""


def latencies(arrivals: list[tuple[float, int]]) -> tuple[float, list[float]]:
    """(time to first token, inter-token latencies) from (seconds since the request, tokens) per chunk: an
    arrival of k tokens T after the previous one counts k samples of T / k."""
    if not arrivals:
        return float("nan"), []
    groups: list[list[float]] = []
    for t, k in arrivals:
        if groups and t - groups[-1][0] < BURST_S:
            groups[-1] = [t, groups[-1][1] + k]
        else:
            groups.append([t, k])
    itl = []
    for (t0, _), (t1, k) in zip(groups, groups[1:]):
        itl.extend([(t1 - t0) / k] * int(k))
    return arrivals[0][0], itl


async def closed_loop(
    url: str, row: Row, prompts: list[list[int]], clients: int, requests: int, max_tokens: int
):
    order = [i % len(prompts) for i in range(requests)]
    queue = list(enumerate(order))
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker():
            while queue:
                _, p = queue.pop(0)
                outcomes.append(await one_request(client, url, row, p, prompts[p], max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    return outcomes, wall


async def long_mix(
    url: str,
    row: Row,
    prompts: list[list[int]],
    long_ids: list[int],
    clients: int,
    max_tokens: int,
    delay: float,
):
    """``clients`` short streams in a closed loop and, ``delay`` seconds in, one long prompt (8 tokens to
    generate); the streams go on until it has finished. Returns (short outcomes, the long one, wall time)."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        done = asyncio.Event()

        async def worker(k: int):
            i = k
            while not done.is_set():
                p = i % len(prompts)
                outcomes.append(await one_request(client, url, row, p, prompts[p], max_tokens))
                i += clients

        async def long_request():
            await asyncio.sleep(delay)
            out = await one_request(client, url, row, -1, long_ids, 8)
            done.set()
            return out

        start = time.perf_counter()
        results = await asyncio.gather(long_request(), *(worker(k) for k in range(clients)))
        wall = time.perf_counter() - start
    return outcomes, results[0], wall


def long_mix_figures(short: list[Outcome], long: Outcome) -> dict:
    """While the long prompt waited for its first token (from its sending to its first chunk): the running short
    streams' largest wait between two of their chunks, against their median inter-token latency over the run,
    and the largest time to first token of a short request that waited then; the long prompt's own time to
    first token."""
    end = long.start + long.ttft if long.ok else float("nan")
    gaps, ttfts = [], []
    for o in short:
        for a, b in zip(o.times, o.times[1:]):
            if b > long.start and a < end:  # a wait that overlaps the long prefill
                gaps.append(b - a)
        if o.ok and o.start < end and o.start + o.ttft > long.start:
            ttfts.append(o.ttft)
    itl = [x for o in short if o.ok for x in o.itl]
    median = percentile(itl, 0.5)
    largest = max(gaps, default=float("nan"))
    return {
        "long_ok": long.ok,
        "long_error": long.error,
        "long_ttft_s": long.ttft,
        "gap_max_s": largest,
        "gap_over_itl_p50": largest / median if median > 0 else float("nan"),
        "short_ttft_max_s": max(ttfts, default=float("nan")),
    }


def parse_schedule(text: str) -> list[tuple[float, int]]:
    """``--rate-schedule`` "R1:N1,R2:N2,...": (requests/s, requests arriving at that rate), in order."""
    schedule = []
    for part in text.split(","):
        rate, colon, count = part.strip().partition(":")
        try:
            r, n = float(rate), int(count)
        except ValueError:
            r, n = math.nan, 0
        if not colon or not (math.isfinite(r) and r > 0) or n < 1:
            raise ValueError(
                "--rate-schedule: each entry is RATE:REQUESTS (requests/s > 0, an integer >= 1), "
                f"got {part.strip()!r}"
            )
        schedule.append((r, n))
    return schedule


def schedule_label(schedule: list[tuple[float, int]]) -> str:
    return ",".join(f"{r:g}:{n}" for r, n in schedule)


def arrival_times(schedule: list[tuple[float, int]], seed: int) -> list[float]:
    """Seconds from the start at which each request of a Poisson run arrives: the first at 0, each next one an
    exponential gap later, drawn (one seeded generator) at the rate of the schedule's piece it belongs to."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for i, rate in enumerate(r for r, n in schedule for _ in range(n)):
        if i:
            now += rng.expovariate(rate)
        times.append(now)
    return times


async def poisson(url: str, row: Row, prompts: list[list[int]], schedule: list[tuple[float, int]], max_tokens: int, seed: int):  # fmt: skip
    """A Poisson run of ``schedule`` (one rate: ``[(rate, requests)]``); (outcomes, wall time from the first
    arrival to the last request's end)."""
    times = arrival_times(schedule, seed)
    limits = httpx.Limits(max_connections=len(times) + 4, max_keepalive_connections=len(times) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for i, at in enumerate(times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            p = i % len(prompts)
            tasks.append(asyncio.create_task(one_request(client, url, row, p, prompts[p], max_tokens)))
        outcomes = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return list(outcomes), wall


def summarize(outcomes: list[Outcome], wall: float, reference: dict[int, str]) -> dict:
    good = [o for o in outcomes if o.ok]
    itl = [x for o in good for x in o.itl]
    same = [o.text == reference[o.prompt] for o in good if o.prompt in reference]
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(good),
        "first_error": next((o.error for o in outcomes if not o.ok), ""),
        "tokens": sum(o.tokens for o in good),
        "wall_s": wall,
        "tok_s": sum(o.tokens for o in good) / wall if wall > 0 else float("nan"),
        **{f"ttft_p{q}": percentile([o.ttft for o in good], q / 100) for q in (50, 90, 99)},
        **{f"itl_p{q}": percentile(itl, q / 100) for q in (50, 90, 99)},
        **{f"latency_p{q}": percentile([o.latency for o in good], q / 100) for q in (50, 99)},
        "identical": (sum(same) / len(same)) if same else float("nan"),
        # one request's decoding rate after its first token (the figure batch-one benchmarks report)
        "decode_tok_s": statistics.median(
            [(o.tokens - 1) / (o.latency - o.ttft) for o in good if o.tokens > 1 and o.latency > o.ttft]
            or [float("nan")]
        ),
    }


def medians(results: list[dict]) -> list[dict]:
    keys = sorted({(r["row"], r["mode"], r["level"]) for r in results}, key=lambda k: (k[1], k[0], k[2]))
    out = []
    for row, mode, level in keys:
        group = [r for r in results if (r["row"], r["mode"], r["level"]) == (row, mode, level)]
        entry = {"row": row, "mode": mode, "level": level, "repeats": len(group)}
        entry["weights"] = group[0].get("weights", "")
        for key, value in group[0].items():
            if isinstance(value, (int, float)) and key not in ("repeat", "level"):
                entry[key] = statistics.median(g[key] for g in group)
        entry["errors"] = sum(g["errors"] for g in group)
        entry["identical"] = min(g["identical"] for g in group)
        out.append(entry)
    return out
