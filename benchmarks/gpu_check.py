"""Every check that needs a GPU, in one run: CUDA correctness of the engine (one request at a time, and many
at once in the continuous-batching engine), device-synchronised timing and a cost profile of the default
pair's architecture, batch axis included.

Model weights cannot reach a borrowed accelerator, so correctness uses the tiny in-code pair (exact
float32 greedy identity, a sampled two-sample test; ``engine.batch.BatchedEngine`` with requests of every
controller in flight together, greedy and sampled, under a row cap that cuts verifications: each greedy
request's tokens equal ``SpeculativeEngine.generate`` of it alone) and timing uses the default pair's architecture with
random weights (forward time depends on shapes, dtype and kernels, not on weight values; acceptance
measured with random weights is meaningless, so no speedup is claimed here: replay the real traces with
the saved profile for that, e.g. ``python benchmarks/replay_baselines.py --profile OUT/profile.json --traces
runs/cache/qwen2.5-coder/cpu-float32/traces/greedy-w1-d8-n128-s0``).

    python benchmarks/gpu_check.py --out "$OUT"                      # on the GPU machine (~2-4 min)
    python benchmarks/gpu_check.py --device cpu --small --out /tmp/g  # plumbing check on a CPU (~1 min)

Writes ``OUT/gpu_check.json`` (every number), ``OUT/profile.json`` (the random-weight cost profile, with its
batched table: ``engine.costs.measure_costs`` with ``batch_axis``) and ``OUT/gpu_check.txt`` (the printed summary);
exits 1 if a correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.backends.models import load_pair
from engine.backends.random_pair import build_random_pair
from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest
from engine.control import StaticController
from engine.costs.measure_costs import device_name, measure_profile
from engine.costs.profile_config import ProfileConfig
from engine.engine import SpeculativeEngine
from engine.errors import DraftpilotError
from engine.results import GenerationResult
from engine.sampling import SamplingConfig
from evaluation.exactness import first_divergence, greedy_audit, law_checks, sampled_test
from policies.heuristic import HeuristicController

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=1023,
)
"""Overrides that shrink the random pair for ``--small`` (a CPU plumbing check of this script)."""
GREEDY_CONTROLLERS = {
    "static chain (4, 4)": lambda: StaticController(4, 4, tree_width=1),
    "static chain (8, 8)": lambda: StaticController(8, 8, tree_width=1),
    "static tree (3, 8, W 4)": lambda: StaticController(3, 8, tree_width=4),
    "static tree (5, 24, W 8)": lambda: StaticController(5, 24, tree_width=8),
    "heuristic (+2/-1)": lambda: HeuristicController(),
}
BATCH_CONTROLLERS = {
    "autoregressive": lambda: None,
    **GREEDY_CONTROLLERS,
}
"""Controllers of the greedy requests decoded together in ``batched`` (cycled over the requests)."""
TIMED = {
    "chain": [(d, d, 1) for d in (1, 2, 3, 4, 6, 8)],
    "tree": [(1, 2, 4), (2, 4, 4), (3, 8, 4), (4, 16, 4), (5, 32, 8), (6, 48, 8)],
}
"""Static (D, V, W) settings whose cycle time is measured live and compared with the profile's prediction."""


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, min(vocab, 256), (length,), generator=generator).tolist() for _ in range(count)]


def correctness(device: torch.device, args) -> dict:
    """Tiny pair on the device in float32: every controller's greedy tokens equal autoregressive decoding's,
    the sampled two-sample test, and the sampler's exact-law checks (with their negative control)."""
    pair = load_pair("tiny", dtype="float32", device=device, progress=False)
    engine = SpeculativeEngine(pair, SamplingConfig(temperature=0.0))
    ids = prompts(args.prompts, 24, 256, args.seed)
    tokens: dict[str, dict[str, list[int]]] = {name: {} for name in ("autoregressive", *GREEDY_CONTROLLERS)}
    for index, prompt in enumerate(ids):
        tokens["autoregressive"][str(index)] = engine.generate(prompt, max_new_tokens=48).tokens
        for name, make in GREEDY_CONTROLLERS.items():
            tokens[name][str(index)] = engine.generate(prompt, max_new_tokens=48, controller=make()).tokens
    audit = greedy_audit(tokens)
    sampled = sampled_test(
        pair,
        lambda: StaticController(3, 6, tree_width=2),
        [
            {"id": "s0", "prompt": "Write any one sentence about the sea."},
            {"id": "s1", "prompt": "def add(a, b):"},
        ],
        temperature=0.8,
        samples=args.samples,
        k=2,
        budget=6,
        seed=args.seed,
    )
    laws = law_checks(args.law_trials, args.seed)
    identical = all(row["identical"] == row["prompts"] for row in audit.values())
    return {
        "device": str(device),
        "greedy_audit": audit,
        "greedy_identical": identical,
        "sampled": sampled,
        "law_checks": laws,
        "ok": bool(identical and not sampled["rejects"] and all(c["ok"] for c in laws)),
    }


