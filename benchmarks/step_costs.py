"""Fit the server replay's step costs to a live server's step log: the batch axis of a cost profile made linear
(a target forward per sequence and per row, a draft forward per forward, sequence and row), a step overhead and
a prefill scale, by non-negative least squares over the logged steps (``envs.step_costs``), written as a
profile the server replay charges with.

    python serve.py --step-log runs/steps.jsonl ...   # under load, e.g. a row of benchmarks/serve_load.py
    python benchmarks/step_costs.py --log runs/steps.jsonl --profile runs/profile.json --out runs/fitted.json

Prints each fitted term and, per log and level (the most requests the server held: N clients of a closed
loop), the logged seconds and what the profile before and after the fit charges them. Several ``--log`` files
fit one profile (an autoregressive row's and a drafting row's, say: the drafting one informs the draft's
terms). ``benchmarks/replay_live.py`` checks the fitted profile's replay against another live run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.costs.cost_profile import load_profile_arg
from engine.errors import InputError
from envs.step_costs import MAX_GAP_S, TERMS, charged_steps, fit_steps, logged_steps
from serving.step_log import read_step_log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/step_costs.py", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--log", action="append", required=True, help="a step log (serve.py --step-log FILE); repeatable"
    )
    ap.add_argument(
        "--profile", required=True, help="the cost profile fitted (its single-sequence tables are kept)"
    )
    ap.add_argument("--out", required=True, help="write the fitted profile here")
    ap.add_argument("--tree-width", type=int, default=1, help="the server's --tree-width")
    ap.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="the step overhead the profile before the fit is charged with",
    )
    ap.add_argument(
        "--max-gap-ms",
        type=float,
        default=1e3 * MAX_GAP_S,
        help="a gap between steps up to this long counts as the step's (longer: the server idle)",
    )
    ap.add_argument(
        "--level",
        type=int,
        default=None,
        help="fit only the steps of this level (a diagnostic: what one load level's own steps say)",
    )
    ap.add_argument(
        "--check-log",
        action="append",
        default=[],
        help="a step log of another run: print what the profile before and after the fit charge its steps (held out)",
    )
    ap.add_argument("--json", default=None, help="write the terms and the errors per level here")
    args = ap.parse_args(argv)
    try:
        profile = load_profile_arg(args.profile)
        steps = []
        for path in args.log:
            lines = read_step_log(path)
            if not lines:
                raise InputError(f"--log {path}: no steps in it")
            steps += logged_steps(lines, args.max_gap_ms / 1e3, source=Path(path).name)
        if args.level is not None:
            steps = [step for step in steps if step.level == args.level]
        fit = fit_steps(steps, profile, args.tree_width, args.step_overhead_ms / 1e3)
        held_out = [
            step
            for path in args.check_log
            for step in logged_steps(read_step_log(path), args.max_gap_ms / 1e3, source=Path(path).name)
        ]
        check = charged_steps(held_out, profile, fit.profile, args.tree_width, args.step_overhead_ms / 1e3)
    except (InputError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(steps)} steps from {len(args.log)} log(s); terms (least squares, each >= 0):")
    for name in TERMS:
        value = fit.terms[name]
        shown = f"{value:.4f}" if name == "prefill_scale" else f"{1e3 * value:8.3f} ms"
        note = "" if name in fit.fitted_terms else "  (not in the log: the base table's)"
        print(f"  {name:22s} {shown}{note}")
    print("per log and level: steps, logged s, charged before / after the fit (error)")
    for e in fit.levels + (check.levels if held_out else []):
        print(
            f"  {e['log']:28s} N={e['level']:<3d} {e['steps']:5d} steps  {e['logged_s']:8.3f} s  "
            f"before {e['before_s']:8.3f} ({e['before_error']:+.1%})  fitted {e['fitted_s']:8.3f} "
            f"({e['fitted_error']:+.1%})"
        )
    fit.profile.meta["step_fit"]["logs"] = [str(p) for p in args.log]
    fit.profile.meta["step_fit"]["from_profile"] = str(args.profile)
    fit.profile.save(args.out)
    print(f"wrote {args.out}")
    if args.json:
        out = {
            "held_out": check.levels if held_out else [],
            "terms": fit.terms,
            "fitted_terms": list(fit.fitted_terms),
            "levels": fit.levels,
            "logs": args.log,
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
