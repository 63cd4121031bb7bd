"""The measured roof of this CPU and our K-quant kernels as a share of it (issue 52).

Times are CPU seconds a thread (``time.process_time`` / threads), not wall time: on a shared machine a
product's wall time counts whatever else ran on its cores; wall medians are recorded too.

1. Peaks: tight in-register microkernels (``engine/backends/csrc/roof.cpp``, compiled through
   ``engine.backends.native.roof()`` with the kernels' flags, ``-march=native``) for every int8, bf16 and fp32
   multiply-accumulate path this CPU compiles (AVX2 vpmaddubsw, AVX-VNNI, AVX-512 VNNI, AVX-512 BF16, FMA);
   the best of ``--peak-reps`` short runs on one thread and on each of ``--threads`` running at once (a
   shared machine only ever lowers a run, so the best is the closest to the hardware); the roof of
   ``--threads`` cores is that rate times the threads. AMX tiles are reported as present or not; where
   they are, the kernels' AMX path is what runs many rows.
2. Products: our kernels (``k4_matmul`` / ``k6_matmul``) at 1, 4, 16, 64, 256, 1024 rows on random-weight k4
   (Q4_K) and k6 (Q6_K) tiles of the real shapes (target Qwen2.5-1.5B: hidden 1536, MLP 8960, q/o
   1536x1536, k/v 256x1536, LM head 151936x1536; draft Qwen2.5-0.5B: hidden 896, MLP 4864), next to torch's
   bf16 and fp32 ``F.linear`` and its int8 dynamic-quantisation linear (``int8_peer``) on the same shapes in the
   same run, interleaved; optionally a git revision's
   kernels (``--against main``: the sources of that revision, built alone) for before/after. Rates are
   2 * M * N * K / time (operations of the product, whatever the path computes) and each is printed as a share
   of the roof of its kind: int8 products (ours and torch's) of the int8 peak, bf16/fp32 ones of the fp32 FMA peak (a CPU with
   AVX-512 BF16 also gets the bf16 peak).

The LM head is timed on a slice of ``--head-rows`` of its 151936 outputs (the rate is per operation: a slice
of the same K streams and multiplies the same way). Products stream their weights from wherever they fit
(a layer's weights are 1-30 MB: L2/L3 at best), as a step does for the first rows.

    python benchmarks/roof.py [--against main] [--rows 1,4,16,64,256,1024] [--threads 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.backends import native
from engine.backends.kquant import quantize_k4, quantize_k6, tiled_parts
from evaluation.kernel_revisions import revision_sources

ROOT = Path(__file__).resolve().parents[1]


# (model, name, N outputs, K inputs, kind): the layers of one decoder layer (q/k/v and gate/up as the engine
# calls them: one product each) and the LM head; kinds as a Q4_K_M GGUF stores them (down and head Q6_K)
SHAPES = [
    ("target", "q", 1536, 1536, "k4"),
    ("target", "k", 256, 1536, "k4"),
    ("target", "v", 256, 1536, "k6"),
    ("target", "o", 1536, 1536, "k4"),
    ("target", "gate", 8960, 1536, "k4"),
    ("target", "up", 8960, 1536, "k4"),
    ("target", "down", 1536, 8960, "k6"),
    ("target", "head", 151936, 1536, "k6"),
    ("draft", "q", 896, 896, "k4"),
    ("draft", "k", 128, 896, "k4"),
    ("draft", "gate", 4864, 896, "k4"),
    ("draft", "down", 896, 4864, "k6"),
]
PEAKS = {
    "int8": ("int8_maddubs_i16", "int8_maddubs_i32", "int8_vnni256", "int8_vnni512"),
    "fp32": ("fp32_fma256", "fp32_fma512"),
    "bf16": ("bf16_dp512",),
}


def peaks(threads: int, reps: int) -> dict:
    """{path: {"1": GOPS one thread, "all": GOPS on every thread}} for the compiled paths."""
    mod = native.roof()
    out = {}
    for kind, names in PEAKS.items():
        for name in names:
            fn = getattr(mod, name)
            if fn(1, 1) < 0:
                continue
            row = {}
            for label, th in (("1", 1), ("all", threads)):
                best = 0.0
                for _ in range(reps):
                    t0 = time.process_time()
                    ops = fn(1_000_000, th)
                    best = max(best, ops / ((time.process_time() - t0) / th) / 1e9)
                row[label] = best
            out[name] = {"kind": kind, **row}
    return out


def int8_peer(w: torch.Tensor):
    """torch's int8 linear as dynamic quantisation runs it (``quantized::linear_dynamic``: int8 weights with one
    scale, the activations quantised to uint8 per call, ``torch.backends.quantized.engine``'s GEMM -- fbgemm or
    oneDNN on x86): a tuned int8 GEMM of the same shape, without the K-quant format's group scales and mins."""
    scale = float(w.abs().max()) / 127 or 1.0
    return torch.ops.quantized.linear_prepack(torch.quantize_per_tensor(w, scale, 0, torch.qint8), None)


