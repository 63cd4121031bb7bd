"""Engine benchmark on the real pair: autoregressive vs best static chain/tree vs transformers' assisted
generation, one prompt per language, greedy, everything measured side by side in one run.

1. Tune: a small static grid (chains and trees) on the *tune* prompts (never on the measured ones).
2. Measure: for each repetition, each measured prompt, each decoder in turn (interleaved, so machine
   drift hits all of them alike): tokens/s, accepted length, engine overhead; medians over repetitions.

    python benchmarks/bench_engine.py                      # default pair, 128 new tokens, 3 reps
    python benchmarks/bench_engine.py --pair tiny --quick  # plumbing check in seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from engine.backends.models import load_pair
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.sampling import SamplingConfig

MEASURE_PROMPTS = {
    "it": "Scrivi una funzione Python che restituisca i numeri primi minori di n, con una breve spiegazione.",
    "en": "Write a Python function that returns the prime numbers below n, with a short explanation.",
    "zh": "编写一个 Python 函数，返回小于 n 的所有质数，并附上简短的解释。",
    "es": "Escribe una función de Python que devuelva los números primos menores que n, con una breve explicación.",
}
TUNE_PROMPTS = {
    "it": "Spiega la differenza tra una lista e una tupla in Python, con un esempio.",
    "en": "Implement binary search in Python and explain its time complexity.",
    "zh": "用 Python 写一个函数，统计字符串中每个单词出现的次数。",
    "es": "Escribe una clase de Python que represente una pila con push, pop y peek.",
}


def run_ours(engine, ids, controller, max_new_tokens):
    res = engine.generate(ids, max_new_tokens=max_new_tokens, controller=controller, seed=0)
    st = res.stats
    return {
        "tokens": res.tokens,
        "n": len(res.tokens),
        "s": st["total_s"],
        "tps": st["tokens_per_s"],
        "accepted": st["mean_accepted"],
        "acc_rate": st["acceptance_rate"],
        "overhead": st["overhead_fraction"],
        "ctrl": st["controller_fraction"],
    }


def run_hf(pair, ids, max_new_tokens, assisted: dict | None):
    """transformers' generate, optionally with ``assistant_model=draft`` and the given schedule settings."""
    input_ids = torch.as_tensor([ids], device=pair.device)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(pair.eos_token_ids),
        pad_token_id=sorted(pair.eos_token_ids)[0],
        attention_mask=torch.ones_like(input_ids),
    )
    if assisted is not None:
        for key, value in assisted.items():  # heuristic schedules mutate these across calls: reset each time
            setattr(pair.draft.generation_config, key, value)
        kwargs["assistant_model"] = pair.draft
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.generate(input_ids, **kwargs)
    elapsed = time.perf_counter() - t0
    tokens = out[0, len(ids) :].tolist()
    return {"tokens": tokens, "n": len(tokens), "s": elapsed, "tps": len(tokens) / elapsed}


def tune(engine, tune_ids, grid, max_new_tokens) -> tuple[tuple[int, int, int], dict]:
    """Best (depth, verify, width) by total tokens / total time over the tune prompts."""
    scores = {}
    for depth, verify, width in tqdm(grid, desc="tune grid", leave=False):
        ctrl = StaticController(depth=depth, verify=verify, tree_width=width)
        runs = [run_ours(engine, ids, ctrl, max_new_tokens) for ids in tune_ids]
        scores[(depth, verify, width)] = sum(r["n"] for r in runs) / sum(r["s"] for r in runs)
    return max(scores, key=scores.get), scores


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tune-tokens", type=int, default=64, help="new tokens per tune-prompt run")
    ap.add_argument("--quick", action="store_true", help="tiny grid, 1 rep, 32 tokens")
    ap.add_argument("--chain-depths", default="3,4,5,6", help="static chain grid (verify = depth)")
    ap.add_argument("--tree-grid", default="4:6:2,5:8:2,4:8:3", help="depth:verify:width list, or 'none'")
    ap.add_argument("--decoders", default="all", help="comma list of decoders to measure (default all)")
    ap.add_argument("--out", default="runs/bench_engine.json")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.max_new_tokens, args.tune_tokens = 1, 32, 32

    pair = load_pair(args.pair, dtype=args.dtype)
    engine = SpeculativeEngine(pair, SamplingConfig(temperature=0.0))
    measure_ids = {lang: pair.encode(p) for lang, p in MEASURE_PROMPTS.items()}
    tune_ids = [pair.encode(p) for p in TUNE_PROMPTS.values()]

    # transformers 5.x defaults (GenerationConfig._get_default_generation_params); the confidence threshold
    # adapts during generation when scikit-learn is installed (it is a dev dependency here)
    hf_defaults = {
        "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4,
    }
    run_ours(engine, tune_ids[0], StaticController(2), 8)  # warm-up (allocator, kernels), not measured
    run_hf(pair, tune_ids[0], 8, dict(hf_defaults))

    chain_grid = [(int(d), int(d), 1) for d in args.chain_depths.split(",")]
    tree_grid = (
        []
        if args.tree_grid == "none"
        else [tuple(int(x) for x in c.split(":")) for c in args.tree_grid.split(",")]
    )
    if args.quick:
        chain_grid, tree_grid = chain_grid[:2], tree_grid[:2]
    best_chain, chain_scores = tune(engine, tune_ids, chain_grid, args.tune_tokens)
    best_tree, tree_scores = tune(engine, tune_ids, tree_grid, args.tune_tokens) if tree_grid else (None, {})
    print(f"tune (tokens/s on tune prompts): chains {chain_scores}\n trees {tree_scores}")
    print(f"tune: best chain {best_chain} best tree {best_tree}")

    decoders = {
        "autoregressive": lambda ids: run_ours(engine, ids, None, args.max_new_tokens),
        "static_chain": lambda ids: run_ours(engine, ids, StaticController(*best_chain), args.max_new_tokens),
        "static_tree": lambda ids: run_ours(engine, ids, StaticController(*best_tree), args.max_new_tokens),
        "hf_autoregressive": lambda ids: run_hf(pair, ids, args.max_new_tokens, None),
        "hf_assisted_default": lambda ids: run_hf(pair, ids, args.max_new_tokens, dict(hf_defaults)),
        "hf_assisted_heuristic": lambda ids: run_hf(
            pair,
            ids,
            args.max_new_tokens,
            {
                "num_assistant_tokens": 5,
                "num_assistant_tokens_schedule": "heuristic_transient",
                "assistant_confidence_threshold": 0.0,
            },
        ),
    }
    if best_tree is None:
        decoders.pop("static_tree")
    if args.decoders != "all":
        decoders = {k: v for k, v in decoders.items() if k in args.decoders.split(",")}
    raw = {name: {lang: [] for lang in measure_ids} for name in decoders}
    for rep in tqdm(range(args.reps), desc="reps"):
        for lang, ids in measure_ids.items():
            for name, fn in decoders.items():
                raw[name][lang].append(fn(ids))
        print(f"\n=== after repetition {rep + 1} of {args.reps}")
        report(raw, pair, args, best_chain, best_tree, chain_scores, tree_scores, hf_defaults)
    return 0


