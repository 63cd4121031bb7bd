"""Choose the default CPU dtype by measurement: float32 vs bfloat16 on the default real pair.

For each model (target, draft) and dtype this times, after warm-up, the three forwards the engine
issues: (a) one-token decode on top of a ~200-token cache, (b) a 16-token verification block on the same
cache (logits for every row), (c) a 200-token prefill (last logit only, as the engine asks for). Both
dtypes are loaded at once and timed alternately, rep by rep, so they share the machine's background
load; medians and minima of `--reps` reps are printed with the bf16/fp32 ratio. It then checks whether greedy decoding in bf16 emits the same tokens as in float32.

    python benchmarks/dtype_cpu.py [--reps 7] [--context 200] [--block 16] [--new-tokens 32] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from engine.backends.weights import ensure_default_pair

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPT = "Explain in two sentences why the sky is blue."


def _time_s(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()  # CPU: the call returns when the work is done, no device sync needed
    return time.perf_counter() - start


@torch.inference_mode()
def forward_cases(model, context: int, block: int) -> dict[str, Callable[[], None]]:
    """The three timed forwards for one model: decode (1 token) and verify (`block` tokens) on a
    `context`-token cache, and a `context`-token prefill."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size - 1000  # stay clear of the padded, never-trained tail of the vocabulary
    prompt = torch.randint(0, vocab, (1, context), generator=gen)  # [1, context]
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt, cache=cache, logits_to_keep=1)

    @torch.inference_mode()
    def step(num_tokens: int) -> None:
        tokens = torch.randint(0, vocab, (1, num_tokens), generator=gen)
        model(input_ids=tokens, cache=cache)  # logits for every row: a verification needs them all
        cache.crop(-num_tokens)  # back to `context`, so every rep sees the same cache length

    @torch.inference_mode()
    def prefill() -> None:
        model(input_ids=prompt, logits_to_keep=1)

    return {
        "decode 1": lambda: step(1),
        f"verify {block}": lambda: step(block),
        f"prefill {context}": prefill,
    }


def time_interleaved(
    cases: dict[str, dict[str, Callable[[], None]]], reps: int, warmup: int = 2
) -> dict[str, dict[str, list[float]]]:
    """{dtype: {case: [seconds]}}. Dtypes alternate rep by rep (order flipped each rep), so both see the
    same background load -- the machine is shared and its noise is far larger than the effect measured."""
    dtypes = list(cases)
    times: dict[str, dict[str, list[float]]] = {d: {c: [] for c in cases[d]} for d in dtypes}
    for rep in range(warmup + reps):
        for case in cases[dtypes[0]]:
            for dtype in dtypes if rep % 2 == 0 else dtypes[::-1]:
                elapsed = _time_s(cases[dtype][case])
                if rep >= warmup:
                    times[dtype][case].append(elapsed)
    return times


@torch.inference_mode()
def greedy_tokens(model, tokenizer, new_tokens: int) -> list[int]:
    """Greedy continuation of the chat-formatted `PROMPT` (token ids of the generated part only)."""
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = ids["input_ids"]  # [1, prompt_len]
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def benchmark(path: Path, args: argparse.Namespace) -> None:
    """Print the timing table and the greedy agreement for one model."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    models = {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval() for name, dtype in DTYPES.items()
    }
    cases = {name: forward_cases(model, args.context, args.block) for name, model in models.items()}
    times = time_interleaved(cases, args.reps)
    tokens = {name: greedy_tokens(model, tokenizer, args.new_tokens) for name, model in models.items()}
    del models, cases

    print(f"\n{path.name}  (torch threads {torch.get_num_threads()}, {args.reps} interleaved reps, ms)")
    print(
        f"{'forward':<13}{'fp32 med':>10}{'fp32 min':>10}{'bf16 med':>10}{'bf16 min':>10}{'ratio med':>11}{'ratio min':>11}"
    )
    for case, fp32_s in times["float32"].items():
        bf16_s = times["bfloat16"][case]
        f_med, f_min = 1e3 * statistics.median(fp32_s), 1e3 * min(fp32_s)
        b_med, b_min = 1e3 * statistics.median(bf16_s), 1e3 * min(bf16_s)
        print(
            f"{case:<13}{f_med:>10.1f}{f_min:>10.1f}{b_med:>10.1f}{b_min:>10.1f}{b_med / f_med:>11.2f}{b_min / f_min:>11.2f}"
        )
    ref, alt = tokens["float32"], tokens["bfloat16"]
    first_diff = next((i for i, (a, b) in enumerate(zip(ref, alt, strict=True)) if a != b), None)
    verdict = "identical" if first_diff is None else f"diverge at token {first_diff}"
    print(f"greedy {args.new_tokens} tokens bf16 vs fp32: {verdict}")
    print(f"  fp32: {tokenizer.decode(ref)!r}")
    if first_diff is not None:
        print(f"  bf16: {tokenizer.decode(alt)!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per cell (median reported)")
    parser.add_argument(
        "--context", type=int, default=200, help="cache length for decode/verify; prefill length"
    )
    parser.add_argument("--block", type=int, default=16, help="tokens in the verification forward")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared across dtypes")
    parser.add_argument("--pair", default="qwen2.5-coder", help="default pair to measure (target and draft)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for path in ensure_default_pair(args.pair):
        benchmark(path, args)


if __name__ == "__main__":
    main()
