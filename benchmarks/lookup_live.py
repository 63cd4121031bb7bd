"""Context lookup settings side by side, live: autoregressive decoding on one engine per lookup setting (and
without lookup), interleaved prompt by prompt with the order rotated, greedy outputs checked identical to
plain autoregressive decoding. Prints decode tokens/s (first token excluded: the prefill is the same for all)
and end-to-end tokens/s per setting, per prompt and overall, with the CPU model, threads and load.

    python benchmarks/lookup_live.py --settings 3-4:2,on --prompts-per-language 2
    python benchmarks/lookup_live.py --settings 3-4:2,on --long --prompts-per-language 1 --out runs/lookup-live-long.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine.costs.measure_costs import device_name
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig
from engine.lookup import describe_lookup, parse_lookup
from envs import workspace
from envs.prompts import LONG_SUITE, interleave_languages, load_suite


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="3-4:2,on", help="comma-separated lookup settings (engine.lookup)")
    ap.add_argument("--long", action="store_true", help="the long suite (contexts near 2k tokens)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--prompts-per-language", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, help="default: 512 with --long, else 128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the numbers as JSON here")
    args = ap.parse_args()
    settings = {"off": None}
    for spec in (s.strip() for s in args.settings.split(",") if s.strip()):
        settings[describe_lookup(parse_lookup(spec))] = parse_lookup(spec)
    tokens = args.max_new_tokens or (512 if args.long else 128)
    pair = workspace.load_models("qwen2.5-coder", threads=args.threads)
    engines = {
        name: SpeculativeEngine(pair, config=EngineConfig(lookup=cfg)) for name, cfg in settings.items()
    }
    prompts = interleave_languages(
        load_suite(
            LONG_SUITE if args.long else None, split=args.split, limit_per_language=args.prompts_per_language
        )
    )
    print(
        f"CPU {device_name(pair.device)}, {args.threads} threads, load {os.getloadavg()[0]:.2f}; "
        f"{len(prompts)} {args.split} prompts{' (long suite)' if args.long else ''} x {tokens} tokens, greedy"
    )
    names, rows = list(engines), []
    for i, prompt in enumerate(prompts):
        ids = pair.encode(prompt["prompt"])
        order = names[i % len(names) :] + names[: i % len(names)]
        outs = {name: engines[name].generate(ids, max_new_tokens=tokens) for name in order}
        base = outs["off"].tokens
        for name in names:
            r = outs[name]
            decode_s = sum(c.draft_s + c.verify_s + c.controller_s + c.overhead_s for c in r.cycles)
            rows.append(
                {
                    "prompt": prompt["id"],
                    "setting": name,
                    "tokens": len(r.tokens),
                    "decode_s": decode_s,
                    "total_s": r.prefill_s + decode_s,
                    "identical": r.tokens == base,
                    "lookup_cycles": sum(c.lookup for c in r.cycles),
                }
            )
        line = "  ".join(
            f"{n} {sum(r['tokens'] - 1 for r in rows[-len(names) :] if r['setting'] == n) / sum(r['decode_s'] for r in rows[-len(names) :] if r['setting'] == n):.2f}"
            for n in names
        )
        print(f"  {prompt['id']:24s} decode tok/s: {line}", flush=True)
    summary = {}
    for name in names:
        mine = [r for r in rows if r["setting"] == name]
        summary[name] = {
            "decode_tokens_per_s": sum(r["tokens"] - 1 for r in mine) / sum(r["decode_s"] for r in mine),
            "tokens_per_s": sum(r["tokens"] for r in mine) / sum(r["total_s"] for r in mine),
            "identical": f"{sum(r['identical'] for r in mine)}/{len(mine)}",
            "lookup_cycles": sum(r["lookup_cycles"] for r in mine),
        }
    base = summary["off"]
    for name, s in summary.items():
        print(
            f"{name:12s} decode {s['decode_tokens_per_s']:.2f} tok/s ({s['decode_tokens_per_s'] / base['decode_tokens_per_s']:.3f}x), "
            f"end to end {s['tokens_per_s']:.2f} ({s['tokens_per_s'] / base['tokens_per_s']:.3f}x), identical "
            f"{s['identical']}, lookup cycles {s['lookup_cycles']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
