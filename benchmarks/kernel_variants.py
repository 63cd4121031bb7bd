"""Compile-time variants of the K-quant kernels (``engine/backends/csrc``), timed side by side: each variant is built
with extra ``-D`` flags under its own module name, then every product runs on every variant in turn (so
drift hits all alike), on weights of the default target's shapes (random values: time does not depend
on them), several copies each so that a product streams its weights from memory as a decode step does,
not from the last-level cache. Prints the median time of one layer's products per row count and the
effective weight bandwidth; checks that every variant gives bitwise the same outputs.

    python benchmarks/kernel_variants.py --variant KQ_PREFETCH=0 --variant KQ_PREFETCH=2048
    python benchmarks/kernel_variants.py --variant '' --against main --rows 1,4   # this checkout against main
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

import torch

from engine.backends import native
from engine.backends.kquant import quantize_k4, quantize_k6, tiled_parts
from evaluation.kernel_revisions import revision_sources

# one layer of the default target (hidden 1536, MLP 8960; q/k/v as one product, gate/up as one) and a
# quarter of its LM head (151936 x 1536, k6)
SHAPES = [
    ("qkv", 1536 + 2 * 256, 1536, "k4"),
    ("o", 1536, 1536, "k4"),
    ("gate+up", 2 * 8960, 1536, "k4"),
    ("down", 1536, 8960, "k6"),
    ("head/4", 151936 // 4, 1536, "k6"),
]


def build(variant: str, directory: Path):
    """One variant: ``variant`` is comma-separated NAME=VALUE defines ('' = the sources as they are)."""
    name = "kqv_" + "".join(c if c.isalnum() else "_" for c in variant or "default")
    return native.build(name, directory / name, tuple(d for d in variant.split(",") if d))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="comma-separated NAME=VALUE defines of one build (repeat the flag for each variant; '' = as is)",
    )
    ap.add_argument("--rows", default="1,2,4,8", help="activation rows per product")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument(
        "--copies", type=int, default=6, help="weight copies per shape (larger than the L3 cache)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", help="a git revision whose kernels (its sources, as they are) run too")
    args = ap.parse_args(argv)
    if not args.variant:
        ap.error("name at least one --variant ('' = the sources as they are)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        modules = {v: build(v, Path(tmp)) for v in args.variant}
        if args.against:
            sources = revision_sources(args.against, Path(tmp) / "rev")
            modules[args.against] = native.build("kqv_revision", Path(tmp) / "kqv_revision", sources=sources)
        torch.manual_seed(0)
        weights = {}
        for name, n, k, kind in SHAPES:
            w = torch.randn(n, k) * 0.02
            base = quantize_k4(w) if kind == "k4" else quantize_k6(w)
            weights[name] = (n, k, kind, [tiled_parts(base, k) for _ in range(args.copies)])

        def run(module, x, name, i):
            n, k, kind, copies = weights[name]
            return getattr(module, f"{kind}_matmul")(x, *copies[i % len(copies)], None, k, n)

        nbytes = sum(t.numel() for _, _, _, copies in weights.values() for t in copies[0])
        load = os.getloadavg()
        print(
            f"CPU {platform.processor() or 'unknown'} ({native.cpu_signature().split('|')[1]}), "
            f"{args.threads} threads, load {load[0]:.2f}; {nbytes / 1e6:.1f} MB of weights per pass"
        )
        for m in [int(r) for r in args.rows.split(",")]:
            total = {v: 0.0 for v in modules}
            for name, (_, k, _, _) in weights.items():
                x = torch.randn(m, k)
                outs = {v: run(mod, x, name, 0) for v, mod in modules.items()}
                first = next(iter(outs.values()))
                for v, y in outs.items():
                    if not torch.equal(y, first):
                        raise SystemExit(f"variant {v!r} changes the outputs of {name} at {m} rows")
                times = {v: [] for v in modules}
                for i in range(args.reps):  # the order alternates: the first variant of a round runs slower
                    for v, mod in list(modules.items())[:: 1 if i % 2 == 0 else -1]:
                        t0 = time.perf_counter()
                        run(mod, x, name, i)
                        times[v].append(time.perf_counter() - t0)
                for v in modules:
                    total[v] += statistics.median(times[v])
            print(
                f"{m} row(s): "
                + "  ".join(
                    f"[{v or 'as is'}] {t * 1e3:.2f} ms ({nbytes / t / 1e9:.1f} GB/s)"
                    for v, t in total.items()
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
