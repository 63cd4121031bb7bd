"""Context lookup decided per request against the engine's one load limit, in the server replay.

Replays recorded traces (``python -m envs.record_traces``) through the server replay (``envs.server``) at
closed-loop load levels and prints each row's system tokens/s: autoregressive decoding; lookup only, at every
load and under the load limit; the static chain with lookup, both ways; the goodput controller
(``policies.goodput``) under the engine's limit and deciding lookup itself (``decides_lookup``); and, with
``--policy``, a learned policy as its file says. Times come from the cost profile (no clock), so it runs on a
busy machine and says the same each time; the traces' trajectories and acceptance are the real pair's.

    python -m envs.record_traces --prompts runs/gate/grounded_test.jsonl --out runs/gate/traces --max-new-tokens 128
    python benchmarks/lookup_gate.py --traces runs/gate/traces --profile runs/cache/<pair>/profile.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

from engine.batch_api import BatchConfig
from engine.config_flags import int_tuple
from engine.control import StaticController
from engine.costs.cost_profile import load_profile_arg
from engine.errors import InputError
from engine.lookup import LookupConfig, describe_lookup
from envs.replay import ReplayTrace
from envs.server import ServerReplay
from envs.server_runs import Arrivals
from envs.trace import Trace
from policies.goodput import GoodputController
from policies.learned import load_policy


def rows(profile, depth: int, policy_path: str | None) -> dict:
    """name -> (controller factory, lookup rule: "every" load, "limit" or None)."""
    out = {
        "autoregressive": (lambda: None, None),
        "lookup only, every load": (lambda: None, "every"),
        "lookup only, load limit": (lambda: None, "limit"),
        f"static ({depth}, {depth}) + lookup, every load": (lambda: StaticController(depth), "every"),
        f"static ({depth}, {depth}) + lookup, load limit": (lambda: StaticController(depth), "limit"),
        "goodput, lookup by the load limit": (lambda: GoodputController(profile, gate_lookup=False), "limit"),
        "goodput, lookup decided per request": (lambda: GoodputController(profile), "every"),
    }
    if policy_path:
        policy = load_policy(policy_path)
        gate = "decided per request" if policy.decides_lookup else "by the load limit"
        out[f"learned, lookup {gate}"] = (lambda: copy.copy(policy), "limit")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/lookup_gate.py", description=__doc__.split("\n")[0])
    ap.add_argument("--traces", required=True, help="directory of recorded chain traces (*.npz)")
    ap.add_argument("--profile", required=True, help="cost profile JSON with a batch axis")
    ap.add_argument("--concurrency", type=int_tuple, default=(1, 2, 4, 8), help="closed-loop load levels")
    ap.add_argument("--limit", type=int, default=2, help="the lookup's load limit of the 'load limit' rows")
    ap.add_argument("--depth", type=int, default=2, help="the static chain's depth (and verification size)")
    ap.add_argument("--max-requests", type=int, default=8, help="requests the server decodes at once")
    ap.add_argument("--policy", default=None, help="a learned policy file to replay too")
    ap.add_argument("--json", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)
    try:
        files = sorted(Path(args.traces).glob("*.npz"))
        if not files:
            raise InputError(f"no traces (*.npz) in {args.traces}")
        traces = [ReplayTrace(Trace.load(f)) for f in files]
        profile = load_profile_arg(args.profile)
        if not profile.batched:
            raise InputError(f"{args.profile} has no batch axis (measure_costs --batch-axis)")
        made = rows(profile, args.depth, args.policy)
    except (InputError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    every = LookupConfig()
    limited = LookupConfig(max_requests=args.limit)
    config = BatchConfig(max_requests=args.max_requests)
    print(
        f"{len(traces)} traces ({', '.join(t.trace.prompt_id for t in traces)}); lookup {describe_lookup(every)}, "
        f"limit @{args.limit}; profile {args.profile}"
    )
    table: dict[str, dict[int, float]] = {}
    for name, (make, rule) in made.items():
        lookup = {"every": every, "limit": limited, None: None}[rule]
        sim = ServerReplay(traces, profile, lookup, config)
        table[name] = {}
        for n in args.concurrency:
            run = sim.run(Arrivals.closed(n, max(len(traces), 2 * n)), make)
            table[name][n] = run.tokens_per_s
    width = max(len(name) for name in table)
    base = table["autoregressive"]
    print(
        f"{'system tokens/s (x autoregressive)':{width}}  "
        + "  ".join(f"N={n:<13}" for n in args.concurrency)
    )
    for name, row in table.items():
        cells = [f"{row[n]:6.2f} ({row[n] / base[n]:.2f}x)" for n in args.concurrency]
        print(f"{name:{width}}  " + "  ".join(f"{c:15}" for c in cells))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": table, "traces": [str(f) for f in files]}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
