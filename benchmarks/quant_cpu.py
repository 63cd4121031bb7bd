"""Weight formats side by side on the CPU (engine.backends.quant): conversion error, cost curve, speed, exactness.

For each format, TARGET[/DRAFT][:N] (target format, draft format, draft LM head restricted to N tokens),
this loads the default pair and prints:

* conversion error of the linear weights against the GGUF-dequantized float32 weights (max |error|, mean
  relative error, which tensors went to int4 / int8);
* weight bytes a decode step reads, the machine's read bandwidth, and the bandwidth floor of a target
  step (bytes / bandwidth) next to the measured one-row target forward;
* the cost curve: target forward of k rows T(k)/T(1) (k = 1..8) and the draft's one-row step c = D(1)/T(1)
  at a fixed context, medians over reps, formats interleaved rep by rep;
* live decoding of the same prompts, formats interleaved prompt by prompt: autoregressive decode tok/s,
  a static chain's tok/s and whether its tokens equal autoregressive decoding of the same models (greedy
  identity), and greedy agreement of each format's autoregressive output with float32's (identical
  answers, and the mean share of the answer before the first differing token).

    python benchmarks/quant_cpu.py                                   # float32, int8, int4, int4/int4-strict
    python benchmarks/quant_cpu.py --formats int4,int4/int4-strict,int4/int4-strict:32768 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.backends.kvcache import keep_entries, new_cache
from engine.backends.models import load_pair
from engine.backends.quant import WEIGHT_FORMATS, weight_bytes
from engine.control import StaticController
from engine.costs.measure_costs import device_name
from engine.engine import SpeculativeEngine
from engine.forward import forward_logits
from engine.sampling import SamplingConfig
from envs.prompts import suite_split


def read_bandwidth_gbs(size_mb: int = 1024, reps: int = 5) -> float:
    """Read bandwidth with torch's threads: median GB/s of summing a float32 tensor of ``size_mb``."""
    x = torch.ones(size_mb * (1 << 20) // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def _prefilled(model, ids: list[int], ctx: int):
    cache = new_cache(model)
    with torch.inference_mode():
        forward_logits(model, ids[:ctx], range(ctx), cache, "cpu", keep=1)
    return cache


def forward_ms(model, cache, ids: list[int], ctx: int, rows: int) -> float:
    """One timed forward of ``rows`` tokens on a cache of ``ctx`` tokens (cut back to ``ctx`` after)."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        forward_logits(model, ids[ctx : ctx + rows], range(ctx, ctx + rows), cache, "cpu")
        elapsed = time.perf_counter() - t0
        keep_entries(cache, ctx, [])
    return elapsed * 1000


def cost_curves(pairs: dict, ctx: int, reps: int, max_rows: int) -> dict:
    """{format: {"T": {k: ms}, "D1": ms}}: medians over reps, formats interleaved rep by rep (each model's
    cache is prefilled once and cut back after every timed forward)."""
    ids = [1000 + (7 * i) % 5000 for i in range(ctx + max_rows)]
    caches = {f: (_prefilled(p.target, ids, ctx), _prefilled(p.draft, ids, ctx)) for f, p in pairs.items()}
    samples = {f: {"T": {k: [] for k in range(1, max_rows + 1)}, "D1": []} for f in pairs}
    for rep in range(reps):
        order = list(pairs) if rep % 2 == 0 else list(pairs)[::-1]
        for fmt in order:
            pair, (tcache, dcache) = pairs[fmt], caches[fmt]
            for k in range(1, max_rows + 1):
                samples[fmt]["T"][k].append(forward_ms(pair.target, tcache, ids, ctx, k))
            samples[fmt]["D1"].append(forward_ms(pair.draft, dcache, ids, ctx, 1))
    return {
        f: {"T": {k: statistics.median(v) for k, v in s["T"].items()}, "D1": statistics.median(s["D1"])}
        for f, s in samples.items()
    }


def error_summary(pair) -> dict:
    out = {}
    for role in ("target", "draft"):
        info = (pair.quant_info or {}).get(role)
        if not info:
            out[role] = None
            continue
        kinds: dict[str, int] = {}
        for m in info.values():
            key = f"{m['source']}->{m['kind']}"
            kinds[key] = kinds.get(key, 0) + 1
        numel = {name: m["shape"][0] * m["shape"][1] for name, m in info.items()}
        total = sum(numel.values())
        out[role] = {
            "max_abs_error": max(m["max_abs_error"] for m in info.values()),
            "mean_rel_error": sum(m["mean_rel_error"] * numel[n] for n, m in info.items()) / total,
            "tensors": kinds,
        }
    return out


def agreement(tokens: list[int], reference: list[int]) -> float:
    """Share of the reference answer before the first differing token (1.0 when identical)."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return 1.0 if tokens == reference else n / max(len(reference), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--formats",
        default="float32,int8,int4,int4/int4-strict",
        help="comma list of TARGET[/DRAFT][:DRAFT_VOCAB] weight formats (the first float32 one is the "
        "reference)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="cache length for the cost curve")
    ap.add_argument("--max-rows", type=int, default=8, help="cost curve: target forwards of 1..N rows")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts-per-language", type=int, default=1)
    ap.add_argument("--split", default="test")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chain", default="2,2", help="static chain D,V timed and checked for greedy identity")
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    specs = {}
    for f in formats:
        fmt, _, vocab = f.partition(":")
        target, _, draft = fmt.partition("/")
        if any(p not in WEIGHT_FORMATS for p in (target, draft or target)) or not (vocab or "0").isdigit():
            ap.error(f"bad format {f!r}: TARGET[/DRAFT][:N] with formats from {', '.join(WEIGHT_FORMATS)}")
        specs[f] = (target, draft or None, int(vocab or 0))
    try:
        depth, verify = (int(x) for x in args.chain.split(","))
    except ValueError:
        ap.error(f"--chain takes D,V, got {args.chain!r}")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"warning: load average {load_before[0]:.2f} before the run: timings will be noisy", flush=True)

    pairs = {}
    for f, (target, draft, vocab) in specs.items():
        t0 = time.perf_counter()
        pairs[f] = load_pair(
            "qwen2.5-coder", weights=target, draft_weights=draft, draft_vocab=vocab, progress=False
        )
        print(f"loaded {f} in {time.perf_counter() - t0:.1f} s", flush=True)
    bandwidth = read_bandwidth_gbs()
    conditions = {
        "cpu": device_name(torch.device("cpu")),
        "threads": args.threads,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_before": load_before,
        "read_bandwidth_gbs": round(bandwidth, 1),
    }
    print(f"conditions: {conditions}", flush=True)

    results: dict = {"conditions": conditions, "formats": {}}
    print("\nconversion error against the GGUF-dequantized float32 weights (linear layers):")
    for f, pair in pairs.items():
        errs = error_summary(pair)
        results["formats"][f] = {
            "errors": errs,
            "target_weight_bytes": weight_bytes(pair.target),
            "draft_weight_bytes": weight_bytes(pair.draft),
        }
        for role, e in errs.items():
            if e:
                print(
                    f"  {f:20s} {role:6s} max |err| {e['max_abs_error']:.3g}  mean rel err "
                    f"{e['mean_rel_error']:.4f}  {e['tensors']}"
                )
            else:
                print(f"  {f:20s} {role:6s} dense (no conversion beyond the float32 dequantisation)")

    curves = cost_curves(pairs, args.context, args.reps, args.max_rows)
    print(
        f"\ncost curve at context {args.context} (median of {args.reps}, ms): target T(k), ratio T(k)/T(1); "
        "draft D(1), c = D(1)/T(1); bandwidth floor of a target step = weight bytes / read bandwidth"
    )
    for f, cv in curves.items():
        t1 = cv["T"][1]
        floor_ms = results["formats"][f]["target_weight_bytes"] / (bandwidth * 1e9) * 1000
        results["formats"][f].update(cost=cv, c=cv["D1"] / t1, floor_ms=floor_ms)
        print(
            f"  {f:20s} T(1) {t1:6.1f}  "
            + " ".join(f"{cv['T'][k] / t1:.2f}" for k in range(2, args.max_rows + 1))
            + f"  | D(1) {cv['D1']:5.1f} c={cv['D1'] / t1:.3f} | floor {floor_ms:5.1f} ms "
            f"({results['formats'][f]['target_weight_bytes'] / 1e9:.2f} GB), T(1)/floor {t1 / floor_ms:.2f}"
        )

    prompts = suite_split(args.split, args.prompts_per_language)
    reference = next((f for f in formats if f.split("/")[0] == "float32"), None)
    engines = {f: SpeculativeEngine(p, SamplingConfig(temperature=0.0)) for f, p in pairs.items()}
    names = list(pairs)
    for f in names:  # warm-up
        engines[f].generate(
            pairs[f].encode("hi"), max_new_tokens=4, controller=StaticController(depth, verify)
        )
    runs: dict = {f: [] for f in names}
    started = time.perf_counter()
    for index, item in enumerate(prompts):
        shift = index % len(names)
        for f in names[shift:] + names[:shift]:
            ids = pairs[f].encode(item["prompt"])
            ar = engines[f].generate(ids, max_new_tokens=args.max_new_tokens)
            sp = engines[f].generate(
                ids, max_new_tokens=args.max_new_tokens, controller=StaticController(depth, verify)
            )
            runs[f].append(
                {
                    "id": item["id"],
                    "language": item.get("language"),
                    "ar_tokens": ar.tokens,
                    "chain_accepted": sp.stats["mean_accepted"],
                    "ar_decode_tps": ar.stats["decode_tokens_per_s"],
                    "ar_s": ar.stats["total_s"],
                    "ar_n": len(ar.tokens),
                    "chain_s": sp.stats["total_s"],
                    "chain_n": len(sp.tokens),
                    "chain_decode_tps": sp.stats["decode_tokens_per_s"],
                    "chain_identical": sp.tokens == ar.tokens,
                }
            )
        print(
            f"[{index + 1}/{len(prompts)} {time.perf_counter() - started:5.0f} s] {item['id']}: "
            + ", ".join(
                f"{f} AR {runs[f][-1]['ar_decode_tps']:.2f} chain {runs[f][-1]['chain_decode_tps']:.2f}"
                for f in names
            ),
            flush=True,
        )

    print(
        f"\nlive, {len(prompts)} {args.split} prompts x {args.max_new_tokens} tokens, greedy, formats interleaved "
        f"(decode tok/s: median over prompts; chain ({depth},{verify}))"
    )
    for f in names:
        rs = runs[f]
        ar_tps = statistics.median(r["ar_decode_tps"] for r in rs)
        ch_tps = statistics.median(r["chain_decode_tps"] for r in rs)
        ident = sum(r["chain_identical"] for r in rs)
        accepted = statistics.mean(r["chain_accepted"] for r in rs)
        line = (
            f"  {f:20s} AR {ar_tps:6.2f} tok/s ({1000 / ar_tps:5.1f} ms/token)  chain {ch_tps:6.2f} "
            f"({ch_tps / ar_tps:.2f}x AR, mean accepted {accepted:.2f})  chain tokens == AR tokens "
            f"{ident}/{len(rs)}"
        )
        summary = {
            "ar_decode_tps": ar_tps,
            "chain_decode_tps": ch_tps,
            "chain_identical": ident,
            "prompts": len(rs),
        }
        if reference and f != reference:
            agree = [agreement(r["ar_tokens"], ref["ar_tokens"]) for r, ref in zip(rs, runs[reference])]
            same = sum(a == 1.0 for a in agree)
            summary.update(identical_to_float32=same, agreement_to_float32=statistics.mean(agree))
            line += (
                f"  | vs float32: identical {same}/{len(rs)}, mean shared prefix {statistics.mean(agree):.2f}"
            )
        results["formats"][f]["live"] = summary
        print(line)
    results["conditions"]["load_after"] = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {results['conditions']['load_after'][0]:.2f}")
    if args.json:
        for f in names:
            results["formats"][f]["runs"] = [
                {k: v for k, v in r.items() if k != "ar_tokens"} for r in runs[f]
            ]
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
