"""Step times of the default pair through each instruction path of the compiled kernels, and through the int4
fallback, on this machine: what a CPU without AVX-512 (AVX2 path) or without AVX2 (portable path) would run.

Each path runs in its own process (torch reads ``ATEN_CPU_CAPABILITY`` at import), rounds alternate between
paths, and every line is one process: whole forwards (embedding, layers, final norm, LM head) of the target
and the draft at ``--context`` cached tokens, 1 and 4 rows, median of ``--reps``. Paths:

* ``avx512``: this machine's build (AVX-512 VNNI where the CPU has it);
* ``avx2``: the same sources built with ``-DKQ_NO_AVX512`` (bitwise the same outputs: tests/engine), with
  AVX-VNNI's dot products where the CPU has them;
* ``avx2-novnni``: also ``-DKQ_NO_AVXVNNI`` (vpmaddubsw + vpmaddwd: an AVX2 CPU without AVX-VNNI);
* ``portable``: built with ``-DKQ_NO_SIMD``;
* ``int4``: torch's int4/int8 weight-only kernels (the fallback format), torch's own dispatch;
* ``int4-avx2``: the same with ``ATEN_CPU_CAPABILITY=avx2`` (torch's AVX2 kernels).

    python benchmarks/isa_paths.py --rounds 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("avx512", "avx2", "avx2-novnni", "portable", "int4", "int4-avx2")
VARIANTS = {
    "avx2": ("KQ_NO_AVX512",),
    "avx2-novnni": ("KQ_NO_AVX512", "KQ_NO_AVXVNNI"),
    "portable": ("KQ_NO_SIMD",),
}


def one(path: str, context: int, reps: int, threads: int) -> str:
    import torch

    torch.set_num_threads(threads)
    from engine.backends import native

    if path in VARIANTS:
        native.use_variant(*VARIANTS[path])
    from engine.backends.kvcache import keep_entries, new_cache
    from engine.backends.models import load_pair
    from engine.forward import forward_logits

    int4 = path.startswith("int4")
    pair = load_pair(
        "qwen2.5-coder",
        weights="int4" if int4 else "kquant",
        draft_weights="int4-strict" if int4 else "kquant-strict",
        progress=False,
    )
    parts = [] if int4 else [native.kernels().isa()]
    for name, model in (("target", pair.target), ("draft", pair.draft)):
        cache = new_cache(model)
        forward_logits(model, list(range(100, 100 + context)), range(context), cache, pair.device, keep=1)
        for rows in (1, 4):
            times = []
            for _ in range(reps + 3):  # 3 warm-up
                t0 = time.perf_counter()
                forward_logits(model, [500] * rows, range(context, context + rows), cache, pair.device)
                times.append(time.perf_counter() - t0)
                keep_entries(cache, context, [])
            parts.append(f"{name} {rows} row(s) {statistics.median(times[3:]) * 1e3:.1f} ms")
    return f"{path:10s} " + ", ".join(parts) + f" | load {os.getloadavg()[0]:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=22)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one path in this process
    args = ap.parse_args()
    if args.one:
        print(one(args.one, args.context, args.reps, args.threads), flush=True)
        return 0
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        ap.error(f"unknown path(s) {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    print(f"CPU {cpu}, {args.threads} threads, {args.context} cached tokens, median of {args.reps}")
    for _ in range(args.rounds):
        for path in paths:
            env = dict(os.environ)
            if path == "int4-avx2":
                env["ATEN_CPU_CAPABILITY"] = "avx2"
            cmd = [sys.executable, __file__, "--one", path, "--context", str(args.context)]
            cmd += ["--reps", str(args.reps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = out.stdout.strip().splitlines()
            print(
                lines[-1] if out.returncode == 0 and lines else f"{path}: failed\n{out.stderr[-2000:]}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
