"""Command line: generate with speculative (or autoregressive) decoding and print the stats.

python generate.py --prompt "Write a Python function that reverses a list."
python generate.py --pair tiny --prompt "hello" --depth 3 --verify 8 --tree-width 2
python generate.py --pair ./target-model::./draft-model --prompt "..."
python generate.py --autoregressive --prompt "..."
python generate.py --policy runs/main/policy.pt --prompt "..."

A command of the project (next to train.py and evaluate.py), not of the engine: it may load a learned
policy, and the engine imports no controller package. Its flags come from ``GenerateConfig`` (help = the
field's docstring), as every command line's do.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace

import torch

from engine.backends.models import PAIR_SEPARATOR
from engine.cli import (
    CLI_ERRORS,
    ArgumentParser,
    ModelConfig,
    check_model_path,
    check_positive,
    report_error,
    warn,
)
from engine.config_flags import add_dataclass_args, from_args, given_flags
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.errors import InputError
from engine.inputs import MAX_SEED, EngineConfig
from engine.lookup import describe_lookup, resolve_lookup
from engine.sampling import SamplingConfig
from policies.selection import parse_policy, select_controller


@dataclass
class GenerateConfig(ModelConfig):
    """One answer: the pair (``ModelConfig``), the prompt, the controller and the sampling."""

    prompt: str = field(kw_only=True)
    """The user message (chat template applied unless --raw)."""
    raw: bool = False
    """Encode the prompt as is, without the chat template."""
    target: str | None = None
    """Target model path or hub id, with --draft: the same as --pair TARGET::DRAFT."""
    draft: str | None = None
    """Draft model path or hub id, with --target."""
    depth: int = 4
    """Static draft depth."""
    verify: int | None = None
    """Nodes to verify (none: the depth)."""
    tree_width: int = 1
    """1 drafts a chain; k > 1 an EAGLE-2 style tree of width k."""
    policy: str | None = None
    """Exported policy file (policy.pt) to use as the controller."""
    autoregressive: bool = False
    """Target-only decoding (the baseline)."""
    draft_mode: str = "deterministic"
    """deterministic (top-k trees, argmax chains) or sampled (chains drawn from the draft)."""
    lookup: str = "auto"
    """Context lookup drafting: "auto" (the setting a --policy was trained with, train.py --lookup; else off),
    "off", "on" (3-4:2+8:4), MIN-MAX:K or MIN-MAX:K+L:J, e.g. 3-4:2: where the context's last n-gram (n from
    MAX down to MIN) occurred before, verify the K tokens that followed it without running the draft, and J
    tokens where its last L tokens did (with --autoregressive: lookup cycles and autoregressive steps only)."""
    temperature: float = 0.0
    """0: greedy; > 0: sampled at this temperature (below engine.sampling.MIN_TEMPERATURE: greedy)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: no limit)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p (1: no limit)."""
    max_new_tokens: int = 128
    """Tokens to generate at most."""
    seed: int = 0
    """Seeds the sampler (one generator per request)."""
    json: bool = False
    """Print the result (stats and cycles) as JSON."""


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python generate.py", description=__doc__)
    add_dataclass_args(ap, GenerateConfig)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # everything that can be checked without the models first: a bad flag fails at once
        config = from_args(GenerateConfig, args)
        for name in ("target", "draft"):  # an optional field reads "" as none: here it is an empty path
            if name in given_flags(parser, argv) and getattr(config, name) is None:
                raise InputError(f"--{name}: the model path is empty")
        sampling = SamplingConfig(config.temperature, config.top_k, config.top_p)
        resolve_lookup(config.lookup)  # a bad setting fails before any model loads
        check_positive(max_new_tokens=config.max_new_tokens)
        if not 0 <= config.seed <= MAX_SEED:
            raise InputError(f"--seed must be in [0, 2**64), got {config.seed}")
        if (config.target is None) != (config.draft is None):
            raise InputError("--target and --draft go together: give both, or neither and a --pair")
        if config.target is not None:
            check_model_path(config.target, "--target")
            check_model_path(config.draft, "--draft")
            config = replace(
                config, pair=config.target + PAIR_SEPARATOR + config.draft, target=None, draft=None
            )
        limits = config.check()
        selection = select_controller(
            parse_policy(config.policy or None),  # every value a policy file; none: the static setting
            lambda: _static_controller(config, limits),
            autoregressive=config.autoregressive,
            device=config.device if config.device != "auto" else "cpu",
        )
        controller = selection.make()
        engine_config = EngineConfig(
            draft_mode=config.draft_mode, lookup=resolve_lookup(config.lookup, selection.trained_lookup)
        )
        pair = config.load()
        if config.policy and (message := controller.pair_warning(pair)):
            warn(message)
        engine = SpeculativeEngine(pair, sampling, engine_config)
        prompt = pair.encode(config.prompt, chat=not config.raw)
        result = engine.generate(
            prompt, max_new_tokens=config.max_new_tokens, controller=controller, seed=config.seed
        )
    except CLI_ERRORS as err:
        return report_error(err)
    if config.json:
        print(json.dumps(result.to_dict(), indent=1, default=str))
        return 0
    print(result.text)
    print()
    print(
        f"pair={pair.name} weights={pair.precision} device={pair.device} "
        f"controller={controller!r} lookup={describe_lookup(engine_config.lookup)} sampling={sampling} "
        f"torch={torch.__version__}"
    )
    print(f"prompt tokens={result.prompt_len} finish={result.finish_reason}")
    for key, value in result.stats.items():
        print(f"  {key:22s} {value:12.4f}")
    return 0


def _static_controller(config: GenerateConfig, limits) -> StaticController:
    """The static controller of the flags, without --policy (checked before any model loads; the vocabulary
    bound on --tree-width is checked here for named pairs, by the engine for TARGET::DRAFT pairs)."""
    if limits is not None and config.tree_width > limits.vocab_size:
        raise InputError(
            f"--tree-width {config.tree_width} exceeds the vocabulary ({limits.vocab_size} tokens)"
        )
    if config.tree_width > EngineConfig.max_tree_nodes:
        raise InputError(
            f"--tree-width {config.tree_width} drafts more than max_tree_nodes={EngineConfig.max_tree_nodes} "
            "nodes in one step"
        )
    return StaticController(depth=config.depth, verify=config.verify, tree_width=config.tree_width)


if __name__ == "__main__":
    sys.exit(main())
