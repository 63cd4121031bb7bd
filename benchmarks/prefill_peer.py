"""A cold prompt's prefill, ours next to llama.cpp's, on the same GGUF file, prompt and threads (issue 52).

For each prompt length (``--tokens``) and thread count (``--threads``), ``--repeats`` times, interleaved with
the order alternating: our engine's prefill of a prompt of exactly that many tokens
(``SpeculativeEngine.generate(ids, 1).prefill_s``: the target's prefill in the native decoder's 65-row chunks,
as a server request's prompt is prefilled; the draft's waits for a first drafting cycle; nothing cached) and llama.cpp's ``prompt eval time`` of the same text (``llama-completion -n 1``, its
own tokenisation of that text: its token count is printed). Each repeat uses another prompt (the suite's
train prompts from another offset), the same one for both. Prints prompt tokens per second for each, their
ratio per repeat (ours / llama.cpp) with its median and range, and the machine's load.

llama.cpp's binaries come from ``--llama-bin DIR`` or the cache (``benchmarks/llama_cpp.py`` builds them);
without them the script prints one ``skipped`` line and exits 0 (it never builds).

    python benchmarks/prefill_peer.py --tokens 512,1500 --threads 1,2 --repeats 3
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from functools import partial
from pathlib import Path

from engine.cli import ArgumentParser


def ours_times(engine, ids: list[int]) -> dict:
    """Our engine's cold prefill of ``ids``."""
    return {"ours_s": engine.generate(ids, 1).prefill_s}


def llama_times(binaries, text: str, target: Path, opts: dict) -> dict:
    """llama.cpp's prompt evaluation of ``text`` (one generated token)."""
    from peers.llama_cpp import AUTOREGRESSIVE, run_llama_cpp

    run = run_llama_cpp(binaries, AUTOREGRESSIVE, text, target, **opts)
    return {"llama_s": run["prompt_s"], "llama_tokens": run["prompt_tokens"]}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python benchmarks/prefill_peer.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--tokens", default="512,1500", help="comma-separated prompt lengths")
    ap.add_argument("--threads", default="2", help="comma-separated thread counts (both sides)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bin", default=None, help="llama.cpp's bin directory (default: the cache)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a llama.cpp run may take")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(
            f"--tokens and --threads take comma-separated integers, got {args.tokens!r}, {args.threads!r}"
        )
    if min(lengths) < 1 or min(threads) < 1 or args.repeats < 1:
        ap.error("--tokens, --threads and --repeats must be positive")

    from engine.backends.weights import DEFAULT_PAIRS, fetch_gguf, pair_tokenizer
    from envs.prompts import cold_prompts
    from peers.llama_cpp import LlamaCppRunError
    from peers.llama_cpp_build import default_bin_dir, find_binaries

    if args.pair not in DEFAULT_PAIRS:
        ap.error(f"--pair must be one of {sorted(DEFAULT_PAIRS)}, got {args.pair!r}")
    bin_dir = Path(args.llama_bin).expanduser() if args.llama_bin else default_bin_dir()
    binaries = find_binaries(bin_dir)
    if binaries is None:
        print(f"skipped: no llama.cpp binaries in {bin_dir} (benchmarks/llama_cpp.py builds them)")
        return 0
    import torch

    from engine.backends.models import load_pair
    from engine.engine import SpeculativeEngine

    target = fetch_gguf(DEFAULT_PAIRS[args.pair][0], progress=False)
    tokenizer = pair_tokenizer(args.pair)
    pair = load_pair(args.pair)
    engine = SpeculativeEngine(pair)
    print(
        f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} logical), torch {torch.__version__}, "
        f"load {os.getloadavg()[0]:.2f}; ours: {args.pair}; llama.cpp: {target.name} from {bin_dir}",
        flush=True,
    )
    results = []
    for n in lengths:
        prompts = cold_prompts(args.pair, n, args.repeats)
        for t in threads:
            torch.set_num_threads(t)
            opts = dict(max_new_tokens=1, threads=t, ctx_size=n + 64, timeout=args.timeout)
            ours_times(engine, prompts[0][:32])  # warm-up, both sides
            llama_times(binaries, tokenizer.decode(prompts[0][:32]), target, opts)
            for r, ids in enumerate(prompts):
                text = tokenizer.decode(ids)
                row = {"tokens": n, "threads": t, "repeat": r}
                sides = [
                    partial(ours_times, engine, ids),
                    partial(llama_times, binaries, text, target, opts),
                ]
                try:
                    for side in sides[:: 1 if r % 2 == 0 else -1]:
                        row.update(side())
                except LlamaCppRunError as err:
                    print(f"skipped: llama.cpp failed: {err}")
                    return 0
                row["ours_tok_s"] = n / row["ours_s"]
                row["llama_tok_s"] = row["llama_tokens"] / row["llama_s"]
                row["ratio"] = row["ours_tok_s"] / row["llama_tok_s"]
                row["load"] = os.getloadavg()[0]
                results.append(row)
                print(
                    f"{n} tokens, {t} thread(s), repeat {r}: ours {row['ours_tok_s']:6.1f} tokens/s "
                    f"({row['ours_s']:.2f} s), llama.cpp {row['llama_tok_s']:6.1f} tokens/s "
                    f"({row['llama_tokens']} tokens, {row['llama_s']:.2f} s), ratio {row['ratio']:.3f}, "
                    f"load {row['load']:.2f}",
                    flush=True,
                )
            rows = [x for x in results if x["tokens"] == n and x["threads"] == t]
            ratios = [x["ratio"] for x in rows]
            print(
                f"# {n} tokens, {t} thread(s): ours {statistics.median(x['ours_tok_s'] for x in rows):.1f} "
                f"tokens/s, llama.cpp {statistics.median(x['llama_tok_s'] for x in rows):.1f}; ours / llama.cpp "
                f"median {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
