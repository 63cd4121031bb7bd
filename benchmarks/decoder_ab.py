"""The native decoder of this checkout against the one of another git revision, side by side: both are
compiled (the revision's ``engine/backends/csrc`` taken with ``git show``), built over the same layers of a model
pair, run on the same inputs with the same caches, and compared bit for bit (prompt rows, a chain, a tree;
1 and 2 threads; several cache lengths), then timed interleaved (decode and verification forwards over a
filled cache). A restructuring that must keep every bit (so recorded traces stay valid) is checked here
before the trace caches are trusted; the decoder fingerprint test guards it afterwards.

    python benchmarks/decoder_ab.py --against HEAD~1
    python benchmarks/decoder_ab.py --against HEAD~1 --contexts 128,512,2048 --rows 1,4 --reps 9
    python benchmarks/decoder_ab.py --against HEAD~1 --random-weights     # real shapes, no weights needed

``--variant DEFINES`` compares the checkout with itself built with extra ``-D`` flags instead of a revision:
``--variant KQ_NO_AVX512`` is the AVX2 path (what a CPU without AVX-512 VNNI compiles) against this
machine's build, bit for bit and timed on this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from engine.backends import lean, native
from engine.backends.models import load_pair
from evaluation.kernel_revisions import revision_sources

ROOT = Path(__file__).resolve().parents[1]


def tree_index(ctx: int, chain: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts and index of 6 tree rows over a cache of ctx + chain entries (the tree at ctx + chain ...)."""
    paths = [[0], [0, 1], [0, 2], [0, 2, 3], [0, 1, 4], [0, 2, 3, 5]]
    base = ctx + chain
    index = torch.zeros((len(paths), base + len(paths)), dtype=torch.long)
    counts = []
    for r, path in enumerate(paths):
        seen = list(range(base)) + [base + p for p in path]
        index[r, : len(seen)] = torch.tensor(seen)
        counts.append(len(seen))
    return torch.tensor(counts), index


def check(decoders: dict, model, contexts: list[int]) -> int:
    config = model.config
    d, nl, nkv = (
        model.model.layers[0].self_attn.head_dim,
        config.num_hidden_layers,
        config.num_key_value_heads,
    )
    rng = np.random.RandomState(0)
    none = torch.empty(0, dtype=torch.long)
    differing = 0
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for ctx in contexts:
            cap = ctx + 16
            caches = {k: [[torch.zeros(1, nkv, cap, d) for _ in range(nl)] for _ in "kv"] for k in decoders}
            counts, index = tree_index(ctx, 5)
            steps = [
                ("prompt", ctx, 0, torch.arange(1, ctx + 1), none),
                ("chain", 5, ctx, torch.arange(ctx + 1, ctx + 6), none),
                ("tree", 6, ctx + 5, counts, index),
            ]
            for name, q, past, cnt, idx in steps:
                x = torch.from_numpy(rng.standard_normal((q, config.hidden_size)).astype(np.float32))
                angles = torch.from_numpy(rng.uniform(0, 6.3, (q, d // 2)).astype(np.float32)).repeat(1, 2)
                outs = {
                    k: dec.forward(x, angles.cos(), angles.sin(), *caches[k], past, cnt, idx)
                    for k, dec in decoders.items()
                }
                a, b = outs.values()
                ca, cb = caches.values()
                same = torch.equal(a, b) and all(
                    torch.equal(s, t) for s, t in zip(ca[0] + ca[1], cb[0] + cb[1], strict=True)
                )
                differing += not same
                print(
                    f"  {threads} thread(s), {ctx} cached, {name} ({q} rows): "
                    f"{'bitwise identical' if same else 'DIFFERENT'}",
                    flush=True,
                )
    return differing


def timing(decoders: dict, model, contexts: list[int], rows: list[int], reps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    config = model.config
    d, nl, nkv = (
        model.model.layers[0].self_attn.head_dim,
        config.num_hidden_layers,
        config.num_key_value_heads,
    )
    none = torch.empty(0, dtype=torch.long)
    for ctx in contexts:
        cap = ctx + max(rows)
        caches = {}
        for k in decoders:
            gen = torch.Generator().manual_seed(ctx)
            caches[k] = [[torch.randn(1, nkv, cap, d, generator=gen) for _ in range(nl)] for _ in "kv"]
        for q in rows:
            x = torch.randn(q, config.hidden_size) * 0.5
            angles = torch.rand(q, d // 2).repeat(1, 2)
            cnt = torch.arange(ctx + 1, ctx + q + 1)
            times = {k: [] for k in decoders}
            for _ in range(reps + 1):  # the first round warms up
                for k, dec in decoders.items():
                    t0 = time.perf_counter()
                    dec.forward(x, angles.cos(), angles.sin(), *caches[k], ctx, cnt, none)
                    times[k].append(time.perf_counter() - t0)
            (a_name, a), (b_name, b) = ((k, statistics.median(v[1:])) for k, v in times.items())
            print(
                f"  {ctx} cached, {q} row(s): {a_name} {a * 1e3:.1f} ms, {b_name} {b * 1e3:.1f} ms, "
                f"ratio {b / a:.3f}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="HEAD", help="git revision whose decoder is the reference")
    ap.add_argument(
        "--variant",
        help="comma-separated -D flags: compare the checkout built with them (e.g. KQ_NO_AVX512) instead",
    )
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--random-weights", action="store_true", help="the pair's shapes with random weights")
    ap.add_argument("--check-contexts", default="37,300,2047", help="cache lengths of the bitwise check")
    ap.add_argument("--contexts", default="128,512,2048", help="cache lengths timed")
    ap.add_argument("--rows", default="1,4", help="query rows timed")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-timing", action="store_true", help="the bitwise check only")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    check_contexts = [int(c) for c in args.check_contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        new = native.build("dab_checkout", tmp / "build_new")
        if args.variant:
            reference = "checkout"
            old, new = new, native.build("dab_variant", tmp / "build_variant", tuple(args.variant.split(",")))
            print(f"variant {args.variant}: {new.isa()} path; checkout: {old.isa()}")
        else:
            reference = args.against
            old = native.build(
                "dab_reference", tmp / "build_ref", sources=revision_sources(args.against, tmp / "ref")
            )
        pair = load_pair(
            args.pair,
            weights="kquant",
            draft_weights="kquant-strict",
            progress=False,
            random_weights=args.random_weights,
        )
        load = os.getloadavg()
        print(
            f"CPU {platform.processor() or 'unknown'} ({native.cpu_signature().split('|')[1]}), "
            f"{args.threads} threads for timing, load {load[0]:.2f}; reference {reference}, "
            f"{'variant ' + args.variant if args.variant else 'checkout'} {ROOT}"
        )
        differing = 0
        for which in ("target", "draft"):
            model = getattr(pair, which)
            if lean.native_decoder(model) is None:
                print(f"{which}: no native decoder for this model (not all-kquant layers)")
                continue
            decoders = {
                reference: lean.build_decoder(old, model),
                args.variant or "checkout": lean.build_decoder(new, model),
            }
            print(f"{which}: bitwise check")
            differing += check(decoders, model, check_contexts)
            if not args.no_timing:
                print(f"{which}: timing (median of {args.reps}, interleaved)")
                timing(decoders, model, contexts, rows, args.reps, args.threads)
    if differing:
        print(f"{differing} comparison(s) differ: this change alters the decoder's arithmetic")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