def amx_state() -> str:
    flags = native.cpu_signature().split("|")[2].split()
    if "amx_int8" not in flags:
        return "no AMX on this CPU"
    return (
        "AMX granted: the kernels' AMX path runs 17+ rows"
        if native.kernels().amx()
        else "AMX present, not granted"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (the kernels split tiles over them)"
    )
    ap.add_argument("--reps", type=int, default=5, help="timed calls per product (median)")
    ap.add_argument("--peak-reps", type=int, default=15)
    ap.add_argument("--head-rows", type=int, default=151936 // 16, help="LM head outputs timed (a slice)")
    ap.add_argument("--against", help="git revision whose kernels are timed too (before/after)")
    ap.add_argument("--only", help="comma-separated model:name shapes (default: all)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's bf16/fp32 products")
    ap.add_argument("--out", help="write every number as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = SHAPES
    if args.only:
        want = set(args.only.split(","))
        shapes = [s for s in SHAPES if f"{s[0]}:{s[1]}" in want]
    model_name = native.cpu_signature().split("|")[1]
    print(f"CPU {model_name}, {args.threads} threads, torch {torch.__version__}, load {os.getloadavg()}")
    print(amx_state())

    ours = {"ours": native.kernels()}
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            ours = {
                args.against: native.build(
                    "roof_reference",
                    Path(tmp) / "ref_build",
                    sources=revision_sources(args.against, Path(tmp) / "ref"),
                ),
                **ours,
            }
        print(f"kernels: {', '.join(f'{k} ({m.isa()})' for k, m in ours.items())}")

        roof = peaks(args.threads, args.peak_reps)
        for name, p in roof.items():
            print(
                f"peak {name:18s} {p['kind']}: {p['1']:7.1f} GOPS one thread, {p['all']:7.1f} a thread "
                f"with {args.threads} running"
            )
        # the roof of `threads` cores: the per-thread rate measured with all of them running
        int8_roof = max(p["all"] for p in roof.values() if p["kind"] == "int8") * args.threads
        fp32_roof = max(p["all"] for p in roof.values() if p["kind"] == "fp32") * args.threads
        bf16_roof = max(
            [p["all"] * args.threads for p in roof.values() if p["kind"] == "bf16"] or [fp32_roof]
        )

        torch.manual_seed(0)
        results = []
        for model, name, n, k, kind in shapes:
            n_run = min(n, args.head_rows) if name == "head" else n
            w = torch.randn(n_run, k) * 0.02
            parts = tiled_parts(quantize_k4(w) if kind == "k4" else quantize_k6(w), k)
            w32, w16 = w.contiguous(), w.to(torch.bfloat16).contiguous()
            w8 = None if args.no_torch else int8_peer(w)
            for m in rows:
                x = torch.randn(m, k)
                x16 = x.to(torch.bfloat16)
                calls = {
                    key: partial(getattr(mod, f"{kind}_matmul"), x, *parts, None, k, n_run)
                    for key, mod in ours.items()
                }
                if len(ours) > 1:
                    first, *rest = (fn() for fn in calls.values())
                    for other in rest:
                        if not torch.equal(first, other):
                            raise SystemExit(
                                f"{model}:{name} at {m} rows: the kernels differ in their outputs"
                            )
                if not args.no_torch:
                    calls["torch-bf16"] = partial(F.linear, x16, w16)
                    calls["torch-fp32"] = partial(F.linear, x, w32)
                    calls["torch-int8"] = partial(torch.ops.quantized.linear_dynamic, x, w8)
                for fn in calls.values():
                    fn()
                times = {key: [] for key in calls}
                walls = {key: [] for key in calls}
                reps = args.reps if m * n_run * k < 4e9 else max(3, args.reps // 2)
                for i in range(reps):  # interleaved, the order alternating
                    for key, fn in list(calls.items())[:: 1 if i % 2 == 0 else -1]:
                        w0, c0 = time.perf_counter(), time.process_time()
                        fn()
                        c1, w1 = time.process_time(), time.perf_counter()
                        # CPU seconds per thread: what the product cost on the cores it ran on, whatever
                        # else the shared machine ran meanwhile (wall time is kept too)
                        times[key].append((c1 - c0) / args.threads)
                        walls[key].append(w1 - w0)
                ops = 2.0 * m * n_run * k
                line = {"model": model, "name": name, "N": n, "K": k, "kind": kind, "rows": m}
                parts_txt = []
                for key, ts in times.items():
                    med = statistics.median(ts)
                    gops = ops / med / 1e9
                    roof_of = {"torch-bf16": bf16_roof, "torch-fp32": fp32_roof}.get(key, int8_roof)
                    line[key] = {
                        "ms": med * 1e3,
                        "wall_ms": statistics.median(walls[key]) * 1e3,
                        "ms_min": min(ts) * 1e3,
                        "ms_max": max(ts) * 1e3,
                        "gops": gops,
                        "roof_share": gops / roof_of,
                    }
                    parts_txt.append(
                        f"{key} {med * 1e3:8.2f} ms {gops:6.1f} GOPS {100 * gops / roof_of:4.0f}%"
                    )
                results.append(line)
                print(
                    f"{model:6s} {name:5s} {n_run:6d}x{k:<5d} {kind} {m:5d} rows | " + " | ".join(parts_txt),
                    flush=True,
                )
    print(f"load after: {os.getloadavg()}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "cpu": model_name,
                    "machine": platform.machine(),
                    "threads": args.threads,
                    "torch": torch.__version__,
                    "amx": amx_state(),
                    "peaks_gops": roof,
                    "int8_roof_gops": int8_roof,
                    "fp32_roof_gops": fp32_roof,
                    "bf16_roof_gops": bf16_roof,
                    "products": results,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
