"""Evaluate the drafting controllers live on the real engine and write a report.

Controllers: autoregressive; static chain and static tree at the best (depth, size) grid-searched on the
tune split (replay grid, top configurations confirmed live); transformers' +2/-1 heuristic; draft
confidence 0.4; the analytic cost model; the learned policy; transformers' assisted generation
(assistant_model=) with its default and its heuristic schedule; the hindsight oracle (replay, upper
bound). Controllers are interleaved prompt by prompt; figures per language and overall, with paired
bootstrap intervals; targets with pass/fail lines; load (--concurrency N); the learned policy and the load
baselines per load level in the server replay (--server-concurrencies, --no-server-replay); exactness audit.

    python evaluate.py                                  # full evaluation, newest runs/*/policy.pt
    python evaluate.py --quick                          # first look: 1 tune + 2 measured prompts per
                                                        # language, 64 tokens, 1 rep, confirm_top 1
    python evaluate.py --temperature 0.7 --concurrency 4 --controllers learned,static_chain,hf_assisted_default
    python evaluate.py exactness --quick                # only the exactness audit (exactness.md)
    python evaluate.py shift --out runs/shift           # static settings tuned on one slice (language,
                                                        # task, temperature), measured on another
    python evaluate.py --pair tiny --quick --policy runs/p/policy.pt   # plumbing check in seconds

Writes OUT/report.md, OUT/results.json (config, conditions, every raw measurement), OUT/*.png and
OUT/config.json, then prints where the report is and a short summary table.

The full run is hours on a CPU: give it an --out and every measured prompt is saved as it completes
(OUT/live_runs.partial.json); if it is interrupted (Ctrl-C, a crash, a machine that goes away), the same
command resumes it, keeping the static grid search and the measured prompts (--restart starts afresh).
A resume must measure the same thing: same settings, same policy file (path and sha256; without --policy
the newest runs/*/policy.pt, which must still be the one the partial run used). An --out that holds a
finished evaluation is not overwritten without --restart (which removes its report, results, figures and
config first). One evaluation at a time per --out: a second one fails at once (the directory is locked).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.backends.files import DirectoryLock, atomic_write_json
from engine.cli import CLI_ERRORS, ArgumentParser, report_error
from engine.config_flags import add_dataclass_args, apply_preset, from_args
from evaluation import shift, shift_config, shift_report
from evaluation.checkpoint import prepare_output, stored_config
from evaluation.config import QUICK, EvalConfig
from evaluation.eval_setup import Setup
from evaluation.report import summary_lines, write_exactness_report, write_report
from evaluation.runner import evaluate, exactness_only


def build_parser(prog: str = "python evaluate.py") -> argparse.ArgumentParser:
    ap = ArgumentParser(prog=prog, description=__doc__)
    add_dataclass_args(ap, EvalConfig)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="first look: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + " (explicit flags win)",
    )
    return ap


def config_from_argv(argv: list[str], prog: str = "python evaluate.py") -> EvalConfig:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    if args.quick:
        apply_preset(ap, args, argv, QUICK)
    return from_args(EvalConfig, args)


def shift_main(argv: list[str]) -> int:
    """``python evaluate.py shift``: the shift evaluation (``evaluation.shift``)."""
    ap = ArgumentParser(prog="python evaluate.py shift", description=shift.__doc__)
    add_dataclass_args(ap, shift_config.ShiftConfig)
    try:
        config = from_args(shift_config.ShiftConfig, ap.parse_args(argv))
        config.check()
        out = shift_config.check_out(config)
        with DirectoryLock(out, "output directory (--out)"):
            results = shift.run_shift(config)
            path = shift_report.write_shift_report(results, out)
    except (*CLI_ERRORS, ValueError) as err:
        return report_error(err)
    s = results["summary"]
    print(f"\nreport: {path}")
    print(
        f"  learned / static tuned on another slice (mean of {s['off_diagonal_cells']} cells): "
        f"{s['off_diagonal_mean']:.3f}x; lowest diagonal cell {s['diagonal_min']:.3f}x; lowest learned / "
        f"oracle {s['learned_over_oracle_min']:.3f}x"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "shift":
        return shift_main(argv[1:])
    audit_only = bool(argv) and argv[0] == "exactness"
    if audit_only:
        argv = argv[1:]
    try:
        config = config_from_argv(
            argv, "python evaluate.py exactness" if audit_only else "python evaluate.py"
        )
        # absolute paths, the policy file pinned: what config.json and a resume compare
        config = config.resolved()
        out = Path(config.out)
        config.check()
        with DirectoryLock(out, "output directory (--out)"):
            # every check before anything in --out changes: the output directory, then the inputs (prompts,
            # policy, models); only then an earlier evaluation is removed (--restart) and config.json written
            prepare_output(out, config, audit_only=audit_only, clear=False)
            setup = Setup(config)
            state = prepare_output(out, config, audit_only=audit_only)
            atomic_write_json(out / "config.json", stored_config(config), default=str)
            if audit_only:
                results = exactness_only(config, setup)
                path = write_exactness_report(results, out)
            else:
                results = evaluate(config, checkpoint=state, setup=setup)
                path = write_report(results, out)
                state.path.unlink(missing_ok=True)
    except (*CLI_ERRORS, ValueError) as err:  # a config dataclass refuses a value with ValueError
        return report_error(err)
    print(f"\nreport: {path}")
    if audit_only:
        for name, a in results["exactness"]["token_audit"].items():
            print(
                f"  greedy {name:16s} identical to autoregressive on {a['identical']}/{a['prompts']} prompts"
            )
        sampled = results["exactness"].get("sampled")
        if sampled:
            print(
                f"  sampled two-sample test ({sampled['controller_name']}): Fisher p = {sampled['fisher_pvalue']:.3g}"
            )
        return 0
    for line in summary_lines(results):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
