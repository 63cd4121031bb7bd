"""Several learned policies side by side, live, in one sitting: every prompt runs autoregressive decoding,
the given static settings and every policy in turn (order rotated per prompt, so machine drift affects all
alike), then tokens/s, speedup over autoregressive and paired bootstrap ratios (over prompts) of each
policy against each static setting and against the other policies are printed, end to end (prefill +
decode: what a user waits for) and decode only (the cycles a controller decides; a speculative run also
prefills the draft, autoregressive decoding does not).

evaluate.py measures one policy against the grid-searched statics and the peers; this script answers
"which of these policies should be the default" (for example a chain policy against a tree policy).

    python benchmarks/compare_policies.py --policy runs/chain/policy.pt runs/main-v2/policy.pt \\
        --static 2,2,1 1,2,4 --prompts-per-language 2 --max-new-tokens 128 --out runs/compare.json
    python benchmarks/compare_policies.py --policy runs/int8/policy.pt --static 1,1,1 --weights int8

``--weights`` / ``--draft-weights``: the weight formats the pair runs in (the cost profile of that format
is measured once and cached, as for train.py, unless ``--profile`` names one).

``--static D,V,W``: a static setting (draft depth D, verify V nodes, tree width W; W 1 is a chain).

``--lookup``: context lookup drafting (engine.lookup) on the engine of every static setting and policy
("auto", the default: the first policy's trained setting, ``train.py --lookup``); a row of lookup alone
("autoregressive + lookup") is added, and the plain autoregressive row stays the reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine.control import StaticController
from engine.costs.cost_profile import load_profile_arg
from engine.engine import SpeculativeEngine
from engine.errors import InputError
from engine.inputs import EngineConfig
from engine.lookup import describe_lookup, resolve_lookup
from engine.sampling import SamplingConfig
from envs import workspace
from envs.prompts import language_of, suite_split
from evaluation.measurements import run_engine
from evaluation.stats import paired_bootstrap_ratio
from policies.analytic import AnalyticController
from policies.learned import load_policy
from policies.learned_controller import PolicyFileError


def parse_static(text: str) -> tuple[int, int, int]:
    try:
        depth, verify, width = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--static takes D,V,W (three integers), got {text!r}") from None
    if min(depth, verify, width) < 1:
        raise argparse.ArgumentTypeError(f"--static D,V,W must all be >= 1, got {text!r}")
    return depth, verify, width


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", nargs="+", required=True, help="policy.pt files")
    ap.add_argument(
        "--static",
        nargs="*",
        type=parse_static,
        default=[(2, 2, 1), (1, 2, 4)],
        metavar="D,V,W",
        help="static settings to compare with (default: chain 2,2,1 and tree 1,2,4)",
    )
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--weights",
        default="auto",
        help="the target's weight format (engine.backends.quant; auto: the default)",
    )
    ap.add_argument("--draft-weights", default="auto", help="the draft's weight format (auto: the default)")
    ap.add_argument(
        "--profile",
        help="cost profile JSON the policies are conditioned on (default: the cached one of the pair)",
    )
    ap.add_argument("--split", default="test")
    ap.add_argument("--prompts-per-language", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument(
        "--lookup",
        default="auto",
        help="context lookup on every static and learned row (off, on, MIN-MAX:K, MIN-MAX:K+L:J; auto: the "
        "first policy's trained setting)",
    )
    ap.add_argument(
        "--analytic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the analytic controller (chain, on the device's cost profile, with the same lookup)",
    )
    ap.add_argument("--out", help="write every run (without tokens) and the summary as JSON here")
    args = ap.parse_args(argv)

    if len(set(args.policy)) != len(args.policy):
        ap.error(f"--policy lists a file twice: {args.policy}")
    policy_widths, trained = {}, None  # trained: the first policy's lookup setting
    for path in args.policy:  # fail on a bad file before loading the models
        try:
            loaded = load_policy(path)
        except (FileNotFoundError, PolicyFileError) as err:
            ap.error(str(err))
        policy_widths[path] = loaded.tree_width
        if path == args.policy[0]:
            trained, max_depth = loaded.trained_lookup, loaded.max_depth
    try:
        lookup = resolve_lookup(args.lookup, trained)
        given_profile = load_profile_arg(args.profile) if args.profile else None
        pair = workspace.load_models(
            args.pair, threads=args.threads, weights=args.weights, draft_weights=args.draft_weights
        )
    except InputError as err:
        ap.error(str(err))
    widths = sorted({1, 2} | {w for _, _, w in args.static} | set(policy_widths.values()))
    profile = given_profile or workspace.ensure_profile(pair, args.cache_dir, widths=widths)
    sampling = SamplingConfig(temperature=0.0)
    plain = SpeculativeEngine(pair, sampling)
    engine = SpeculativeEngine(pair, sampling, EngineConfig(lookup=lookup)) if lookup else plain
    suffix = f" + lookup {describe_lookup(lookup)}" if lookup else ""
    controllers: dict[str, tuple] = {"autoregressive": (None, plain)}
    if lookup:
        controllers["autoregressive" + suffix] = (None, engine)
    for depth, verify, width in args.static:
        name = f"static {'chain' if width == 1 else 'tree'} ({depth},{verify},W{width}){suffix}"
        controllers[name] = (StaticController(depth, verify, tree_width=width), engine)
    if args.analytic:  # the cost-model controller on this device's profile: the baseline a policy must beat
        controllers[f"analytic (W1){suffix}"] = (AnalyticController(profile, 1, max_depth), engine)
    for path, width in policy_widths.items():  # reloaded with this device's profile as its device features
        controllers[f"learned {path} (W{width}){suffix}"] = (load_policy(path, profile=profile), engine)
    prompts = suite_split(args.split, args.prompts_per_language)
    names = list(controllers)
    warm = pair.encode(prompts[0]["prompt"])
    for name in names:  # warm-up, not measured
        controller, on = controllers[name]
        run_engine(on, warm, controller, 8, args.seed)

    started = time.perf_counter()
    runs: dict[str, dict[str, dict]] = {name: {} for name in names}
    for index, item in enumerate(prompts):
        ids = pair.encode(item["prompt"])
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            controller, on = controllers[name]
            run = run_engine(on, ids, controller, args.max_new_tokens, args.seed)
            run.update(language=language_of(item))
            runs[name][item["id"]] = run
        tps = {n: runs[n][item["id"]]["num_tokens"] / runs[n][item["id"]]["total_s"] for n in names}
        print(
            f"[{index + 1}/{len(prompts)} {time.perf_counter() - started:6.0f} s] {item['id']}: "
            + ", ".join(f"{n.split(' (')[0].removeprefix('learned ')} {v:.2f}" for n, v in tps.items()),
            flush=True,
        )

    ids = [p["id"] for p in prompts]

    def columns(name: str, key: str = "total_s") -> tuple[list[float], list[float]]:
        # total_s: end to end (prefill of both models + decode); decode_s: the cycles only, what a
        # controller decides (autoregressive decoding prefills the target alone, a speculative run both)
        return [runs[name][i]["num_tokens"] for i in ids], [runs[name][i][key] for i in ids]

    totals = {n: sum(columns(n)[0]) / sum(columns(n)[1]) for n in names}
    decode = {n: sum(columns(n, "decode_s")[0]) / sum(columns(n, "decode_s")[1]) for n in names}
    identical = {
        n: sum(runs[n][i]["tokens"] == runs["autoregressive"][i]["tokens"] for i in ids) for n in names
    }
    print(
        f"\n{pair.name} {pair.precision}, {len(ids)} {args.split} prompts x "
        f"{args.max_new_tokens} tokens, greedy, lookup {describe_lookup(lookup)}, one sitting "
        f"({time.perf_counter() - started:.0f} s)"
    )
    for name in names:
        print(
            f"  {name:60s} {totals[name]:7.3f} tok/s  {totals[name] / totals['autoregressive']:.3f}x AR  "
            f"(decode only {decode[name]:7.3f} tok/s  {decode[name] / decode['autoregressive']:.3f}x)  "
            f"tokens identical to AR {identical[name]}/{len(ids)}"
        )
    learned = [n for n in names if n.startswith("learned")]
    ratios, decode_ratios = {}, {}
    print("\npaired ratios over prompts, end to end | decode only (95% bootstrap intervals):")
    for a in learned:
        for b in names[1:]:
            if a == b or (b in learned and learned.index(b) < learned.index(a)):
                continue
            r = paired_bootstrap_ratio(*columns(a), *columns(b), resamples=args.bootstrap, rng=args.seed)
            d = paired_bootstrap_ratio(
                *columns(a, "decode_s"), *columns(b, "decode_s"), resamples=args.bootstrap, rng=args.seed
            )
            ratios[f"{a} / {b}"], decode_ratios[f"{a} / {b}"] = r, d
            print(
                f"  {a} / {b}: {r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}] | "
                f"{d['ratio']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"
            )
    if args.out:
        slim = {
            n: {i: {k: v for k, v in run.items() if k != "tokens"} for i, run in by.items()}
            for n, by in runs.items()
        }
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "tokens_per_s": totals,
                    "decode_tokens_per_s": decode,
                    "identical_to_ar": identical,
                    "ratios": ratios,
                    "decode_ratios": decode_ratios,
                    "runs": slim,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
