"""Context lookup drafting in exact replay: which ``LookupConfig`` pays, alone and under the controllers.

For every lookup setting of a small grid (``min_ngram``, ``max_ngram``, ``max_tokens``) this replays, on the
tune split: autoregressive decoding with lookup (lookup cycles where a proposal is found, autoregressive
steps elsewhere), the static (depth, size) grid with lookup, and each learned policy with lookup. It picks
the setting with the best tune throughput per controller, then reports the test split: each controller
without lookup, with its tune-picked setting, and with the default ``LookupConfig()``, relative to plain
autoregressive decoding, per language. ``--long`` uses the long suite (contexts near 2k tokens, 512 new
tokens). Timings come from the cost profile (no clock): run it anywhere, no quiet machine needed.

    python benchmarks/replay_lookup.py --policy runs/main-f4/policy.pt
    python benchmarks/replay_lookup.py --policy runs/main-f4/policy.pt --long --out runs/lookup-long.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from engine.control import StaticController
from engine.lookup import LookupConfig, describe_lookup
from envs import workspace
from envs.oracle import oracle_throughput, static_grid
from envs.prompts import LONG_SUITE, language_of, suite_split
from envs.replay import replay_generate, throughput
from policies.learned import load_policy

GRID = [
    LookupConfig(
        lo, hi, k, 0, 0
    )  # the short rule alone; the default (with the long-match rule) is reported too
    for lo, extra, k in itertools.product((1, 2, 3, 4), (0, 2), (1, 2, 3, 4, 6))
    for hi in (lo + extra,)
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", nargs="*", default=[], help="learned policy files to replay with lookup")
    ap.add_argument("--long", action="store_true", help="the long suite (512 new tokens) instead of the main")
    ap.add_argument("--prompts-per-language", type=int, default=12, help="test prompts a language")
    ap.add_argument("--tune-prompts-per-language", type=int, default=8)
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument("--out", help="write the numbers as JSON here")
    args = ap.parse_args()

    policies = {p: load_policy(p) for p in args.policy}
    pair = workspace.load_models("qwen2.5-coder")
    profile = workspace.ensure_profile(pair, args.cache_dir)
    suite = LONG_SUITE if args.long else None
    kw = {"temperature": 0.0, "tree_width": 1, "max_depth": 8, "max_new_tokens": 512 if args.long else 128}
    split = {}
    for name, count in (("tune", args.tune_prompts_per_language), ("test", args.prompts_per_language)):
        prompts = suite_split(name, count, suite)
        split[name] = (prompts, workspace.ensure_traces(pair, prompts, args.cache_dir, tag=name, **kw))
    languages = {p["id"]: language_of(p) for prompts, _ in split.values() for p in prompts}

    def run(controller_factory, traces, lookup):
        return [replay_generate(rt, controller_factory(), profile, lookup=lookup) for rt in traces]

    def static_factory(traces, lookup):
        grid = {
            key: tps
            for key, tps in static_grid(
                traces, profile, depths=range(1, 9), sizes=range(1, 9), lookup=lookup
            ).items()
            if key[1] <= key[0]  # a chain of d nodes: asking for more than d verifies d
        }
        grid[(0, 0)] = throughput(run(lambda: None, traces, lookup))  # "static depth 0": no drafting
        best = max(grid, key=grid.get)
        if best == (0, 0):
            return best, lambda: None
        return best, lambda: StaticController(best[0], best[1], tree_width=1)

    tune_traces, test_traces = split["tune"][1], split["test"][1]
    controllers = {"autoregressive": lambda: None}
    for path, policy in policies.items():
        controllers[f"learned {path}"] = lambda p=policy: p
    # the static setting is tuned per lookup setting: it is part of what the lookup changes
    results: dict[str, dict] = {}
    for name in [*controllers, "static (tuned)"]:

        def setup(lookup, name=name):  # (tuned static or None, controller factory) under ``lookup``
            if name == "static (tuned)":
                return static_factory(tune_traces, lookup)
            return None, controllers[name]

        made = {lookup: setup(lookup) for lookup in [None, *GRID]}
        tune_tps = {lookup: throughput(run(made[lookup][1], tune_traces, lookup)) for lookup in GRID}
        picked = max(tune_tps, key=tune_tps.get)
        rows = {}
        for label, lookup in (("no lookup", None), ("tune-picked", picked), ("default", LookupConfig())):
            best, factory = made[lookup] if lookup in made else setup(lookup)
            recs = run(factory, test_traces, lookup)
            by_lang = {}
            for rt, r in zip(test_traces, recs):
                by_lang.setdefault(languages[rt.trace.prompt_id], []).append(r)
            rows[label] = {
                "lookup": None if lookup is None else describe_lookup(lookup),
                "static": best,
                "tps": throughput(recs),
                "by_language": {lang: throughput(v) for lang, v in by_lang.items()},
                "lookup_share": sum(c.emitted for rs in recs for c in rs if c.lookup)
                / max(sum(c.emitted for rs in recs for c in rs), 1),
            }
        results[name] = rows
    ar = results["autoregressive"]["no lookup"]["tps"]
    ar_lang = results["autoregressive"]["no lookup"]["by_language"]
    print(
        f"{'long' if args.long else 'main'} suite: {len(test_traces)} test traces "
        f"({sum(rt.trace.num_positions for rt in test_traces)} positions), settings picked on "
        f"{len(tune_traces)} tune traces; profile {profile.meta.get('device_name')} {profile.meta.get('dtype')} "
        f"{profile.meta.get('num_threads')} threads; x = test throughput / autoregressive without lookup"
    )
    for name, rows in results.items():
        for label, row in rows.items():
            langs = " ".join(f"{k} {v / ar_lang[k]:.3f}" for k, v in sorted(row["by_language"].items()))
            extra = f" static {row['static']}" if row["static"] else ""
            print(
                f"  {name:40s} {label:11s} {row['lookup'] or '-':18s}{extra:16s} {row['tps'] / ar:.3f}x "
                f"({langs}) lookup tokens {row['lookup_share']:.0%}"
            )
    oracle = oracle_throughput(test_traces, profile)
    print(f"  oracle without lookup: {oracle / ar:.3f}x")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"results": results, "oracle_no_lookup": oracle, "autoregressive": ar}, indent=1, default=str
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
