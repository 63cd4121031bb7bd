"""Where a batched decoding step's time goes beyond its forwards (issue 52, item 4): the real
``BatchedEngine`` with N requests decoding at once, each step split into its model forwards (the native
decoder's layers and the LM head, ``engine.batch_forward.forward_rows``: timed by wrapping it) and the rest
(the cycle rules, sampling and verification, commit, KV bookkeeping, scheduling, events: Python around the
forwards). Times are CPU seconds of the process divided by the threads (``time.process_time``), so other
jobs on a shared machine do not count; wall time is printed next to them.

Every request has its own random prompt of ``--context`` tokens; the requests are admitted together, their
prompts prefilled, then ``--steps`` decoding steps are timed (``--depth 0``: autoregressive; ``--depth D``:
a static chain of D drafted tokens, verified by the target).

    python benchmarks/batch_step_split.py --clients 1,8,16 --context 512 --steps 12
    python benchmarks/batch_step_split.py --pair tiny --clients 1,4 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from unittest import mock

import torch

import engine.batch as batch_module
from engine.backends import native
from engine.backends.models import load_pair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest
from engine.batch_forward import forward_rows
from engine.control import StaticController


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--clients", default="1,8,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--depth", type=int, default=0, help="drafted tokens a cycle (0: autoregressive)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.context < 1 or args.depth < 0:
        ap.error("--steps and --context must be >= 1, --depth >= 0")
    clients = [int(c) for c in args.clients.split(",")]
    torch.set_num_threads(args.threads)
    kinds = {} if args.pair == "tiny" else {"weights": "kquant", "draft_weights": "kquant-strict"}
    pair = load_pair(args.pair, progress=False, random_weights=args.random_weights, **kinds)
    context = min(args.context, pair.max_context - args.steps * (args.depth + 1) - 8)
    cpu_name = native.cpu_signature().split("|")[1] if native.available() else "unknown CPU"
    print(
        f"CPU {cpu_name}, {args.threads} thread(s), load {os.getloadavg()}; {args.pair}; context {context}, "
        f"depth {args.depth}, {args.steps} steps timed"
    )
    forward_cpu = [0.0]

    def timed_forward(*a, **k):
        c0 = time.process_time()
        try:
            return forward_rows(*a, **k)
        finally:
            forward_cpu[0] += time.process_time() - c0

    results = {}
    # the batched engine calls the name it imported: patched there, and put back when the runs end
    with mock.patch.object(batch_module, "forward_rows", timed_forward):
        for n in clients:
            gen = torch.Generator().manual_seed(n)
            engine = BatchedEngine(pair, BatchConfig(max_requests=n, max_rows=max(64, n * (args.depth + 1))))
            # the first prompts decode while the later ones are prefilled (16 prompt tokens a step at the
            # least): enough tokens that every request still decodes through the timed steps
            budget = min(
                pair.max_context - context - 2, n * context // 16 + (args.steps + 4) * (args.depth + 1) + 16
            )
            for _ in range(n):
                prompt = [int(t) for t in torch.randint(0, pair.vocab_size, (context,), generator=gen)]
                engine.add(
                    BatchRequest(
                        prompt,
                        max_new_tokens=budget,
                        controller=StaticController(depth=args.depth, verify=args.depth)
                        if args.depth
                        else None,
                        ignore_eos=True,
                    )
                )
            while engine.pending:
                engine.step()
            engine.step()  # a first decoding step (warm)
            rows = {"step_cpu_ms": [], "forward_cpu_ms": [], "rest_cpu_ms": [], "step_wall_ms": []}
            for _ in range(args.steps):
                forward_cpu[0] = 0.0
                c0, w0 = time.process_time(), time.perf_counter()
                events = engine.step()
                cpu = (time.process_time() - c0) / args.threads
                wall = time.perf_counter() - w0
                if len(events) != n or any(e.finished for e in events):
                    break  # a request ended: the steps after it are not steps of n clients
                fwd = forward_cpu[0] / args.threads
                rows["step_cpu_ms"].append(cpu * 1e3)
                rows["forward_cpu_ms"].append(fwd * 1e3)
                rows["rest_cpu_ms"].append((cpu - fwd) * 1e3)
                rows["step_wall_ms"].append(wall * 1e3)
            if not rows["step_cpu_ms"]:
                raise SystemExit(
                    f"{n} clients: no decoding step of all {n} requests (raise --context or lower --steps)"
                )
            med = {k: statistics.median(v) for k, v in rows.items()}
            results[n] = {**med, "steps": len(rows["step_cpu_ms"]), "per_step": rows}
            share = 100 * med["rest_cpu_ms"] / med["step_cpu_ms"]
            print(
                f"{n:3d} clients: step {med['step_cpu_ms']:8.1f} ms CPU = forwards {med['forward_cpu_ms']:8.1f} "
                f"+ the rest {med['rest_cpu_ms']:6.1f} ({share:4.1f}%)  [wall {med['step_wall_ms']:8.1f} ms; "
                f"{med['rest_cpu_ms'] / n:5.2f} ms of the rest a request]",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "load": os.getloadavg(), "clients": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
