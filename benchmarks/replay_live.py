"""The server replay of a live load run's request stream against the live figures: for each row of a
``benchmarks/serve_load.py --json`` file that ran our server (autoregressive, or a static depth; with its
lookup, requests at once, row cap and prefill budgets), the replay of the same prompts' traces (recorded with
the same pair, greedy, the run's answer length), the same closed loop (N clients, the run's requests in the
run's order), with each cost profile given; prints replay / live system tokens/s per level.

    python benchmarks/replay_live.py --live runs/serve_load.json --profile before=runs/profile.json \\
        --profile fitted=runs/fitted.json

A profile fitted to a step log (``benchmarks/step_costs.py``) brings its own step overhead; any other is
charged ``--step-overhead-ms``. To check a fit honestly, fit it on one run's step logs and check it here on
another run's figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.batch_api import BatchConfig
from engine.control import StaticController
from engine.costs.cost_profile import load_profile_arg
from engine.costs.load_model import batch_table
from engine.errors import InputError
from engine.lookup import resolve_lookup
from envs.prompts import suite_split
from envs.server import ServerReplay
from envs.server_runs import Arrivals
from envs.workspace import ensure_traces, load_models


def row_settings(command: list[str]) -> argparse.Namespace:
    """The serve.py flags of a load run's row that the replay needs (the rest ignored)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--autoregressive", action="store_true")
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--verify", type=int, default=None)
    ap.add_argument("--tree-width", type=int, default=1)
    ap.add_argument("--lookup", default="auto")
    ap.add_argument("--max-requests", type=int, default=8)
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--max-prefill-tokens", type=int, default=BatchConfig.max_prefill_tokens)
    ap.add_argument("--idle-prefill-tokens", type=int, default=BatchConfig.idle_prefill_tokens)
    ap.add_argument("--no-prefix-cache", action="store_true")
    known, _ = ap.parse_known_args(command)
    if not known.autoregressive and known.policy not in ("none",):
        raise InputError(
            f"the replay check runs autoregressive and static rows (--policy none), not --policy {known.policy}"
        )
    if not known.no_prefix_cache:
        raise InputError("the replay check needs rows run with --no-prefix-cache (serve_load.py --cache off)")
    return known


def requests_at(level: int, prompts: int, min_requests: int) -> int:
    """The requests ``benchmarks/serve_load.py`` sends at closed-loop ``level`` (its rule)."""
    return max(min_requests, 2 * level, prompts if level == 1 else 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/replay_live.py", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--live", required=True, help="a benchmarks/serve_load.py --json file")
    ap.add_argument(
        "--profile", action="append", required=True, help="LABEL=PATH of a cost profile; repeatable"
    )
    ap.add_argument("--step-overhead-ms", type=float, default=0.1, help="for a profile without a fitted one")
    ap.add_argument("--cache-dir", default="runs/cache", help="the traces' cache")
    ap.add_argument("--max-depth", type=int, default=4, help="draft depth the traces are recorded to")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    try:
        live = json.loads(Path(args.live).read_text())
        run_args = live["args"]
        profiles = {}
        for spec in args.profile:
            label, eq, path = spec.partition("=")
            if not eq or not label or not path:
                raise InputError(f"--profile: expected LABEL=PATH, got {spec!r}")
            profiles[label] = load_profile_arg(path)
        rows = {
            row["name"]: row_settings(row["command"])
            for row in live["rows"]
            if row["name"].startswith("ours ")
        }
        if not rows:
            raise InputError(f"--live {args.live}: no row of our server")
        pair = load_models(run_args["pair"], threads=int(run_args["threads"]))
        prompts = suite_split(run_args["split"], int(run_args["prompts_per_language"]))
        traces = ensure_traces(
            pair, prompts, args.cache_dir, tree_width=1, max_depth=args.max_depth,
            max_new_tokens=int(run_args["max_tokens"]), tag=run_args["split"],
        )  # fmt: skip
    except (InputError, OSError, KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    figures = []
    print(
        f"{len(traces)} traces of {run_args['split']} prompts, {run_args['max_tokens']} tokens; live {live['conditions']}"
    )
    for name, settings in rows.items():
        lookup = resolve_lookup(settings.lookup)
        config = BatchConfig(
            max_requests=settings.max_requests,
            max_rows=settings.max_rows,
            max_prefill_tokens=settings.max_prefill_tokens,
            idle_prefill_tokens=settings.idle_prefill_tokens,
        )
        if settings.autoregressive:
            make = lambda: None  # noqa: E731
        else:
            depth, verify = settings.depth, settings.verify if settings.verify is not None else settings.depth
            make = lambda d=depth, v=verify, w=settings.tree_width: StaticController(d, v, w)  # noqa: E731
        entries = [
            e
            for e in live["results"]
            if e["row"] == name and e["mode"] == "closed" and e.get("tokens", 1) > 0
        ]
        for entry in sorted(entries, key=lambda e: (e["level"], e["repeat"])):
            level = int(entry["level"])
            arrivals = Arrivals.closed(level, requests_at(level, len(traces), int(run_args["min_requests"])))
            out = {"row": name, "level": level, "repeat": entry["repeat"], "live": entry["tok_s"]}
            for label, profile in profiles.items():
                fitted = "step_overhead_s" in (batch_table(profile).batched if batch_table(profile) else {})
                overhead = None if fitted else args.step_overhead_ms / 1e3
                sim = ServerReplay(traces, profile, lookup, config, step_overhead_s=overhead)
                out[label] = sim.run(arrivals, make).tokens_per_s
            figures.append(out)
            ratios = "  ".join(
                f"{label} {out[label]:7.2f} ({out[label] / out['live']:.3f})" for label in profiles
            )
            print(f"{name:16s} N={level:<3d} live {out['live']:7.2f}  replay: {ratios}", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"live": args.live, "profiles": args.profile, "figures": figures}, indent=1) + "\n"
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
