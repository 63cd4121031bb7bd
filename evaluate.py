"""Evaluate controllers (autoregressive, static, heuristic, analytic, learned, transformers' assisted
generation) on the multilingual prompt suites and write a report.

Not implemented yet: this stub exists so the command line is stable. Until then,
benchmarks/bench_engine.py measures the engine against autoregressive decoding and transformers'
assisted generation.
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python evaluate.py", description=__doc__).parse_args(argv)
    print("evaluate.py: not yet implemented (lands with the evaluation issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