def report(raw, pair, args, best_chain, best_tree, chain_scores, tree_scores, hf_defaults) -> None:
    med = {
        name: {lang: statistics.median(r["tps"] for r in runs) for lang, runs in by_lang.items()}
        for name, by_lang in raw.items()
    }
    langs = list(next(iter(raw.values())))
    print(
        f"\npair={pair.name} dtype={str(pair.dtype).removeprefix('torch.')} device={pair.device} "
        f"torch={torch.__version__} transformers={transformers.__version__} cpu={platform.processor() or platform.machine()} "
        f"threads={torch.get_num_threads()} greedy max_new_tokens={args.max_new_tokens} reps={args.reps}"
    )
    print(
        f"best static chain (depth, verify, width)={best_chain}  best static tree={best_tree}  "
        f"hf assisted defaults={hf_defaults}"
    )
    print(f"\n{'decoder':24s}" + "".join(f"{lang:>10s}" for lang in langs) + f"{'all':>10s}{'vs AR':>8s}")
    ar_all = statistics.median(med["autoregressive"].values())
    totals = {
        name: sum(r["n"] for runs in by.values() for r in runs)
        / sum(r["s"] for runs in by.values() for r in runs)
        for name, by in raw.items()
    }
    for name in raw:
        all_med = statistics.median(med[name].values())
        print(
            f"{name:24s}"
            + "".join(f"{med[name][lang]:10.2f}" for lang in langs)
            + f"{all_med:10.2f}{all_med / ar_all:8.2f}x"
        )
    print("\n(tokens/s, median over reps per language; 'all' = median over languages)")
    print(
        "aggregate tokens/s (all tokens / all time): "
        + ", ".join(f"{n} {v:.3f} ({v / totals['autoregressive']:.2f}x)" for n, v in totals.items())
    )
    ours = [n for n in ("static_chain", "static_tree") if n in raw]
    best_ours = max(ours, key=lambda n: statistics.median(med[n].values()))
    for peer in (p for p in ("hf_assisted_default", "hf_assisted_heuristic") if p in raw):
        ratios = [med[best_ours][lang] / med[peer][lang] for lang in langs]
        print(
            f"{best_ours} / {peer}: per language {[round(r, 3) for r in ratios]}  median {statistics.median(ratios):.3f}"
        )
    for name in ours:
        acc = {lang: round(statistics.mean(r["acc_rate"] for r in raw[name][lang]), 3) for lang in langs}
        mean_acc = {lang: round(statistics.mean(r["accepted"] for r in raw[name][lang]), 2) for lang in langs}
        over = statistics.median(r["overhead"] for lang in langs for r in raw[name][lang])
        print(
            f"{name}: acceptance rate {acc}; mean accepted/cycle {mean_acc}; engine overhead "
            f"(time outside model forwards) median {over:.1%}"
        )
    ar_tokens = {lang: raw["autoregressive"][lang][0]["tokens"] for lang in langs}
    for name in raw:
        same = sum(runs[0]["tokens"] == ar_tokens[lang] for lang, runs in raw[name].items())
        print(f"greedy tokens identical to our autoregressive: {name}: {same}/{len(langs)} prompts")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    strip = {
        name: {
            lang: [{k: v for k, v in r.items() if k != "tokens"} for r in runs]
            for lang, runs in by_lang.items()
        }
        for name, by_lang in raw.items()
    }
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "best_chain": best_chain,
                "best_tree": best_tree,
                "chain_grid": {str(k): v for k, v in chain_scores.items()},
                "tree_grid": {str(k): v for k, v in tree_scores.items()},
                "median_tps": med,
                "raw": strip,
            },
            indent=1,
        )
    )
    print(f"raw results: {out}")


if __name__ == "__main__":
    sys.exit(main())
