"""A policy file against every baseline in the server replay (``envs.server``): system tokens/s at each
closed-loop load level and on the Poisson run whose rate rises and falls, on held-out traces (default: the
test split), with the per-load static table tuned on the tune split.

    python benchmarks/server_replay.py --policy runs/main/policy.pt
    python benchmarks/server_replay.py --policy runs/main/policy.pt --concurrency 1,2,4,8,16 --json runs/server_replay.json

Prints one row per controller (plain autoregressive, lookup-only, the static chain tuned at N=1, the
per-load table, the analytic controller given the load, the learned policy) and the learned policy's draft
length at each load level. The live counterpart is ``benchmarks/serve_load.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.config_flags import int_tuple
from engine.costs.cost_profile import load_profile_arg
from engine.costs.load_model import step_overhead_of
from engine.errors import InputError
from envs import workspace
from policies.learned import load_policy
from policies.learned_controller import trained_lookup
from training import load_training


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/server_replay.py", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--policy", required=True, help="exported policy file (policy.pt)")
    ap.add_argument("--concurrency", type=int_tuple, default=(1, 2, 4, 8), help="closed-loop load levels")
    ap.add_argument("--split", default="test", help="prompt split measured (default: test)")
    ap.add_argument("--prompts-per-language", type=int, default=4)
    ap.add_argument("--tune-split", default="tune", help="split the per-load table is tuned on")
    ap.add_argument("--tune-prompts-per-language", type=int, default=4)
    ap.add_argument("--max-requests", type=int, default=8, help="requests the server decodes at once")
    ap.add_argument(
        "--step-overhead-ms",
        type=float,
        default=None,
        help="a server step's cost beyond the profile's (default: a --profile fitted to a step log its own, "
        "else the policy's training setting)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=None, help="trace length (default: the policy's)")
    ap.add_argument(
        "--profile", default=None, help="cost profile file to charge the steps with (default: the policy's)"
    )
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    try:
        policy = load_policy(args.policy)
        profile, measured, tune = workspace.replay_inputs(
            policy, load_profile_arg(args.profile) if args.profile else None, args.cache_dir, args.split, args.prompts_per_language, args.tune_split,
            args.tune_prompts_per_language, max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
        lookup = trained_lookup(policy.meta)
        overhead = args.step_overhead_ms
        if overhead is None and "step_fit" in profile.meta:  # a profile fitted to a step log: its own
            overhead = 1e3 * step_overhead_of(profile)
        if overhead is None:
            overhead = load_training.trained_server(policy.meta)["step_overhead_ms"]
        setup = load_training.load_setup(
            tune,
            measured,
            profile,
            lookup,
            args.concurrency,
            args.max_requests,
            step_overhead_s=overhead / 1e3,
        )
    except (InputError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    load = load_training.load_report(setup, profile, policy.tree_width, policy.max_depth, policy)
    print(
        f"{len(measured)} {args.split} traces, per-load table tuned on {len(tune)} {args.tune_split} traces"
    )
    note = load_training.load_awareness(policy)
    if note:
        print(f"note: {note}")
    print("\n".join(load_training.load_summary(load, f"{args.split} traces")))  # the table train.py prints
    if args.json:
        Path(args.json).write_text(json.dumps(load, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
