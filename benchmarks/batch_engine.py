"""Batched engine check and throughput: N concurrent autoregressive requests through ``BatchedEngine``.

1. Greedy identity: 4 requests batched (mixed controllers) give each request's tokens alone.
2. Throughput: aggregate tokens/s of 1, 2, 4, 8 concurrent autoregressive requests (decode only), with the CPU
   model and load average recorded. Waits while /tmp/draftpilot-quiet exists (another session is timing).

    python benchmarks/batch_engine.py                 # default pair (kquant target, kquant-strict draft)
    python benchmarks/batch_engine.py --pair tiny     # plumbing check
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from engine.backends import native
from engine.backends.models import load_pair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest
from engine.control import StaticController
from engine.engine import SpeculativeEngine

PROMPTS = [
    "Write a Python function that returns the prime numbers below n.",
    "Explain the difference between a list and a tuple in Python.",
    "Implement binary search in Python and explain its complexity.",
    "Write a Python class for a stack with push, pop and peek.",
]


def wait_quiet() -> None:
    while os.path.exists("/tmp/draftpilot-quiet"):
        time.sleep(15)


def drain(batch: BatchedEngine) -> dict[int, list[int]]:
    out = {}
    while batch.active or batch.pending:
        for ev in batch.step():
            if ev.finished:
                out[ev.rid] = batch.result(ev.rid).tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--kernel-defines",
        default="",
        help="run on the kernels compiled with these comma-separated -D flags (A/B of a kernel change, "
        "e.g. KQ_NO_I16ACC,KQ_ROWS=2); default: the machine's build",
    )
    ap.add_argument("--counts", default="1,2,4,8", help="concurrent requests of the throughput part")
    ap.add_argument("--skip-identity", action="store_true", help="only the throughput part")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernel_defines:
        native.use_variant(*args.kernel_defines.split(","))
        print(f"kernels: -D {args.kernel_defines} ({native.kernels().isa()})")
    pair = load_pair(args.pair)
    ids = [pair.encode(p) for p in PROMPTS]
    if not args.skip_identity:
        controllers = [None, StaticController(3), None, StaticController(2)]
        wait_quiet()
        batch = BatchedEngine(pair, BatchConfig(max_requests=8))
        rids = [batch.add(BatchRequest(i, args.tokens, c)) for i, c in zip(ids, controllers)]
        got = drain(batch)
        controllers = [None, StaticController(3), None, StaticController(2)]
        alone = [SpeculativeEngine(pair).generate(i, args.tokens, c).tokens for i, c in zip(ids, controllers)]
        same = [got[r] == a for r, a in zip(rids, alone)]
        print(f"greedy identity (4 batched vs alone): {sum(same)}/4")
    print(f"cpu: {native.cpu_signature()}, threads {args.threads}")
    for n in (int(c) for c in args.counts.split(",")):
        wait_quiet()
        batch = BatchedEngine(pair, BatchConfig(max_requests=n))
        for j in range(n):
            batch.add(BatchRequest(ids[j % len(ids)], args.tokens))
        batch.step()  # prefills (and first cycle) excluded from the timing
        t0, tokens = time.perf_counter(), 0
        while batch.active:
            tokens += sum(len(ev.tokens) for ev in batch.step())
        dt = time.perf_counter() - t0
        print(
            f"{n} requests: {tokens / dt:.2f} tokens/s aggregate ({tokens} tokens, {dt:.1f} s), load {os.getloadavg()}"
        )


if __name__ == "__main__":
    main()
