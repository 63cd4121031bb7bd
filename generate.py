"""Command line: generate with speculative (or autoregressive) decoding and print the stats.

python generate.py --prompt "Write a Python function that reverses a list."
python generate.py --pair tiny --prompt "hello" --depth 3 --verify 8 --tree-width 2
python generate.py --autoregressive --prompt "..."
python generate.py --policy runs/main/policy.pt --prompt "..."

A command of the project (next to train.py and evaluate.py), not of the engine: it may load a learned
policy, and the engine imports no controller package.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from engine.cli import (
    CLI_ERRORS,
    ArgumentParser,
    check_model_path,
    check_pair_args,
    check_positive,
    report_error,
    warn,
)
from engine.control import StaticController
from engine.engine import MAX_SEED, EngineConfig, SpeculativeEngine
from engine.errors import InputError
from engine.models import add_format_args, format_kwargs, load_pair
from engine.sampling import SamplingConfig
from policies import load_policy


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog="python generate.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--prompt", required=True, help="the user message (chat template applied unless --raw)")
    ap.add_argument("--raw", action="store_true", help="encode the prompt as is, without the chat template")
    ap.add_argument("--pair", default="qwen2.5-coder", help="named pair: qwen2.5-coder (default) or tiny")
    ap.add_argument("--target", help="target model path or hub id (with --draft; overrides --pair)")
    ap.add_argument("--draft", help="draft model path or hub id")
    add_format_args(ap)
    ap.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1, ...")
    ap.add_argument("--depth", type=int, default=4, help="static draft depth")
    ap.add_argument("--verify", type=int, default=None, help="nodes to verify (default: depth)")
    ap.add_argument("--tree-width", type=int, default=1, help="1 drafts a chain; k > 1 an EAGLE-2 style tree")
    ap.add_argument("--policy", help="exported policy file (policy.pt) to use as the controller")
    ap.add_argument("--autoregressive", action="store_true", help="target-only decoding (the baseline)")
    ap.add_argument("--draft-mode", default=EngineConfig.draft_mode, choices=["deterministic", "sampled"])
    ap.add_argument("--temperature", type=float, default=SamplingConfig.temperature)
    ap.add_argument("--top-k", type=int, default=SamplingConfig.top_k)
    ap.add_argument("--top-p", type=float, default=SamplingConfig.top_p)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the result (stats and cycles) as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # everything that can be checked without the models first: a bad flag fails at once
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
        config = EngineConfig(draft_mode=args.draft_mode)
        check_positive(max_new_tokens=args.max_new_tokens)
        if not 0 <= args.seed <= MAX_SEED:
            raise InputError(f"--seed must be in [0, 2**64), got {args.seed}")
        custom = args.target is not None or args.draft is not None
        if (args.target is None) != (args.draft is None):
            raise InputError("--target and --draft go together: give both, or neither and a --pair")
        if custom:
            check_model_path(args.target, "--target")
            check_model_path(args.draft, "--draft")
        limits = check_pair_args(args.pair, args.device, custom=custom, **format_kwargs(args))
        controller = None if args.autoregressive else _controller(args, limits)
        formats = dict(device=args.device, **format_kwargs(args))
        pair = (
            load_pair(target=args.target, draft=args.draft, **formats)
            if custom
            else load_pair(args.pair, **formats)
        )
        if args.policy and (message := controller.pair_warning(pair)):
            warn(message)
        engine = SpeculativeEngine(pair, sampling, config)
        prompt = pair.encode(args.prompt, chat=not args.raw)
        result = engine.generate(
            prompt, max_new_tokens=args.max_new_tokens, controller=controller, seed=args.seed
        )
    except CLI_ERRORS as err:
        return report_error(err)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=str))
        return 0
    print(result.text)
    print()
    print(
        f"pair={pair.name} weights={pair.precision} device={pair.device} "
        f"controller={controller!r} sampling={sampling} torch={torch.__version__}"
    )
    print(f"prompt tokens={result.prompt_len} finish={result.finish_reason}")
    for key, value in result.stats.items():
        print(f"  {key:22s} {value:12.4f}")
    return 0


def _controller(args, limits):
    """The controller the flags ask for (checked before any model loads; the vocabulary bound on
    --tree-width is checked here for named pairs, by the engine for --target/--draft pairs)."""
    if args.policy:
        try:
            return load_policy(args.policy, device=args.device if args.device != "auto" else "cpu")
        except CLI_ERRORS as err:
            raise InputError(f"--policy: {err}") from None
    if limits is not None and args.tree_width > limits.vocab_size:
        raise InputError(
            f"--tree-width {args.tree_width} exceeds the vocabulary ({limits.vocab_size} tokens)"
        )
    if args.tree_width > EngineConfig.max_tree_nodes:
        raise InputError(
            f"--tree-width {args.tree_width} drafts more than max_tree_nodes={EngineConfig.max_tree_nodes} "
            "nodes in one step"
        )
    return StaticController(depth=args.depth, verify=args.verify, tree_width=args.tree_width)


if __name__ == "__main__":
    sys.exit(main())
