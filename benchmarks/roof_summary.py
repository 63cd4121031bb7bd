"""Sums ``benchmarks/roof.py --against REV --out FILE.json`` into per-model tables (docs/results): for each group
of products and row count, the products' median ms added up for the revision and for this checkout, the
speedup, and GOPS (the group's operations over that time) as a share of the int8 roof measured in the same
run (and, in brackets, of ``--reference-roof``); where the run timed torch's int8 linear, its GOPS and share too.

    python benchmarks/roof_summary.py roof.json [--against main] [--reference-roof 332] > summary.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

GROUPS = [
    ("target layer q+k+v+o+gate+up+down", "target", ("q", "k", "v", "o", "gate", "up", "down")),
    ("target k4 (q+k+o+gate+up)", "target", ("q", "k", "o", "gate", "up")),
    ("target k6 (v+down)", "target", ("v", "down")),
    ("target head (k6, the timed slice)", "target", ("head",)),
    ("draft q+k+gate+down", "draft", ("q", "k", "gate", "down")),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path)
    ap.add_argument("--against", default="main", help="the revision's key in the file")
    ap.add_argument("--reference-roof", type=float, default=332.0, help="GOPS (the first pass's roof)")
    args = ap.parse_args(argv)
    data = json.loads(args.json.read_text())
    roof, ref_roof = data["int8_roof_gops"], args.reference_roof
    print(
        f"int8 roof measured in this run {roof:.0f} GOPS (one thread); shares below of {roof:.0f}, "
        f"and of {ref_roof:.0f} in brackets\n"
    )
    for title, model, names in GROUPS:
        rows = defaultdict(lambda: {"ref": 0.0, "ours": 0.0, "ops": 0.0, "int8": 0.0})
        for p in data["products"]:
            if p["model"] != model or p["name"] not in names:
                continue
            # the operations of the timed product (the head: of its timed slice), as roof.py counted them
            ops = p["ours"]["gops"] * p["ours"]["ms"] * 1e6
            row = rows[p["rows"]]
            row["ref"] += p[args.against]["ms"]
            row["ours"] += p["ours"]["ms"]
            row["ops"] += ops
            row["int8"] += p["torch-int8"]["ms"] if "torch-int8" in p else float("nan")
        print(title)
        print(
            f"| rows | {args.against} ms | branch ms | speedup | {args.against} GOPS (roof) | branch GOPS (roof) "
            "| torch int8 GOPS (roof) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for m in sorted(rows):
            r = rows[m]
            g_ref, g_ours = r["ops"] / r["ref"] / 1e6, r["ops"] / r["ours"] / 1e6
            shares = [f"{g:.0f} ({100 * g / roof:.0f}% [{100 * g / ref_roof:.0f}%])" for g in (g_ref, g_ours)]
            g8 = r["ops"] / r["int8"] / 1e6  # nan where the run had no torch int8 column
            peer = "-" if g8 != g8 else f"{g8:.0f} ({100 * g8 / roof:.0f}%)"
            print(
                f"| {m} | {r['ref']:.2f} | {r['ours']:.2f} | {r['ref'] / r['ours']:.2f}x | {shares[0]} | {shares[1]} "
                f"| {peer} |"
            )
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
