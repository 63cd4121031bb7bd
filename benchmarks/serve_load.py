"""Load benchmark: our server (serve.py), llama.cpp's llama-server and vLLM's OpenAI server under the same
load, same threads, same prompt tokens (ours and llama-server on the same GGUF files; vLLM on the float32
checkpoints dequantised from them: the weight format of every row is recorded with it).

Every row is a server started for the row and stopped after it:

* ``ours <name>``: ``serve.py`` with the row's flags (``--ours NAME=FLAGS``, e.g.
  ``--ours "ar=--autoregressive" --ours "static=--policy none --depth 1"``);
* ``llama <name>``: ``llama-server`` (``-np`` slots, continuous batching) autoregressive, with the draft
  model (``--draft-max``), and with its n-gram lookup (``--spec-type ngram-simple``), as separate rows;
* ``vllm <name>`` (``--vllm ar,draft-K,table,lookup``, none by default): vLLM's OpenAI server from its own
  environment (peers/vllm_peer.py, docs/vllm.md) autoregressive, with the draft model at a fixed
  ``num_speculative_tokens`` K, with a per-batch-size table (``--vllm-table FILE``, written by
  ``policies.static.write_batch_size_table``), and with the engine's context lookup as vLLM's custom
  proposer (``--vllm-lookup SETTING``, peers/vllm_lookup.py); in float32 or ``--vllm-dtype bfloat16``;
  the rows are skipped with one line where vLLM is absent.

Each row runs the closed-loop levels (N clients, each sending its next request when the last one ended; N in
``--concurrency``; 2N requests, at least ``--min-requests``), the Poisson levels (requests arriving at
``--rates`` per second, ``--poisson-requests`` of them) and, with ``--rate-schedule R1:N1,R2:N2,...``, one
Poisson level whose rate changes during the run (N1 requests arriving at R1 per second, then N2 at R2, ...;
mode ``poisson-schedule``, its level the schedule). Poisson arrivals are seeded (the repeat's index): the
first request at once, each next one an exponential gap later at its own rate. Requests are /v1/completions with the chat-templated
prompt as token ids (both servers read token-id prompts, so both see the same tokens), greedy, streaming,
``max_tokens`` with ``ignore_eos`` (both servers honour it: every request does the same work), and both
servers' prefix caches off (``--cache off``, the default of this workload: ours ``--no-prefix-cache``,
llama-server ``cache_prompt: false``), since the benchmark repeats its prompts, which a cache would not
prefill again; ``--cache on`` runs both with theirs. ``--workload multi-turn`` runs conversations instead
(``peers.load_chat``: a shared system prompt, a document per user, turn after turn), with the caches as users
run them (llama-server with and without its own). Rows are
interleaved and the whole set repeated ``--repeats`` times in rotated order, so drift hits all rows alike:
each repeat runs every row once (a server started for it, every level in turn), so each repeat gives one paired
measurement of every row at every level. ``--prompts`` names the prompt set (a suite file or a built-in set:
suite, long, grounded, mixed; ``envs.prompts``) and ``--split`` its split.

Paired ratios (``--ratio A/B``, repeatable; A and B row names, ``ours`` implied): per mode and level the ratio
of A's tokens/s to B's with a percentile bootstrap 95% interval (``evaluation.stats.paired_bootstrap_ratio``).
``--ratio-unit request`` (the default) pairs requests: the k-th request of the same prompt at the same level
and repeat in both rows (the closed loop and the Poisson runs send the same prompts in the same order), each
pair its tokens and latency, the ratio that of tokens per second of latency summed (at N clients in a closed
loop, system tokens/s is about N x tokens / mean latency, so this estimates the ratio of system tokens/s);
resampling pairs keeps each prompt's two rows together, which removes what prompts differ by (grounded prompts
differ a lot), and gives an interval with one or two repeats. Requests of one level share their batches, so
they are not independent: the interval is of the prompts' spread, not of run-to-run drift. ``--ratio-unit
repeat`` pairs the repeats (a level's tokens and wall time in each row): run-to-run drift included, but it
needs several repeats (with one the interval is the point).

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
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from engine.cli import ArgumentParser
from engine.costs.measure_costs import device_name
from engine.errors import DraftpilotError
from envs.prompts import interleave_languages, load_suite
from evaluation.stats import paired_bootstrap_ratio
from peers.launch import ServerProcess, free_port, peak_rss_mb, prompt_ids, rss_mb
from peers.llama_cpp_build import default_bin_dir, find_server
from peers.load_client import (
    Outcome,
    Row,
    closed_loop,
    long_mix,
    long_mix_figures,
    medians,
    parse_schedule,
    poisson,
    schedule_label,
    summarize,
)
from peers.load_rows import build_rows

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OURS = ("ar=--autoregressive", "static=--policy none --depth 1 --lookup on")


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
    ap.add_argument(
        "--workload",
        default="single",
        choices=("single", "multi-turn"),
        help="single: one request per prompt of the suite (closed loop, Poisson); multi-turn: conversations of "
        "--turns turns over a shared system prompt and a per-user document, --concurrency of them at a time",
    )
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    ap.add_argument(
        "--conversations", type=int, default=0, help="multi-turn: conversations per level (0: the level)"
    )
    ap.add_argument("--system-tokens", type=int, default=1000, help="multi-turn: the shared system prompt")
    ap.add_argument("--document-tokens", type=int, default=500, help="multi-turn: each user's document")
    ap.add_argument(
        "--cache",
        default=None,
        choices=("off", "on", "both"),
        help="prefix caches of the servers: off (ours --no-prefix-cache, llama-server cache_prompt false), on "
        "(both on, as users run them), both (llama-server rows with and without; ours as --ours says); default: "
        "off for --workload single (it repeats prompts), both for multi-turn",
    )
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--prompts",
        default="suite",
        help="the prompt set: a suite JSONL file or a built-in set's name (suite, long, grounded, mixed: "
        "envs.prompts)",
    )
    ap.add_argument("--split", default="test", help="the split of --prompts the requests come from")
    ap.add_argument("--prompts-per-language", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slot-context", type=int, default=2048, help="llama-server context per slot")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--ratio",
        action="append",
        default=[],
        help="A/B: print the ratio of row A's tokens/s to row B's per level with a paired bootstrap 95%% "
        "interval (row names as printed, 'ours ' implied; repeatable)",
    )
    ap.add_argument(
        "--ratio-unit",
        default="request",
        choices=("request", "repeat"),
        help="what --ratio pairs: requests (the same prompt's k-th request at the same level and repeat) or "
        "repeats (a level's tokens and wall time)",
    )
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples of --ratio")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    args.ours = [] if args.no_ours else (args.ours or list(DEFAULT_OURS))
    if args.cache is None:
        args.cache = "off" if args.workload == "single" else "both"
    if args.cache == "off":  # ours as llama-server: every prompt computed in full
        args.ours = [
            spec if "--no-prefix-cache" in spec else f"{spec} --no-prefix-cache" for spec in args.ours
        ]
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
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency must list positive levels")
    if args.workload == "single" and 1 not in args.concurrency:
        ap.error("--concurrency must list 1 among its levels (the identity reference)")
    if args.workload == "multi-turn":
        return multi_turn(args, ap)
    if args.bootstrap < 1:
        ap.error(f"--bootstrap must be >= 1, got {args.bootstrap}")
    try:
        args.ratio = [parse_ratio(text) for text in args.ratio]
    except ValueError as err:
        ap.error(str(err))

    try:
        suite = interleave_languages(
            load_suite(args.prompts, split=args.split, limit_per_language=args.prompts_per_language)
        )
    except (DraftpilotError, ValueError) as err:
        ap.error(f"--prompts {args.prompts} --split {args.split}: {err}")
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

    target, draft, server = llama_setup(args)
    rows = build_rows(args, target, draft, server, ROOT)
    try:
        args.ratio = [resolve_ratio(pair, [row.name for row in rows]) for pair in args.ratio]
    except ValueError as err:
        ap.error(str(err))
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
                    entry["per_request"] = per_request(outcomes)
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
                    entry["per_request"] = per_request(outcomes)
                    entry["loadavg"] = os.getloadavg()[0]
                    results.append(entry)
                    report(entry)
            if args.json:  # after every row: a long run stopped early keeps what it measured
                save(args.json, info, args, rows, results)
    table = medians(results)
    print("\n# medians over repeats")
    for entry in table:
        report(entry)
    ratios = [r for a, b in args.ratio for r in paired_ratios(results, a, b, args.ratio_unit, args.bootstrap)]
    if ratios:
        print(
            f"\n# paired ratios, bootstrap 95% interval over {args.ratio_unit} pairs ({args.bootstrap} resamples)"
        )
        for r in ratios:
            print(
                f"{r['a']} / {r['b']}  {r['mode']} {r['level']}  {r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]  "
                f"({r['pairs']} pairs)",
                flush=True,
            )
    if args.json:
        save(args.json, info, args, rows, results, ratios)
        print(f"wrote {args.json}")
    if args.plot:
        plot(table, args.plot, info)
        print(f"wrote {args.plot}")
    return 0


def llama_setup(args):
    """(target GGUF, draft GGUF, llama-server) where llama-server rows run, else Nones (with a line why)."""
    if args.no_llama:
        return None, None, None
    if args.pair != "qwen2.5-coder":
        print("skipped llama-server rows: only the default pair has GGUF files", flush=True)
        return None, None, None
    from engine.backends.weights import DEFAULT_PAIRS, fetch_gguf

    t_spec, d_spec = DEFAULT_PAIRS[args.pair]
    target, draft = fetch_gguf(t_spec, progress=False), fetch_gguf(d_spec, progress=False)
    server = find_server(Path(args.llama_bin) if args.llama_bin else default_bin_dir())
    if server is None:
        print("skipped llama-server rows: no llama-server binary (benchmarks/llama_cpp.py builds it)")
    return target, draft, server


def chat_template(pair: str):
    """``messages -> prompt ids`` as our server templates a chat (the tiny pair: its byte tokenizer over the
    contents, no template)."""
    if pair == "tiny":
        from engine.backends.tiny import ByteTokenizer

        tok = ByteTokenizer()
        return lambda messages: tok.encode("\n".join(m["content"] for m in messages))[-900:]
    from engine.backends.weights import pair_tokenizer

    tok = pair_tokenizer(pair)

    def template(messages):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]

    return template


def workload_texts(args, template) -> tuple[str, list[str]]:
    """(the shared system prompt, the users' documents) of ``--system-tokens`` and ``--document-tokens`` tokens
    at most as one message (the template's own tokens included), cut from the suite's train prompts (four
    languages, repeated as needed): the system prompt from their start, each user's document further on."""
    items = interleave_languages(load_suite(split="train"))
    words = " ".join(item["prompt"] for item in items).split(" ")

    def cut(start: int, tokens: int) -> str:
        if tokens <= 0:
            return ""
        span = [words[(start + k) % len(words)] for k in range(4 * tokens)]
        low, high = 1, len(span)  # the most words within ``tokens``
        while low < high:
            mid = (low + high + 1) // 2
            if len(template([{"role": "user", "content": " ".join(span[:mid])}])) <= tokens:
                low = mid
            else:
                high = mid - 1
        return " ".join(span[:low])

    head = "You are a careful assistant. Reference notes follow; answer from them.\n"
    shared = head + cut(0, args.system_tokens - 20)
    documents = [cut(len(words) // 2 + 997 * u, args.document_tokens) for u in range(8)]
    return shared, documents


def multi_turn(args, ap) -> int:
    """``--workload multi-turn``: each row, each level (conversations at a time), turn by turn."""
    from peers.load_chat import chat_figures, chat_level, conversations, texts

    if args.turns < 1:
        ap.error("--turns must be >= 1")
    template = chat_template(args.pair)
    shared, documents = workload_texts(args, template)
    target, draft, server = llama_setup(args)
    rows = build_rows(args, target, draft, server, ROOT)
    if not rows:
        print("no rows to run")
        return 0
    info = conditions(args.threads)
    info["workload"] = {
        "turns": args.turns,
        "system_tokens": len(template([{"role": "system", "content": shared}])),
        "document_tokens": args.document_tokens,
        "max_tokens": args.max_tokens,
    }
    print(f"# {info['cpu']} threads={args.threads} loadavg={info['loadavg']} multi-turn {info['workload']}")
    logs = ROOT / "runs" / "serve_load_logs"
    logs.mkdir(parents=True, exist_ok=True)
    reference_row = next((r.name for r in rows if "--no-prefix-cache" in r.command), rows[0].name)
    results, reference = [], {}
    for repeat in range(args.repeats):
        order = rows[repeat % len(rows) :] + rows[: repeat % len(rows)]
        order.sort(key=lambda r: r.name != reference_row)  # the cold reference first in each repeat
        for row in order:
            port = free_port()
            url = f"http://127.0.0.1:{port}/v1/completions"
            log = logs / f"{row.name.replace(' ', '_')}.log"
            with ServerProcess(row.name, row.command + ["--port", str(port)], port, log, ready_s=1800, cwd=ROOT, env=row.env) as srv:  # fmt: skip
                warm = conversations(1, 1, "Warm-up.", ["-"], "warm-up")
                asyncio.run(chat_level(url, row, warm, 1, 4, template))
                for index, level in enumerate(sorted(args.concurrency)):  # a level listed twice runs twice
                    session = f"L{level}R{repeat}I{index}"
                    convs = conversations(
                        max(level, args.conversations), args.turns, shared, documents, session
                    )
                    done = asyncio.run(chat_level(url, row, convs, level, args.max_tokens, template))
                    key = (repeat, index)
                    if row.name == reference_row:
                        reference[key] = texts(done)
                    entry = {"row": row.name, "repeat": repeat, "mode": "multi-turn", "level": level}
                    entry["weights"] = row.weights
                    entry.update(chat_figures(done, args.turns, reference.get(key)))
                    entry.update(peak_rss_mb=peak_rss_mb(srv.proc.pid), rss_mb=rss_mb(srv.proc.pid))
                    entry.update(loadavg=os.getloadavg()[0], run=index)
                    results.append(entry)
                    report_chat(entry, args.turns)
            if args.json:
                save(args.json, info, args, rows, results)
    print(f"\n# medians over repeats (same: the share of turns whose text equals {reference_row!r}'s)")
    for entry in medians(results):
        report_chat(entry, args.turns)
    if args.json:
        save(args.json, info, args, rows, results)
        print(f"wrote {args.json}")
    return 0


def report_chat(e: dict, turns: int) -> None:
    per_turn = " ".join(f"{e[f'turn{k + 1}_ttft_p50']:.2f}" for k in range(turns))
    print(
        f"{e['row']:22s} {e['level']:>3g} users  tok/s {e['tok_s']:7.2f}  ttft p50 {e['ttft_p50']:6.2f} "
        f"p99 {e['ttft_p99']:6.2f} s  per turn p50 [{per_turn}]  itl p50 {e['itl_p50'] * 1e3:6.1f} p99 "
        f"{e['itl_p99'] * 1e3:6.1f} ms  hit {e['hit_rate']:.0%}  same {e['identical']:.0%}  err {e['errors']}  "
        f"rss {e['rss_mb']:.0f} (peak {e['peak_rss_mb']:.0f}) MB  load {e['loadavg']:.2f}",
        flush=True,
    )


def parse_ratio(text: str) -> tuple[str, str]:
    """``--ratio A/B`` as (A, B), the names stripped."""
    a, slash, b = text.partition("/")
    if not slash or not a.strip() or not b.strip() or "/" in b or a.strip() == b.strip():
        raise ValueError(f"--ratio: expected A/B, two different row names, got {text!r}")
    return a.strip(), b.strip()


def resolve_ratio(pair: tuple[str, str], names: list[str]) -> tuple[str, str]:
    """Each name of a ``--ratio`` pair as a row's name: itself, or ``ours NAME``; unknown: ValueError."""
    out = []
    for name in pair:
        full = name if name in names else f"ours {name}"
        if full not in names:
            raise ValueError(f"--ratio: no row {name!r}; the rows are {names}")
        out.append(full)
    return out[0], out[1]


def per_request(outcomes: list[Outcome]) -> list[list]:
    """[prompt, k, tokens, latency] of every request that succeeded, k its prompt's occurrence (0, 1, ...) in the
    order the requests were sent: the key that pairs it with another row's request (``paired_ratios``)."""
    seen: dict[int, int] = {}
    out = []
    for o in sorted(outcomes, key=lambda o: o.start):
        k = seen[o.prompt] = seen.get(o.prompt, -1) + 1
        if o.ok and o.latency > 0:
            out.append([o.prompt, k, o.tokens, o.latency])
    return out


def paired_ratios(
    results: list[dict], a: str, b: str, unit: str = "request", resamples: int = 2000, seed: int = 0
) -> list[dict]:
    """Per mode and level both rows ran: row ``a``'s tokens/s over row ``b``'s, with a paired bootstrap 95%
    interval (module docstring): ``unit`` "request" pairs the requests of the same prompt, occurrence, level
    and repeat (tokens and latency each); "repeat" pairs the repeats (the level's tokens and wall time).
    Each {"a", "b", "mode", "level", "unit", "ratio", "low", "high", "pairs"}; a level without pairs is left out."""
    out = []
    keys = dict.fromkeys((r["mode"], r["level"]) for r in results if r["row"] == a)
    for mode, level in keys:
        runs = {
            (r["row"], r["repeat"]): r
            for r in results
            if r["mode"] == mode and r["level"] == level and r["row"] in (a, b)
        }
        repeats = sorted({rep for row, rep in runs if row == a} & {rep for row, rep in runs if row == b})
        pairs = []  # (tokens a, seconds a, tokens b, seconds b)
        for rep in repeats:
            x, y = runs[(a, rep)], runs[(b, rep)]
            if unit == "repeat":
                if x["tokens"] > 0 and y["tokens"] > 0 and x["wall_s"] > 0 and y["wall_s"] > 0:
                    pairs.append((x["tokens"], x["wall_s"], y["tokens"], y["wall_s"]))
                continue
            theirs = {(p, k): (n, t) for p, k, n, t in y.get("per_request", [])}
            for p, k, n, t in x.get("per_request", []):
                if (p, k) in theirs and n > 0 and theirs[(p, k)][0] > 0:
                    pairs.append((n, t, *theirs[(p, k)]))
        if not pairs:
            continue
        columns = list(zip(*pairs))
        interval = paired_bootstrap_ratio(*columns, resamples=resamples, rng=seed)
        out.append(
            {"a": a, "b": b, "mode": mode, "level": level, "unit": unit, "pairs": len(pairs)}
            | {k: interval[k] for k in ("ratio", "low", "high")}
        )
    return out


def save(path: str, info: dict, args, rows: list[Row], results: list[dict], ratios: list[dict] | None = None) -> None:  # fmt: skip
    out = {"conditions": info, "args": dict(vars(args)), "rows": [asdict(r) for r in rows]}
    out.update(results=results, medians=medians(results), ratios=ratios or [])
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
