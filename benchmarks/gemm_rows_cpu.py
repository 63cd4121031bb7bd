"""Why verification cost jumps on this CPU: time of one linear layer of the target against the number of
rows (tokens) it processes, with torch's default kernel and with MKL's packed sgemm.

The cost profile shows verifying 3 draft nodes (4 rows with the bonus row) costs about twice as much as
verifying 2; speculative decoding assumes verification is memory-bound (flat in rows) and here it is
not, beyond 3 rows. This isolates the cause in the GEMM: for each row count M it times
``F.linear(x[M, K], W[N, K])`` (torch's default path) and MKL's packed GEMM (weights re-laid out once for a
batch of exactly P rows, input zero-padded to P rows), at the shapes of Qwen2.5-1.5B's MLP (K 1536,
N 8960) unless told otherwise. Medians of ``--reps`` timed calls after two warm-up calls; a float32
weight of this shape is 55 MB, far beyond cache, so each call streams it from memory.

    python benchmarks/gemm_rows_cpu.py [--rows 1,2,3,4,6,8,12,16] [--packs 4,8,16] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,24,32", help="row counts M to time")
    ap.add_argument("--packs", default="4,8,16", help="batch sizes P of MKL packed weights (empty: none)")
    ap.add_argument("--in-features", type=int, default=1536)
    ap.add_argument("--out-features", type=int, default=8960)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(x) for x in args.rows.split(",") if x]
    packs = [int(x) for x in args.packs.split(",") if x]
    if packs and not torch.backends.mkl.is_available():
        print("this torch build has no MKL: packed GEMM skipped")
        packs = []
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(args.out_features, args.in_features, generator=gen)
    packed = {p: torch.ops.mkl._mkl_reorder_linear_weight(weight, p) for p in packs}
    print(
        f"linear {args.in_features} -> {args.out_features}, float32, {args.threads} threads; ms per call "
        f"(median of {args.reps}); packed P: rows zero-padded to P (n/a when M > P)"
    )
    print(f"{'M':>3} {'default':>8} " + " ".join(f"{'packed' + str(p):>9}" for p in packs) + "   default/M=1")
    base = None
    for m in rows:
        x = torch.randn(m, args.in_features, generator=gen)
        with torch.inference_mode():
            plain = median_ms(lambda x=x: F.linear(x, weight), args.reps)
            base = base or plain
            cells = []
            for p in packs:
                if m > p:
                    cells.append(f"{'n/a':>9}")
                    continue
                xp = torch.cat([x, x.new_zeros(p - m, x.shape[1])]) if m < p else x
                ms = median_ms(
                    lambda xp=xp, p=p: torch.ops.mkl._mkl_linear(xp, packed[p], weight, None, p), args.reps
                )
                cells.append(f"{ms:9.2f}")
        print(f"{m:>3} {plain:8.2f} " + " ".join(cells) + f"   {plain / base:6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
