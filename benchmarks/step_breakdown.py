"""Where a target step's time goes at many rows, before/after (issue 52): the native decoder of this checkout
and of a git revision (``--against``, built from that revision's ``engine/backends/csrc``) over the same model,
timed interleaved in CPU seconds a thread (``time.process_time`` / threads: on a shared machine wall time
counts whatever else ran).

For Q query rows of one sequence with C cached entries (a prefill chunk, a verification tree, or -- for the
attention's cost -- Q decoding rows of as many sequences, each seeing C keys):

* ``layers``: ``Decoder.forward`` over every layer (norms, the linears, rotary, cache write, attention)
* ``attention``: ``layers`` at C cached minus ``layers`` at ``--short`` cached (what the C keys add; the
  linears do not depend on C)
* ``head``: the LM head over the Q rows (verification needs every row's logits), through each build's kernels
* ``sampling``: softmax and argmax over the Q rows' logits (torch), as a greedy/sampled acceptance reads them

Also a prefill of ``--prefill`` tokens: ``layers`` at 0 cached plus the head on its last row, as tokens/s.
The weights are the named pair's target (``--random-weights``: its shapes, random values).

    python benchmarks/step_breakdown.py --against main [--rows 1,8,16,64] [--contexts 16,2048]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.backends import lean, native
from engine.backends.kquant import KQuantLinear
from engine.backends.models import load_pair
from evaluation.kernel_revisions import revision_sources

ROOT = Path(__file__).resolve().parents[1]


def cpu_time(fn, threads: int) -> float:
    c0 = time.process_time()
    fn()
    return (time.process_time() - c0) / threads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="main")
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--rows", default="1,8,16,64")
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--short", type=int, default=16, help="cached entries of the attention-free reference")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        builds = {
            args.against: native.build(
                "sb_reference", tmp / "ref_build", sources=revision_sources(args.against, tmp / "ref")
            ),
            "ours": native.kernels(),
        }
        pair = load_pair(
            args.pair,
            weights="kquant",
            draft_weights="kquant-strict",
            progress=False,
            random_weights=args.random_weights,
        )
        model = pair.target
        decoders = {k: lean.build_decoder(ops, model) for k, ops in builds.items()}
        config = model.config
        d = model.model.layers[0].self_attn.head_dim
        nl, nkv = config.num_hidden_layers, config.num_key_value_heads
        none = torch.empty(0, dtype=torch.long)
        print(
            f"CPU {native.cpu_signature().split('|')[1]}, {args.threads} thread(s), load {os.getloadavg()}; "
            f"{args.pair} target{' (random weights)' if args.random_weights else ''}; "
            f"{args.against} vs this checkout"
        )

        def layers_call(dec, q: int, ctx: int, caches):
            x = torch.randn(q, config.hidden_size, generator=torch.Generator().manual_seed(q)) * 0.5
            angles = torch.rand(q, d // 2, generator=torch.Generator().manual_seed(ctx)).repeat(1, 2)
            cos, sin = angles.cos(), angles.sin()
            cnt = torch.arange(ctx + 1, ctx + q + 1)
            return lambda: dec.forward(x, cos, sin, *caches, ctx, cnt, none)

        def median_times(calls: dict) -> dict:
            times = {k: [] for k in calls}
            for i in range(args.reps + 1):  # the first round warms up; the order alternates
                for k, fn in list(calls.items())[:: 1 if i % 2 == 0 else -1]:
                    times[k].append(cpu_time(fn, args.threads))
            return {k: statistics.median(v[1:]) for k, v in times.items()}

        def head_call(k: str, h: torch.Tensor):
            # the LM head through each build's kernels where it is a kquant layer (else the module for both)
            lm = model.lm_head
            if isinstance(lm, KQuantLinear):
                op = getattr(builds[k], f"{lm.kind}_matmul")
                return lambda: op(h, *lm.tiles(), lm.bias, lm.in_features, lm.out_features)
            return lambda: lm(h)

        results = {"rows": {}, "prefill": {}}
        for q in rows:
            h = torch.randn(q, config.hidden_size)
            heads = median_times({k: head_call(k, h) for k in decoders})
            logits = model.lm_head(h)
            sampling = median_times({"sampling": lambda lg=logits: (torch.softmax(lg, -1), lg.argmax(-1))})[
                "sampling"
            ]
            for ctx in contexts:
                cap = max(ctx, args.short) + q
                caches = {
                    k: [[torch.randn(1, nkv, cap, d) for _ in range(nl)] for _ in "kv"] for k in decoders
                }
                long = median_times({k: layers_call(dec, q, ctx, caches[k]) for k, dec in decoders.items()})
                short = median_times(
                    {k: layers_call(dec, q, args.short, caches[k]) for k, dec in decoders.items()}
                )
                line = {}
                for k in decoders:
                    att = max(0.0, long[k] - short[k])
                    head = heads[k]
                    total = long[k] + head + sampling
                    line[k] = {
                        "layers_ms": long[k] * 1e3,
                        "layers_short_ms": short[k] * 1e3,
                        "attention_ms": att * 1e3,
                        "head_ms": head * 1e3,
                        "sampling_ms": sampling * 1e3,
                        "step_ms": total * 1e3,
                    }
                    print(
                        f"{q:4d} rows, {ctx} cached, {k:>6s}: step {total * 1e3:8.1f} ms = layers "
                        f"{long[k] * 1e3:8.1f} (of which attention {att * 1e3:7.1f}, "
                        f"{100 * att / total:4.1f}% of the step) + head {head * 1e3:6.1f} + sampling "
                        f"{sampling * 1e3:5.1f}",
                        flush=True,
                    )
                results["rows"][f"{q}@{ctx}"] = line
        n = args.prefill
        caches = {k: [[torch.zeros(1, nkv, n, d) for _ in range(nl)] for _ in "kv"] for k in decoders}
        h1 = torch.randn(1, config.hidden_size)
        head1 = median_times({k: head_call(k, h1) for k in decoders})
        pre = median_times({k: layers_call(dec, n, 0, caches[k]) for k, dec in decoders.items()})
        for k, t in pre.items():
            total = t + head1[k]
            results["prefill"][k] = {"ms": total * 1e3, "tokens_per_s": n / total}
            print(f"prefill {n} tokens, {k:>6s}: {total * 1e3:8.1f} ms, {n / total:6.1f} tokens/s")
        print(f"load after: {os.getloadavg()}")
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
