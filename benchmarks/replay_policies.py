"""Held-out comparison in exact replay: learned policies vs the static setting grid-searched on the tune
split, the analytic controller, autoregressive decoding and the hindsight oracle, on traces of prompts no
policy was trained or selected on (default: the test split).

    python benchmarks/replay_policies.py --policy runs/main/policy.pt runs/thr/policy.pt
    python benchmarks/replay_policies.py --policy runs/main/policy.pt --split test --prompts-per-language 3
    python benchmarks/replay_policies.py --policy runs/devices/policy.pt runs/on-b/policy.pt --profile b.json
    python benchmarks/replay_policies.py --policy runs/main/policy.pt --lookup off    # without context lookup
    python benchmarks/replay_policies.py --policy runs/devices/policy.pt --profile real.json \
        --features-profile random_weights.json    # conditioned on a random-weight profile of the device

Traces come from the shared cache (recorded on first use with the policy's width, depth and length).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.control import StaticController
from engine.costs.cost_profile import load_profile_arg
from engine.errors import InputError
from engine.lookup import describe_lookup, resolve_lookup
from envs.oracle import oracle_throughput, static_grid
from envs.replay import replay_generate, throughput
from envs.workspace import replay_inputs, trace_summary
from policies.analytic import AnalyticController
from policies.learned import load_policy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--policy", nargs="+", required=True, help="one or more policy.pt files (same width/depth)"
    )
    ap.add_argument("--split", default="test")
    ap.add_argument("--tune-split", default="tune")
    ap.add_argument("--prompts-per-language", type=int, default=2)
    ap.add_argument("--tune-prompts-per-language", type=int, default=2)
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument(
        "--profile",
        help="cost profile JSON of the device to compare on (every policy is conditioned on its device "
        "features, load_policy(profile=...)); default: the first policy's training profile",
    )
    ap.add_argument(
        "--features-profile",
        help="cost profile the policies and the analytic controller are conditioned on, when it is not the one "
        "times are charged from (--profile): e.g. the device measured with random weights "
        "(python -m engine.costs.measure_costs --random-weights), as where the real weights cannot be copied",
    )
    ap.add_argument(
        "--max-new-tokens", type=int, help="trace length (default: the first policy's training length)"
    )
    ap.add_argument(
        "--lookup",
        default="auto",
        help="context lookup on every row (engine.lookup: off, on, MIN-MAX:K, MIN-MAX:K+L:J; auto: the first "
        "policy's trained setting): autoregressive is then lookup alone, the statics are tuned with it and "
        "the oracle plans around its cycles",
    )
    ap.add_argument("--out", help="write the numbers as JSON here")
    args = ap.parse_args(argv)

    held_out = load_profile_arg(args.profile) if args.profile else None
    believed = load_profile_arg(args.features_profile) if args.features_profile else held_out
    policies = {p: load_policy(p, profile=believed) for p in args.policy}
    first = next(iter(policies.values()))
    try:
        lookup = resolve_lookup(args.lookup, first.trained_lookup)
    except InputError as err:
        ap.error(str(err))
    profile, measured, tune = replay_inputs(
        first,
        held_out,
        args.cache_dir,
        args.split,
        args.prompts_per_language,
        args.tune_split,
        args.tune_prompts_per_language,
        max_new_tokens=args.max_new_tokens,
    )

    grid = static_grid(tune, profile, lookup=lookup)
    best = max(grid, key=grid.get)

    def run(controller) -> float:
        return throughput([replay_generate(rt, controller, profile, lookup=lookup) for rt in measured])

    rows = {
        "autoregressive": run(None),
        f"static {best} (tuned on {args.tune_split})": run(
            StaticController(best[0], best[1], tree_width=first.tree_width)
        ),
        "analytic": run(AnalyticController(believed or profile, first.tree_width, first.max_depth)),
    }
    test_grid = static_grid(measured, profile, lookup=lookup)
    best_here = max(test_grid, key=test_grid.get)
    rows[f"static {best_here} (best on {args.split} itself: a bound for static)"] = test_grid[best_here]
    for path, ctrl in policies.items():
        reward = ctrl.meta["train_config"]["reward"]
        rows[f"learned {path} ({reward})"] = run(ctrl)
    rows["oracle"] = oracle_throughput(measured, profile, lookup=lookup)
    static = rows[f"static {best} (tuned on {args.tune_split})"]
    print(
        f"{trace_summary(measured, args.split, profile, lookup)}; width {first.tree_width}, depth {first.max_depth}"
    )
    for name, tps in rows.items():
        print(
            f"  {name:70s} {tps:8.3f} tok/s  {tps / rows['autoregressive']:.3f}x AR  {tps / static:.3f}x static"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "best_static_tune": best,
                    "split": args.split,
                    "policies": args.policy,
                    "profile": args.profile,
                    "features_profile": args.features_profile,
                    "lookup": describe_lookup(lookup),
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