def batched(device: torch.device, args) -> dict:
    """Tiny pair on the device in float32, ``engine.batch.BatchedEngine``: ``--batch-requests`` greedy requests
    (every controller of the audit, and autoregressive) with half as many sampled speculative ones beside them,
    half of them joining after two steps, under a row cap that grants most verifications fewer nodes than asked.
    Every greedy request's tokens must equal ``SpeculativeEngine.generate`` of it alone; the sampled ones must
    finish (their draws differ from alone under cuts, their law is the target's: tests/engine/test_batch_law.py)."""
    pair = load_pair("tiny", dtype="float32", device=device, progress=False)
    engine = SpeculativeEngine(pair, SamplingConfig(temperature=0.0))
    count = args.batch_requests
    ids = prompts(count + count // 2, 24, 256, args.seed + 2)
    names = list(BATCH_CONTROLLERS)
    requests = [BatchRequest(ids[i], 48, BATCH_CONTROLLERS[names[i % len(names)]]()) for i in range(count)]
    requests += [
        BatchRequest(
            p, 48, StaticController(3, 6, tree_width=2), seed=args.seed + i, sampling=SamplingConfig(0.8)
        )
        for i, p in enumerate(ids[count:])
    ]
    config = BatchConfig(max_requests=len(requests), max_rows=2 * len(requests))
    batch = BatchedEngine(pair, config)
    order = list(range(0, len(requests), 2)) + list(range(1, len(requests), 2))  # both halves mix kinds
    index = {batch.add(requests[i]): i for i in order[: len(order) // 2]}
    results: dict[int, object] = {}  # request index -> GenerationResult, or the error it failed with
    steps, cycles = 0, 0
    t0 = time.perf_counter()
    while batch.active or batch.pending or steps < 2:
        if steps == 2:
            index.update({batch.add(requests[i]): i for i in order[len(order) // 2 :]})
        for event in batch.step():
            cycles += event.record is not None and event.record.depth > 0
            if event.finished:
                try:
                    results[index[event.rid]] = batch.result(event.rid)
                except DraftpilotError as err:
                    results[index[event.rid]] = err
        steps += 1
    batch_s = time.perf_counter() - t0
    done = {i: r for i, r in results.items() if isinstance(r, GenerationResult)}
    cut = sum(  # verifications granted fewer nodes than the controller asked (a static controller's verify)
        c.depth > 0 and c.num_verified < min(requests[i].controller.verify, c.num_drafted)
        for i, r in done.items()
        if isinstance(requests[i].controller, StaticController)
        for c in r.cycles
    )
    t0 = time.perf_counter()
    alone = {
        i: engine.generate(r.prompt, 48, BATCH_CONTROLLERS[names[i % len(names)]]()).tokens
        for i, r in enumerate(requests[:count])
    }
    alone_s = time.perf_counter() - t0
    rows = []
    for i in range(count):
        got = done[i].tokens if i in done else []
        rows.append(
            {
                "controller": names[i % len(names)],
                "identical": got == alone[i],
                "first_divergence": first_divergence(got, alone[i]),
                "error": None if i in done else repr(results.get(i)),
            }
        )
    identical = sum(row["identical"] for row in rows)
    return {
        "device": str(device),
        "greedy_requests": count,
        "sampled_requests": len(requests) - count,
        "max_rows": config.max_rows,
        "steps": steps,
        "speculative_cycles": cycles,
        "cut_verifications": cut,
        "identical": identical,
        "requests": rows,
        "sampled_finished": sum(i in done for i in range(count, len(requests))),
        "batch_s": batch_s,
        "greedy_alone_s": alone_s,
        "ok": identical == count and len(done) == len(requests),
    }


def batched_cost_summary(profile) -> dict:
    """The batch axis of the profile: per model, (sequences, rows in all) -> ms and the time over that many
    single-sequence forwards of the same rows each (below 1: one batched forward beats them)."""
    out = {"context": profile.batched["context"]}
    for model in ("target", "draft"):
        rows = []
        for sequences, total, seconds in profile.batched[model]:
            single = profile.batched_forward_s(model, 1, total // sequences)
            rows.append(
                {
                    "sequences": sequences,
                    "rows": total,
                    "ms": 1e3 * seconds,
                    "over_singles": seconds / (sequences * single),
                }
            )
        out[model] = rows
    return out


def timing(pair, profile, args) -> dict:
    """Live cycle times of static settings on the random pair (device-synchronised by the engine's clock)
    against the profile's prediction, plus autoregressive time per token and peak memory."""
    engine = SpeculativeEngine(pair, SamplingConfig(temperature=0.0))
    ids = prompts(args.timing_prompts, args.prompt_len, pair.target.config.vocab_size, args.seed + 1)
    engine.generate(ids[0], max_new_tokens=8)  # warm-up: kernels, allocator
    out: dict = {"prompt_len": args.prompt_len, "max_new_tokens": args.tokens, "settings": []}
    ar = [engine.generate(p, max_new_tokens=args.tokens) for p in ids]
    steps = [c.total_s for r in ar for c in r.cycles]
    out["autoregressive"] = {
        "per_token_s": statistics.median(steps),
        "tokens_per_s": sum(len(r.tokens) for r in ar) / sum(r.stats["total_s"] for r in ar),
        "peak_memory_mb": max(r.peak_memory_bytes for r in ar) / 2**20,
    }
    for kind, settings in TIMED.items():
        for depth, verify, width in settings:
            ctrl = StaticController(depth, verify, tree_width=width)
            runs = [engine.generate(p, max_new_tokens=args.tokens, controller=ctrl) for p in ids]
            cycles = [c for r in runs for c in r.cycles if c.depth > 0]
            live = statistics.median(c.total_s for c in cycles)
            predicted = statistics.median(
                profile.cycle_s(c.depth, c.num_verified, c.context_len, tree_width=width) for c in cycles
            )
            out["settings"].append(
                {
                    "kind": kind,
                    "depth": depth,
                    "verify": verify,
                    "tree_width": width,
                    "cycles": len(cycles),
                    "live_cycle_s": live,
                    "predicted_cycle_s": predicted,
                    "draft_s": statistics.median(c.draft_s for c in cycles),
                    "verify_s": statistics.median(c.verify_s for c in cycles),
                    "cycle_over_ar_step": live / out["autoregressive"]["per_token_s"],
                    "peak_memory_mb": max(r.peak_memory_bytes for r in runs) / 2**20,
                }
            )
    return out


def cost_summary(profile, contexts: tuple[int, ...]) -> dict:
    """How verification cost grows with the verified nodes and draft cost with the width, per context."""
    out = {}
    for ctx in contexts:
        one = profile.verify_s(1, ctx)
        out[str(ctx)] = {
            "c_ratio": profile.c_ratio(ctx),
            "verify_over_1_node": {
                str(v): profile.verify_s(v, ctx) / one
                for v in (2, 3, 4, 8, 16, 32, 64)
                if v <= max(profile.sizes)
            },
            "draft_step_over_width_1": {
                str(w): profile.draft_step_s(w, ctx) / profile.draft_step_s(1, ctx) for w in profile.widths
            },
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the random-weight pair (timing)")
    ap.add_argument("--pair", default="qwen2.5-coder", help="architecture of the random-weight pair")
    ap.add_argument("--small", action="store_true", help="shrink the random pair (CPU plumbing check)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check")
    ap.add_argument("--prompts", type=int, default=6, help="tiny-pair prompts of the greedy audit")
    ap.add_argument("--samples", type=int, default=300, help="samples per arm of the sampled test")
    ap.add_argument("--law-trials", type=int, default=20_000)
    ap.add_argument("--batch-requests", type=int, default=8, help="greedy requests of the batched check")
    ap.add_argument("--timing-prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per timed request")
    ap.add_argument("--contexts", default="128,512,1024,2048", help="profile contexts")
    ap.add_argument("--reps", type=int, default=5, help="profile repetitions")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("CUDA is not available here (use --device cpu --small for a plumbing check)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    report: dict = {"device": device_name(device), "torch": torch.__version__, "args": vars(args)}
    say(f"device {report['device']}, torch {torch.__version__}")
    report["correctness"] = check = correctness(device, args)
    say(
        f"[correctness, tiny pair float32 on {device}] greedy identical to autoregressive: "
        f"{'all' if check['greedy_identical'] else 'NOT all'} ({len(GREEDY_CONTROLLERS)} controllers x {args.prompts} "
        f"prompts); sampled test {args.samples}/arm Fisher p {check['sampled']['fisher_pvalue']:.3f} "
        f"({'REJECTS' if check['sampled']['rejects'] else 'no rejection'}); law checks "
        f"{sum(c['ok'] for c in check['law_checks'])}/{len(check['law_checks'])} as expected"
    )
    for name, row in check["greedy_audit"].items():
        if row["identical"] != row["prompts"]:
            say(
                f"  DIVERGES: {name}: {row['identical']}/{row['prompts']} identical, {row['divergences'][:2]}"
            )
    say(f"  ({time.perf_counter() - started:.0f} s)")
    report["batched"] = batch = batched(device, args)
    say(
        f"[batched engine, tiny pair float32 on {device}] {batch['identical']}/{batch['greedy_requests']} greedy "
        f"requests identical to alone, {batch['sampled_finished']}/{batch['sampled_requests']} sampled finished; "
        f"{batch['steps']} steps, {batch['cut_verifications']} verifications cut by the row cap "
        f"({batch['max_rows']} rows); {batch['batch_s']:.1f} s batched, {batch['greedy_alone_s']:.1f} s greedy alone"
    )
    for row in batch["requests"]:
        if not row["identical"]:
            why = row["error"] or f"at token {row['first_divergence']}"
            say(f"  DIVERGES in the batch: {row['controller']} {why}")

    dtype = getattr(torch, args.dtype)
    pair = build_random_pair(
        args.pair, dtype=dtype, device=device, seed=args.seed, overrides=SMALL if args.small else None
    )
    contexts = tuple(int(c) for c in args.contexts.split(","))
    if args.small:
        config = replace(ProfileConfig.quick(), batch_axis=True, batch_sequences=(1, 2, 4), batch_rows=(1, 4))
    else:
        config = ProfileConfig(contexts=contexts, reps=args.reps, batch_axis=True)
    profile = measure_profile(pair, config, random_weights=True, progress=False)
    profile.save(out_dir / "profile.json")
    report["cost"] = cost_summary(profile, profile.contexts)
    say(
        f"[cost profile, {pair.name} {args.dtype}, random weights] saved to {out_dir / 'profile.json'} "
        f"({time.perf_counter() - started:.0f} s)"
    )
    for ctx, row in report["cost"].items():
        verify = ", ".join(f"{v}:{r:.2f}" for v, r in row["verify_over_1_node"].items())
        draft = ", ".join(f"W{w}:{r:.2f}" for w, r in row["draft_step_over_width_1"].items())
        say(f"  context {ctx}: c {row['c_ratio']:.3f}; verify nodes/1 node {verify}; draft step {draft}")
    report["batched_cost"] = table = batched_cost_summary(profile)
    for model in ("target", "draft"):
        cells = ", ".join(
            f"S{r['sequences']}x{r['rows'] // r['sequences']}: {r['ms']:.2f} ms ({r['over_singles']:.2f})"
            for r in table[model]
        )
        say(f"  batched {model} forwards at context {table['context']} (/ S single forwards): {cells}")

    report["timing"] = timed = timing(pair, profile, args)
    ar = timed["autoregressive"]
    say(
        f"[timing, {args.timing_prompts} prompts of {args.prompt_len} tokens x {args.tokens}] autoregressive "
        f"{1e3 * ar['per_token_s']:.2f} ms/token ({ar['tokens_per_s']:.1f} tok/s), peak {ar['peak_memory_mb']:.0f} MB"
    )
    for row in timed["settings"]:
        say(
            f"  {row['kind']:5s} D {row['depth']} V {row['verify']:2d} W {row['tree_width']}: cycle "
            f"{1e3 * row['live_cycle_s']:.2f} ms live, {1e3 * row['predicted_cycle_s']:.2f} ms profile "
            f"({row['live_cycle_s'] / row['predicted_cycle_s']:.2f}); {row['cycle_over_ar_step']:.2f} AR steps"
        )
    report["wall_s"] = time.perf_counter() - started
    ok = check["ok"] and batch["ok"]
    say(f"done in {report['wall_s']:.0f} s; correctness {'OK' if ok else 'FAILED'}")
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out_dir / "gpu_check.txt").write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
