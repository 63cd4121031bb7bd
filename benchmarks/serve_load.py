"""Load benchmark: our server (serve.py), llama.cpp's llama-server and vLLM's OpenAI server under the same
load, same threads, same prompt tokens (ours and llama-server on the same GGUF files; vLLM on the float32
checkpoints dequantised from them: the weight format of every row is recorded with it).

Every row is a server started for the row and stopped after it:

* ``ours <name>``: ``serve.py`` with the row's flags (``--ours NAME=FLAGS``, e.g.
  ``--ours "ar=--autoregressive" --ours "static=--policy none --depth 1"``);
* ``llama <name>``: ``llama-server`` (``-np`` slots, continuous batching) autoregressive, with the draft
  model (``--draft-max``), and with its n-gram lookup (``--spec-type ngram-simple``), as separate rows;
* ``vllm <name>`` (``--vllm ar,draft-K,table,lookup``, none by default): vLLM's OpenAI server from its own
  environment (serving/vllm_peer.py, docs/vllm.md) autoregressive, with the draft model at a fixed
  ``num_speculative_tokens`` K, with a per-batch-size table (``--vllm-table FILE``, written by
  ``serving.vllm_peer.write_batch_size_table``), and with the engine's context lookup as vLLM's custom
  proposer (``--vllm-lookup SETTING``, serving/vllm_lookup.py); in float32 or ``--vllm-dtype bfloat16``;
  the rows are skipped with one line where vLLM is absent.

Each row runs the closed-loop levels (N clients, each sending its next request when the last one ended; N in
``--concurrency``; 2N requests, at least ``--min-requests``), the Poisson levels (requests arriving at
``--rates`` per second, ``--poisson-requests`` of them) and, with ``--rate-schedule R1:N1,R2:N2,...``, one
Poisson level whose rate changes during the run (N1 requests arriving at R1 per second, then N2 at R2, ...;
mode ``poisson-schedule``, its level the schedule). Poisson arrivals are seeded (the repeat's index): the
first request at once, each next one an exponential gap later at its own rate. Requests are /v1/completions with the chat-templated
prompt as token ids (both servers read token-id prompts, so both see the same tokens), greedy, streaming,
``max_tokens`` with ``ignore_eos`` (both servers honour it: every request does the same work), and
llama-server's prompt cache off (``cache_prompt: false``: our server has no prefix cache, and the
benchmark repeats its prompts, which llama-server would otherwise not prefill again). Rows are
interleaved and the whole set repeated ``--repeats`` times in rotated order, so drift hits all rows alike.

Per row and level: aggregate tokens/s (completion tokens over the level's wall time), TTFT, inter-token
latency (an arrival of k tokens after a gap T counts k samples of T / k; chunks within ``BURST_S`` of each
other are one arrival) and request latency percentiles, the
server's peak resident memory (``VmHWM``), and greedy identity: the share of requests whose text equals the
same prompt's text at concurrency 1 in the same row (a batch-invariant server gives 100%).

    python benchmarks/serve_load.py --pair tiny --ours "ar=--autoregressive" --no-llama --concurrency 1,4 --max-tokens 16
    python benchmarks/serve_load.py --json runs/serve_load.json --plot runs/serve_load.png
    python benchmarks/serve_load.py --no-llama --ours "ar=--autoregressive" --vllm ar,draft-2,table --json runs/vllm.json
    python benchmarks/serve_load.py --no-llama --ours "analytic=--policy analytic --lookup on" --rate-schedule 0.1:6,0.6:12,0.1:6

Prints one line per row and level and, with --json, writes every figure with the machine's conditions (CPU,
threads, load averages). Never run it while another heavy job runs: the figures would measure contention.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

from engine.cli import ArgumentParser
from engine.costs.measure_costs import device_name
from envs.prompts import interleave_languages, load_suite
from evaluation.llama_cpp_build import default_bin_dir, find_server
from serving import vllm_peer
from serving.launch import ServerProcess, free_port, peak_rss_mb, prompt_ids

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OURS = ("ar=--autoregressive", "static=--policy none --depth 1 --lookup on")
DEFAULT_VLLM_TABLE = {(1, 1): 3, (2, 4): 2, (5, 1024): 1}
"""The table of the ``vllm table`` row without ``--vllm-table``: longer drafts when the batch is small."""
OURS_WEIGHTS = "GGUF blocks as stored (kquant target, kquant-strict draft: engine/models.py)"
LLAMA_WEIGHTS = "GGUF Q4_K/Q6_K blocks as stored (same files)"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# ------------------------------------------------------------------------------------------- servers
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


# ----------------------------------------------------------------------------------------------- load
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


async def one_request(client: httpx.AsyncClient, url: str, row: Row, prompt_index: int, ids: list[int], max_tokens: int) -> Outcome:  # fmt: skip
    body = {
        "model": "draftpilot",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **row.extra_body,
    }
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


# ----------------------------------------------------------------------------------------------- main
def conditions(threads: int) -> dict:
    cpu = "unknown"
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "device": device_name(torch.device("cpu")),
        "threads": threads,
        "loadavg": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def build_rows(
    args, target_gguf: Path | None, draft_gguf: Path | None, llama_server: Path | None
) -> list[Row]:
    rows = []
    slots = max(args.concurrency)
    for spec in args.ours:
        name, _, flags = spec.partition("=")
        command = [
            sys.executable,
            str(ROOT / "serve.py"),
            "--pair",
            args.pair,
            "--threads",
            str(args.threads),
        ]
        command += ["--max-requests", str(slots), "--max-waiting", "1024", "--log-level", "warning"]
        rows.append(Row(f"ours {name}", command + flags.split(), {"return_token_ids": True}, OURS_WEIGHTS))
    if llama_server is not None:
        base = [str(llama_server), "-m", str(target_gguf), "--host", "127.0.0.1", "-t", str(args.threads)]
        base += [
            "-tb",
            str(args.threads),
            "-np",
            str(slots),
            "-c",
            str(slots * args.slot_context),
            "--no-webui",
        ]
        base += ["--temp", "0", "--top-k", "1", "--log-disable"]
        rows.append(Row("llama ar", base, {"cache_prompt": False}, LLAMA_WEIGHTS))
        for n in args.llama_draft_max:
            draft = ["-md", str(draft_gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", str(n)]
            draft += ["--spec-draft-n-min", "0", "--spec-draft-p-min", str(args.llama_p_min)]
            draft += ["-td", str(args.threads), "-tbd", str(args.threads)]
            rows.append(Row(f"llama spec n={n}", base + draft, {"cache_prompt": False}, LLAMA_WEIGHTS))
        if args.llama_ngram:
            ngram = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]
            ngram += ["--spec-ngram-simple-size-m", "8"]
            rows.append(Row("llama ngram", base + ngram, {"cache_prompt": False}, LLAMA_WEIGHTS))
    rows += vllm_rows(args, slots)
    return rows


def vllm_rows(args, slots: int) -> list[Row]:
    """The ``--vllm`` rows (``ar``, ``draft-K``, ``table``, ``lookup``), or none with one line saying why."""
    if not args.vllm:
        return []
    if args.pair != "qwen2.5-coder":
        print("skipped vllm rows: only the default pair has converted checkpoints", flush=True)
        return []
    python, why = vllm_peer.vllm_python(args.vllm_venv)
    if python is None:
        print(f"skipped vllm rows: {why}", flush=True)
        return []
    target, draft = vllm_peer.default_pair_dirs(args.pair)
    rows = []
    for name in args.vllm:
        options: dict = {}
        if name.startswith("draft-"):
            options = {"draft": draft, "k": int(name.split("-", 1)[1])}
        elif name == "table":
            table = args.vllm_table
            if table is None:
                table = vllm_peer.write_batch_size_table(
                    DEFAULT_VLLM_TABLE, ROOT / "runs" / "serve_load_logs" / "vllm_table.json"
                )
            options = {"draft": draft, "table": table}
        elif name == "lookup":
            options = {"lookup": args.vllm_lookup}
        elif name != "ar":
            raise SystemExit(f"error: --vllm: unknown row {name!r} (ar, draft-K, table, lookup)")
        argv, env = vllm_peer.vllm_command(
            python,
            target,
            threads=args.threads,
            max_num_seqs=slots,
            kv_cache_gib=args.vllm_kv_gib,
            dtype=args.vllm_dtype,
            **options,
        )
        weights = vllm_peer.weights(args.vllm_dtype)
        rows.append(Row(f"vllm {name}", argv, {"return_token_ids": True}, weights, env))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python benchmarks/serve_load.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--ours", action="append", help=f"NAME=FLAGS of serve.py (default: {DEFAULT_OURS})")
    ap.add_argument("--no-llama", action="store_true", help="no llama-server rows")
    ap.add_argument("--no-ours", action="store_true", help="no rows of our server (e.g. only --vllm rows)")
    ap.add_argument("--llama-bin", default=None, help="directory of llama-server (default: the build cache)")
    ap.add_argument("--llama-draft-max", default="4", help="llama spec rows: --draft-max values (comma list)")
    ap.add_argument("--llama-p-min", type=float, default=0.75)
    ap.add_argument("--llama-ngram", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--vllm",
        default="",
        help="vLLM rows: comma list of ar, draft-K (fixed K), table, lookup (none by default)",
    )
    ap.add_argument("--vllm-table", default=None, help="the vllm table row's file (write_batch_size_table)")
    ap.add_argument("--vllm-venv", default=None, help="vLLM's environment (default: $DRAFTPILOT_VLLM_VENV)")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="vLLM's KV cache space (GiB)")
    ap.add_argument(
        "--vllm-dtype", default="float32", choices=("float32", "bfloat16"), help="vLLM's weight dtype"
    )
    ap.add_argument(
        "--vllm-lookup",
        default="on",
        help="the vllm lookup row's setting: the engine's context lookup as vLLM's custom proposer",
    )
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument(
        "--rates", default="", help="Poisson arrival rates, requests/s (comma list; none by default)"
    )
    ap.add_argument("--poisson-requests", type=int, default=12)
    ap.add_argument(
        "--rate-schedule",
        default="",
        help="one Poisson level whose rate changes: RATE:REQUESTS,... (requests/s and how many arrive at it, "
        "in order, e.g. 0.1:6,0.6:12,0.1:6; none by default)",
    )
    ap.add_argument(
        "--long-mix",
        type=int,
        default=0,
        help="one level more: a prompt of this many tokens arriving among --long-mix-clients short streams (their "
        "largest gap during its prefill against their median inter-token latency; 0: none)",
    )
    ap.add_argument("--long-mix-clients", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-language", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slot-context", type=int, default=2048, help="llama-server context per slot")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    args.ours = [] if args.no_ours else (args.ours or list(DEFAULT_OURS))
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    args.rates = [float(x) for x in args.rates.split(",") if x]
    try:
        args.rate_schedule = parse_schedule(args.rate_schedule) if args.rate_schedule.strip() else []
    except ValueError as err:
        ap.error(str(err))
    args.llama_draft_max = [int(x) for x in args.llama_draft_max.split(",") if x]
    args.vllm = [x for x in args.vllm.split(",") if x]
    for name in args.vllm:
        if name not in ("ar", "table", "lookup") and not (name.startswith("draft-") and name[6:].isdigit()):
            ap.error(f"--vllm: unknown row {name!r} (ar, draft-K, table, lookup)")
    if not args.concurrency or min(args.concurrency) < 1 or 1 not in args.concurrency:
        ap.error("--concurrency must list positive levels, 1 among them (the identity reference)")

    suite = interleave_languages(load_suite(split="test", limit_per_language=args.prompts_per_language))
    prompts = [prompt_ids(args.pair, item["prompt"]) for item in suite]
    long_ids: list[int] = []
    if args.long_mix:
        everything = " ".join(item["prompt"] for item in load_suite(split="train"))
        text = "Summarise each of these requests in one line: " + everything
        while len(text) < 8 * args.long_mix:  # a token is at most a few characters
            text += " " + everything
        long_ids = prompt_ids(args.pair, text)[: args.long_mix]
        if len(long_ids) < args.long_mix:
            ap.error(f"--long-mix: this pair's prompts reach {len(long_ids)} tokens at most")

    target = draft = server = None
    if not args.no_llama:
        if args.pair != "qwen2.5-coder":
            print("skipped llama-server rows: only the default pair has GGUF files", flush=True)
        else:
            from engine.backends.weights import DEFAULT_PAIRS, fetch_gguf

            t_spec, d_spec = DEFAULT_PAIRS[args.pair]
            target, draft = fetch_gguf(t_spec, progress=False), fetch_gguf(d_spec, progress=False)
            server = find_server(Path(args.llama_bin) if args.llama_bin else default_bin_dir())
            if server is None:
                print("skipped llama-server rows: no llama-server binary (benchmarks/llama_cpp.py builds it)")
    rows = build_rows(args, target, draft, server)
    if not rows:
        print("no rows to run")
        return 0
    info = conditions(args.threads)
    print(
        f"# {info['cpu']} threads={args.threads} loadavg={info['loadavg']} prompts={len(prompts)}", flush=True
    )
    logs = ROOT / "runs" / "serve_load_logs"
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    for repeat in range(args.repeats):
        order = rows[repeat % len(rows) :] + rows[: repeat % len(rows)]
        for row in order:
            port = free_port()
            url = f"http://127.0.0.1:{port}/v1/completions"
            log = logs / f"{row.name.replace(' ', '_')}.log"
            command = row.command + ["--port", str(port)]
            with ServerProcess(row.name, command, port, log, ready_s=1800, cwd=ROOT, env=row.env) as srv:
                asyncio.run(closed_loop(url, row, prompts[:1], 1, 1, 8))  # warm-up
                reference: dict[int, str] = {}
                for level in sorted(args.concurrency):
                    requests = max(args.min_requests, 2 * level, len(prompts) if level == 1 else 0)
                    outcomes, wall = asyncio.run(
                        closed_loop(url, row, prompts, level, requests, args.max_tokens)
                    )
                    if level == 1:
                        reference = {o.prompt: o.text for o in outcomes if o.ok}
                    entry = {"row": row.name, "repeat": repeat, "mode": "closed", "level": level}
                    entry["weights"] = row.weights
                    entry.update(summarize(outcomes, wall, reference), peak_rss_mb=peak_rss_mb(srv.proc.pid))
                    entry["loadavg"] = os.getloadavg()[0]
                    results.append(entry)
                    report(entry)
                levels = [("poisson", rate, [(rate, args.poisson_requests)]) for rate in args.rates]
                if args.rate_schedule:
                    label = schedule_label(args.rate_schedule)
                    levels.append(("poisson-schedule", label, args.rate_schedule))
                if args.long_mix:
                    short, long, wall = asyncio.run(
                        long_mix(
                            url, row, prompts, long_ids, args.long_mix_clients, args.max_tokens, delay=3.0
                        )
                    )
                    entry = {"row": row.name, "repeat": repeat, "mode": "long-mix", "level": args.long_mix}
                    entry["weights"] = row.weights
                    entry.update(summarize(short, wall, reference), **long_mix_figures(short, long))
                    entry.update(peak_rss_mb=peak_rss_mb(srv.proc.pid), loadavg=os.getloadavg()[0])
                    results.append(entry)
                    report(entry)
                for mode, level, schedule in levels:
                    outcomes, wall = asyncio.run(
                        poisson(url, row, prompts, schedule, args.max_tokens, seed=repeat)
                    )
                    entry = {"row": row.name, "repeat": repeat, "mode": mode, "level": level}
                    entry["weights"] = row.weights
                    entry.update(summarize(outcomes, wall, reference), peak_rss_mb=peak_rss_mb(srv.proc.pid))
                    entry["loadavg"] = os.getloadavg()[0]
                    results.append(entry)
                    report(entry)
            if args.json:  # after every row: a long run stopped early keeps what it measured
                save(args.json, info, args, rows, results)
    table = medians(results)
    print("\n# medians over repeats")
    for entry in table:
        report(entry)
    if args.json:
        save(args.json, info, args, rows, results)
        print(f"wrote {args.json}")
    if args.plot:
        plot(table, args.plot, info)
        print(f"wrote {args.plot}")
    return 0


def save(path: str, info: dict, args, rows: list[Row], results: list[dict]) -> None:
    out = {"conditions": info, "args": dict(vars(args)), "rows": [asdict(r) for r in rows]}
    out.update(results=results, medians=medians(results))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, default=str) + "\n")


def report(e: dict) -> None:
    unit = {"closed": "clients", "poisson": "req/s", "long-mix": "tokens"}.get(e["mode"], "req/s:n")
    level = f"{e['level']:>5g}" if isinstance(e["level"], (int, float)) else e["level"]
    print(
        f"{e['row']:18s} {e['mode']:7s} {level} {unit:7s} tok/s {e['tok_s']:7.2f} (1 req {e['decode_tok_s']:5.2f})  "
        f"ttft p50 {e['ttft_p50']:6.3f} p99 {e['ttft_p99']:6.3f}  itl p50 {e['itl_p50'] * 1e3:6.1f} "
        f"p99 {e['itl_p99'] * 1e3:6.1f} ms  lat p50 {e['latency_p50']:6.2f} p99 {e['latency_p99']:6.2f}  "
        f"same {e['identical']:.0%}  err {e['errors']}  rss {e['peak_rss_mb']:.0f} MB  load {e['loadavg']:.2f}"
        + (
            f"  long: ttft {e['long_ttft_s']:.2f} s; meanwhile the streams' largest gap {e['gap_max_s'] * 1e3:.0f} ms "
            f"= {e['gap_over_itl_p50']:.1f}x their itl p50, a new short request's ttft up to {e['short_ttft_max_s']:.2f} s"
            if e["mode"] == "long-mix"
            else ""
        ),
        flush=True,
    )


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


def plot(table: list[dict], path: str, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = [e for e in table if e["mode"] == "closed"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for row in dict.fromkeys(e["row"] for e in closed):
        pts = sorted((e["level"], e["tok_s"], e["itl_p99"] * 1e3) for e in closed if e["row"] == row)
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=row)
        b.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=row)
    for ax, label in ((a, "aggregate tokens/s"), (b, "p99 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(f"{info['cpu']}, {info['threads']} threads, {info['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
