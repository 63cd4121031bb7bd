"""Peer benchmark: llama.cpp on the same GGUF files the engine uses, autoregressive and speculative, greedy.

For each test-split prompt of the suite (chat template applied with our tokenizer, so llama.cpp sees the
same prompt tokens as our engine), every setting runs in turn, order rotated per prompt so machine drift
hits all settings alike:

* ``autoregressive``: ``llama-completion`` (``llama-cli`` in older llama.cpp) on the target alone;
* ``spec n=K p=P``: ``llama-speculative-simple`` with the draft model, at most K drafted tokens per cycle
  and draft probability threshold P (drafting stops early below it), over the --draft-max x
  --draft-p-min grid;
* ``lookup n=N m=M``: ``llama-speculative-simple --spec-type ngram-simple`` without a draft model: the
  latest earlier occurrence of the last N tokens proposes up to M following tokens (llama.cpp drafts
  nothing when fewer than N would follow, so M >= N), over --ngram (N,M pairs; none by default).

Decoding is greedy (``--temp 0 --top-k 1``) and stops at EOS like our engine (no ``--ignore-eos``).
Speeds are llama.cpp's own decode figures (prompt processing excluded): autoregressive ``eval time`` runs
per second, speculative ``decoded N tokens in S seconds``. ``llama-speculative-simple`` may end a few tokens
past ``-n`` (it checks the limit after a verified cycle); rates are per token, so this does not bias them.

The binaries come from ``--llama-bin DIR`` or the cache (``$DRAFTPILOT_CACHE``, default
``~/.cache/draftpilot``, under ``llama.cpp/<version>/bin``); when absent they are built once from the
llama.cpp sources vendored in the llama-cpp-python sdist on PyPI (cmake and a C++ compiler needed; about
10 minutes at -j1 on 2 cores). Without binaries, tools or network the script prints one ``skipped`` line
and exits 0.

    python benchmarks/llama_cpp.py                                    # 1 test prompt per language, 128 tokens
    python benchmarks/llama_cpp.py --prompts-per-language 3 --threads 2 --json runs/llama_cpp.json
    python benchmarks/llama_cpp.py --draft-max 4,8 --draft-p-min 0.5 --max-new-tokens 64
    python benchmarks/llama_cpp.py --llama-bin ~/src/llama.cpp/build/bin --no-build

The build, the runs and the parsers are library code (``peers.llama_cpp_build``,
``peers.llama_cpp``), which the evaluation's llama.cpp rows and benchmarks/serve_load.py use too;
this script is the command line over them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from engine.backends.weights import DEFAULT_PAIRS, WeightsError, fetch_gguf, pair_tokenizer
from engine.costs.measure_costs import device_name
from envs.prompts import LANGUAGES, interleave_languages, language_of, load_suite
from peers.llama_cpp import AUTOREGRESSIVE, LlamaCppRunError, LlamaSetting, parse_ngram, run_llama_cpp
from peers.llama_cpp_build import (
    COMPLETION_NAMES,
    SOURCE_PACKAGE,
    SOURCE_VERSION,
    SPECULATIVE_NAME,
    LlamaCppUnavailable,
    build_binaries,
    default_bin_dir,
    find_binaries,
    stale_build,
)


# ----------------------------------------------------------------------------------------------- report
def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def summarize(runs: list[dict], names: list[str]) -> dict[str, dict]:
    """Per setting: median tok/s over prompts, aggregate and per-language tok/s, acceptance."""
    out = {}
    for name in names:
        mine = [r for r in runs if r["setting"] == name]
        tokens = sum(r["decode_runs"] if "decode_runs" in r else r["tokens"] for r in mine)
        seconds = sum(r["decode_s"] for r in mine)
        row = {
            "prompts": len(mine),
            "median_tok_s": statistics.median(r["tok_s"] for r in mine),
            "aggregate_tok_s": tokens / seconds if seconds > 0 else float("nan"),
            "mean_tokens": statistics.mean(r["tokens"] for r in mine),
            "prefill_tok_s": (
                sum(r["prompt_tokens"] for r in mine) / sum(r["prompt_s"] for r in mine)
                if all(r.get("prompt_tokens", -1) > 0 and r.get("prompt_s") for r in mine)
                else None
            ),
            "languages": {},
        }
        for lang in dict.fromkeys(r["language"] for r in mine):
            part = [r for r in mine if r["language"] == lang]
            t = sum(r["decode_runs"] if "decode_runs" in r else r["tokens"] for r in part)
            s = sum(r["decode_s"] for r in part)
            row["languages"][lang] = t / s if s > 0 else float("nan")
        if all("agrees_with_ar" in r for r in mine):
            row["agrees_with_ar"] = sum(r["agrees_with_ar"] for r in mine)
        drafted = sum(r.get("n_drafted", 0) for r in mine)
        if drafted:
            row["accept"] = sum(r.get("n_accept", 0) for r in mine) / drafted
        out[name] = row
    return out


def print_table(summary: dict[str, dict], languages: list[str]) -> None:
    base = summary.get(AUTOREGRESSIVE.name, {}).get("aggregate_tok_s")
    head = (
        f"{'setting':22s} {'median':>8s} {'aggr.':>8s} {'vs AR':>6s} {'accept':>7s} {'tokens':>7s} "
        f"{'=AR':>5s} {'prefill':>8s}  "
    )
    print(head + "  ".join(f"{lang:>6s}" for lang in languages))
    for name, row in summary.items():
        ratio = f"{row['aggregate_tok_s'] / base:5.2f}x" if base else "     -"
        accept = f"{100 * row['accept']:6.1f}%" if "accept" in row else "      -"
        agree = f"{row['agrees_with_ar']}/{row['prompts']}" if "agrees_with_ar" in row else "-"
        print(
            f"{name:22s} {row['median_tok_s']:8.2f} {row['aggregate_tok_s']:8.2f} {ratio:>6s} {accept:>7s} "
            f"{row['mean_tokens']:7.1f} {agree:>5s} {row.get('prefill_tok_s') or float('nan'):8.1f}  "
            + "  ".join(f"{row['languages'].get(lang, float('nan')):6.2f}" for lang in languages)
        )
    print(
        "(decoding tok/s, prompt excluded; median over prompts; aggregate = sum tokens / sum decode time;\n"
        " per-language columns are aggregates; tokens = mean generated per prompt, EOS included;\n"
        " =AR: prompts whose text agrees with autoregressive up to the shorter one;\n"
        " prefill = prompt tokens / prompt-processing seconds, all prompts)"
    )


# ------------------------------------------------------------------------------------------------- main
def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def _ngram_list(text: str) -> list[tuple[int, int]]:
    try:
        return list(dict.fromkeys(parse_ngram(x) for x in text.split(",") if x.strip()))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _prob_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected probabilities in [0, 1], got {text!r}")
    return list(dict.fromkeys(values))


def skip(reason: str) -> int:
    print(f"llama.cpp benchmark skipped: {reason}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen2.5-coder", help="a pair of engine.backends.weights.DEFAULT_PAIRS")
    ap.add_argument(
        "--llama-bin",
        help="directory with llama-completion (or llama-cli) and "
        "llama-speculative-simple; default: the cache, built there if absent",
    )
    ap.add_argument("--no-build", action="store_true", help="never build llama.cpp; skip without binaries")
    ap.add_argument("--jobs", type=int, default=1, help="parallel compile jobs of a build (default 1)")
    ap.add_argument(
        "--suite",
        help="JSONL prompt suite (default: the built-in prompts/suite.jsonl; prompts/long.jsonl has "
        "~1.3-2.2k-token contexts: use --ctx-size 4096 --max-new-tokens 512)",
    )
    ap.add_argument("--split", default="test")
    ap.add_argument("--languages", default="it,en,zh,es")
    ap.add_argument("--prompts-per-language", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="-t and -tb (and the draft's) threads (default 2)")
    ap.add_argument("--ctx-size", type=int, default=2048)
    ap.add_argument(
        "--draft-max",
        type=_int_list,
        default=[4, 8, 16],
        metavar="K,K,...",
        help="maximum drafted tokens per cycle, the grid's first axis (default 4,8,16)",
    )
    ap.add_argument(
        "--draft-p-min",
        type=_prob_list,
        default=[0.0, 0.75],
        metavar="P,P,...",
        help="draft probability threshold, the grid's second axis (default 0,0.75)",
    )
    ap.add_argument(
        "--ngram",
        type=_ngram_list,
        default=[],
        metavar="N:M,N:M,...",
        help="n-gram lookup settings (ngram-simple: lookup N tokens, draft up to M >= N), e.g. 2:2,3:3",
    )
    ap.add_argument("--no-autoregressive", action="store_true", help="speculative settings only")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per llama.cpp run")
    ap.add_argument("--json", metavar="OUT", help="save conditions, summary and every run here")
    args = ap.parse_args(argv)
    for name in ("jobs", "prompts_per_language", "max_new_tokens", "threads", "ctx_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    languages = [x.strip() for x in args.languages.split(",") if x.strip()]

    if not languages or set(languages) - set(LANGUAGES):
        ap.error(
            f"--languages takes a comma-separated subset of {','.join(LANGUAGES)}, got {args.languages!r}"
        )

    if args.pair not in DEFAULT_PAIRS:
        ap.error(f"--pair must be one of {sorted(DEFAULT_PAIRS)}, got {args.pair!r}")

    bin_dir = Path(args.llama_bin).expanduser() if args.llama_bin else default_bin_dir()
    binaries = find_binaries(bin_dir)
    stale = None if args.llama_bin or binaries is None else stale_build(bin_dir)
    if stale and not args.no_build:
        print(f"llama.cpp in {bin_dir}: {stale}; building it again", flush=True)
        binaries = None
    if binaries is None:
        if args.no_build:
            return skip(f"no runnable {COMPLETION_NAMES[0]}/{SPECULATIVE_NAME} in {bin_dir} and --no-build")
        try:
            binaries = build_binaries(bin_dir, jobs=args.jobs)
        except (LlamaCppUnavailable, OSError, tarfile.TarError, StopIteration) as err:
            return skip(f"cannot build llama.cpp: {err}")

    target_spec, draft_spec = DEFAULT_PAIRS[args.pair]
    try:
        target, draft = fetch_gguf(target_spec, progress=False), fetch_gguf(draft_spec, progress=False)
        tokenizer = pair_tokenizer(args.pair)
    except (WeightsError, OSError) as err:
        return skip(f"cannot get the {args.pair} GGUF files or tokenizer: {err}")

    prompts = interleave_languages(
        load_suite(
            args.suite, split=args.split, languages=languages, limit_per_language=args.prompts_per_language
        )
    )
    if not prompts:
        ap.error(f"no {args.split} prompts for languages {languages}")
    settings = (
        ([] if args.no_autoregressive else [AUTOREGRESSIVE])
        + [LlamaSetting(n, p) for n in args.draft_max for p in args.draft_p_min]
        + [LlamaSetting(ngram=nm) for nm in args.ngram]
    )
    names = [s.name for s in settings]
    opts = dict(
        max_new_tokens=args.max_new_tokens, threads=args.threads, ctx_size=args.ctx_size, timeout=args.timeout
    )

    def formatted(text: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    version = binaries.version or {}
    print(
        f"llama.cpp {version.get('version', '?')} (build {version.get('build', '?')}, commit "
        f"{version.get('commit', '?')}) from {binaries.completion.parent}; {target.name} + {draft.name}; "
        f"{len(prompts)} {args.split} prompts x {len(settings)} settings, {args.max_new_tokens} tokens, "
        f"{args.threads} threads",
        flush=True,
    )
    load_before = _loadavg()
    if load_before and load_before[0] > 0.5:
        print(
            f"warning: load average {load_before[0]:.2f} > 0.5 at start: other work will skew the timings",
            file=sys.stderr,
            flush=True,
        )

    runs: list[dict] = []
    started = time.perf_counter()
    try:
        warm = formatted(prompts[0]["prompt"])  # page the model files in, not measured
        run_llama_cpp(binaries, AUTOREGRESSIVE, warm, target, **{**opts, "max_new_tokens": 4})
        if any(s.n_max for s in settings):
            run_llama_cpp(binaries, LlamaSetting(4), warm, target, draft, **{**opts, "max_new_tokens": 4})
        for index, item in enumerate(prompts):
            text = formatted(item["prompt"])
            n_prompt = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            shift = index % len(settings)
            for setting in settings[shift:] + settings[:shift]:
                run = run_llama_cpp(binaries, setting, text, target, draft, **opts)
                run.update(prompt_id=item["id"], language=language_of(item), prompt_tokens_ours=n_prompt)
                runs.append(run)
            mine = {r["setting"]: r for r in runs if r["prompt_id"] == item["id"]}
            if AUTOREGRESSIVE.name in mine:  # greedy: the texts agree up to the shorter one
                ar = mine[AUTOREGRESSIVE.name]["output"]
                for r in mine.values():
                    r["agrees_with_ar"] = ar.startswith(r["output"]) or r["output"].startswith(ar)
            print(
                f"[{index + 1}/{len(prompts)} {time.perf_counter() - started:5.0f} s] {item['id']}: "
                + ", ".join(f"{n} {mine[n]['tok_s']:.2f}" for n in names),
                flush=True,
            )
    except LlamaCppRunError as err:
        print(f"error: llama.cpp run failed: {err}", file=sys.stderr)
        return 1
    load_after = _loadavg()

    summary = summarize(runs, names)
    conditions = {
        "cpu": device_name(torch.device("cpu")),
        "logical_cpus": os.cpu_count(),
        "threads": args.threads,
        "load_before": load_before,
        "load_after": load_after,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "llama_cpp": version,
        "source": f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
        "bin_dir": str(binaries.completion.parent),
        "target": target.name,
        "draft": draft.name,
        "max_new_tokens": args.max_new_tokens,
        "ctx_size": args.ctx_size,
        "split": args.split,
        "prompts": len(prompts),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    load = " / ".join(f"{a[0]:.2f}" if a else "?" for a in (load_before, load_after))
    print(
        f"\nllama.cpp {version.get('version', '?')} (build {version.get('build', '?')}, commit "
        f"{version.get('commit', '?')}), {conditions['cpu']}, {args.threads} threads, load {load} "
        f"(before / after), {conditions['date']}"
    )
    print(
        f"{args.pair}: {len(prompts)} {args.split} prompts, greedy, <= {args.max_new_tokens} tokens "
        f"(stop at EOS), {conditions['wall_s']:.0f} s\n"
    )
    print_table(summary, languages)
    mismatched = sorted(
        {
            r["prompt_id"]
            for r in runs
            if r.get("prompt_tokens") is not None  # -1: spec
            and r["prompt_tokens_ours"] - r["prompt_tokens"] not in (0, 1)
        }
    )
    if mismatched:
        print(
            f"warning: llama.cpp's prompt token count differs from our tokenizer's on {mismatched}",
            file=sys.stderr,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "conditions": conditions,
                    "binaries": asdict(binaries),
                    "summary": summary,
                    "runs": runs,
                },
                indent=1,
                ensure_ascii=False,
                default=str,
            )
            + "\n"
        )
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
