"""How much of the target's output a restricted draft head could propose: the share of the target tokens
of held-out traces that fall inside the kept vocabulary, for the two ways of choosing it.

* ``lowest``: the N lowest token ids (what ``--draft-vocab N`` keeps: in a byte-level BPE vocabulary the
  bytes, then merges in the order the tokenizer learned them, most frequent pair first on its corpus);
* ``counted``: the tokens counted on the train split (the train prompts' own tokens and the target tokens
  of the train traces), most frequent first, topped up with the lowest ids to N.

A draft cannot propose a token outside its head, so with greedy decoding a target token outside it is a
rejection (sampled decoding loses the same mass). A restricted head pays only if its coverage stays close
to 1 while it removes a large share of a draft step. Prints a table; no timing.

    python benchmarks/draft_vocab_coverage.py \\
        --train-traces runs/cache/qwen2.5-coder/cpu-kquant+kquant-strict-native/traces/greedy-w1-d8-n64-s0 \\
        --test-traces runs/cache/qwen2.5-coder/cpu-kquant+kquant-strict-native/traces/greedy-w1-d8-n128-s0
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np

from envs.prompts import language_of, load_suite
from envs.recording import load_traces


def kept_sets(counts: collections.Counter, sizes: list[int]) -> dict[str, dict[int, np.ndarray]]:
    """{"lowest": {N: ids}, "counted": {N: ids}}."""
    ranked = [t for t, _ in counts.most_common()]
    out: dict[str, dict[int, np.ndarray]] = {"lowest": {}, "counted": {}}
    for n in sizes:
        out["lowest"][n] = np.arange(n)
        keep = set(ranked[:n])
        fill = 0
        while len(keep) < n:
            keep.add(fill)
            fill += 1
        out["counted"][n] = np.array(sorted(keep))
    return out


def load_tokenizer(pair: str):
    """The tokenizer of a named pair, without loading its models."""
    if pair == "tiny":
        from engine.backends.tiny import build_tiny_pair

        return build_tiny_pair()[2]
    from transformers import AutoTokenizer

    from engine.backends.weights import ensure_default_pair

    target_dir, _ = ensure_default_pair(pair, progress=False)
    return AutoTokenizer.from_pretrained(str(target_dir))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--train-traces", nargs="+", required=True, help="trace folders (their train-split traces count)"
    )
    ap.add_argument("--test-traces", required=True, help="trace folder whose test-split traces are measured")
    ap.add_argument(
        "--pair", default="qwen2.5-coder", help="the pair whose tokenizer encodes the train prompts"
    )
    ap.add_argument("--sizes", default="4096,8192,16384,32768,65536")
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    tokenizer = load_tokenizer(args.pair)
    suite = load_suite()
    split = {p["id"]: p["split"] for p in suite}
    language = {p["id"]: language_of(p) for p in suite}
    counts: collections.Counter = collections.Counter()
    for p in suite:
        if p["split"] == "train":
            counts.update(tokenizer.encode(p["prompt"]))
    train_traces = 0
    for folder in args.train_traces:
        for trace in load_traces(folder):
            if split.get(trace.prompt_id) == "train":
                counts.update(int(t) for t in trace.tokens)
                train_traces += 1
    tokens, langs = [], []
    for trace in load_traces(args.test_traces):
        if split.get(trace.prompt_id) == "test":
            tokens.extend(int(t) for t in trace.tokens)
            langs.extend([language[trace.prompt_id]] * len(trace.tokens))
    if not tokens or not train_traces:
        ap.error("no test-split traces in --test-traces or no train-split traces in --train-traces")
    test, lang = np.array(tokens), np.array(langs)
    languages = sorted(set(langs))
    print(
        f"train: {sum(counts.values())} tokens ({len(counts)} distinct) from the train prompts and "
        f"{train_traces} traces; test: {len(test)} target tokens of {args.test_traces}"
    )
    print(f"{'N':>7s} {'rule':8s} {'all':>6s} " + " ".join(f"{x:>6s}" for x in languages))
    table = []
    for rule, by_size in kept_sets(counts, sizes).items():
        for n, keep in by_size.items():
            inside = np.isin(test, keep)
            row = {"size": n, "rule": rule, "all": float(inside.mean())}
            row.update({x: float(inside[lang == x].mean()) for x in languages})
            table.append(row)
            print(f"{n:7d} {rule:8s} {row['all']:6.3f} " + " ".join(f"{row[x]:6.3f}" for x in languages))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
