"""A named pair's architecture with random weights: timing without the weights.

A device that cannot receive the real checkpoints can still measure the cost profile (docs/design.md
section 6): forward time depends on shapes, dtype and kernels, not on weight values. Acceptance measured
with such a pair is meaningless; only its timings are valid.

The configs mirror the converted checkpoints in ``~/.cache/draftpilot/hf/*/config.json`` exactly (note
``tie_word_embeddings=False`` for both: the GGUF conversion stores a separate output matrix, so the
draft has ~0.63B parameters rather than the published 0.49B).

Integer formats: the random floats are quantized block by block as the published GGUF files are laid out
(``PUBLISHED_TYPES``: the target keeps Q6_K for its output matrix and for attn_v and ffn_down in 14 of its
28 layers, Q4_K elsewhere), so kquant gives each linear the layout (k4 or k6) the real conversion gives
it. Measured within one hour (Intel Xeon, 2 threads, 2026-12-02; docs/results/README.md), verify(16) and
verify(64) over verify(1): real weights 2.72 / 9.61, random weights in the published layout 2.67 / 9.04,
random weights all k4 (one layout for every linear) 2.55 / 8.41: the cost of verifying many rows follows
the block layout. Dense formats (the GPU's bfloat16) have no such choice.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine.backends.gguf import GGUF_LINEAR_NAMES
from engine.backends.pair import ModelPair, make_pair
from engine.backends.tiny import ByteTokenizer

_QWEN2_COMMON: dict[str, Any] = dict(
    vocab_size=151936, max_position_embeddings=32768, max_window_layers=28,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    rms_norm_eps=9.999999974752427e-07,  # 1e-6 as the converted checkpoints store it (float32-rounded)
    tie_word_embeddings=False, use_sliding_window=False, sliding_window=None, hidden_act="silu",
    bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
)  # fmt: skip

RANDOM_PAIR_CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen2.5-coder": (
        dict(_QWEN2_COMMON, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
             num_attention_heads=12, num_key_value_heads=2),  # Qwen2.5-Coder-1.5B-Instruct (target)
        dict(_QWEN2_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2),  # Qwen2.5-Coder-0.5B-Instruct (draft)
    ),
}  # fmt: skip


_TARGET_Q6K_LAYERS = (0, 1, 5, 6, 7, 8, 9, 10, 13, 16, 19, 21, 24, 27)
_DRAFT_WIDE_LAYERS = (0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21)
_DRAFT_Q4K_DOWN_LAYERS = (2, 4, 5, 11, 12, 14, 15, 17, 18, 20, 22, 23)

PUBLISHED_TYPES: dict[str, tuple[tuple[str, dict[str, tuple[int, ...] | None]], ...]] = {
    "qwen2.5-coder": (
        ("Q4_K", {"Q6_K": None, "Q6_K self_attn.v_proj mlp.down_proj": _TARGET_Q6K_LAYERS}),
        ("Q5_0", {"Q8_0": None, "Q8_0 self_attn.v_proj": _DRAFT_WIDE_LAYERS,
                  "Q6_K mlp.down_proj": _DRAFT_WIDE_LAYERS, "Q4_K mlp.down_proj": _DRAFT_Q4K_DOWN_LAYERS}),
    ),
}  # fmt: skip
"""(target, draft) GGUF block types of the published files (``engine.backends.weights``): the default type, then
"TYPE modules..." -> the layers where those modules have TYPE ("TYPE" -> None: the output matrix)."""


def published_source_types(name: str, role: str, num_layers: int) -> dict[str, str] | None:
    """Module name -> GGUF block type of the ``role`` ("target" / "draft") of the published pair ``name``
    for every linear of a ``num_layers``-layer model (None: no published files of that name)."""
    if name not in PUBLISHED_TYPES:
        return None
    default, rules = PUBLISHED_TYPES[name][("target", "draft").index(role)]
    modules = GGUF_LINEAR_NAMES.values()
    names = [f"model.layers.{i}.{m}" for i in range(num_layers) for m in modules] + ["lm_head"]
    types = dict.fromkeys(names, default)
    for key, layers in rules.items():
        qtype, *modules = key.split()
        if layers is None:
            types["lm_head"] = qtype
            continue
        for i in layers:
            if i < num_layers:
                types.update({f"model.layers.{i}.{m}": qtype for m in modules})
    return types


class StubTokenizer(ByteTokenizer):
    """Bytes as ids 0..255 inside a large vocabulary: enough to encode a prompt and decode output when
    no real tokenizer can be downloaded (profiling feeds token ids directly and never needs one)."""

    def __init__(self, vocab_size: int, eos_token_id: int):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def get_vocab(self) -> dict[str, int]:
        vocab = super().get_vocab()
        del vocab["<eos>"]
        vocab["<eos>"] = self.eos_token_id
        return vocab

    def __len__(self) -> int:
        return self.vocab_size


def random_pair_configs(
    name: str, overrides: dict[str, Any] | None = None
) -> tuple[Qwen2Config, Qwen2Config]:
    """(target, draft) configs of a named pair; ``overrides`` is applied to both (tests shrink them)."""
    if name not in RANDOM_PAIR_CONFIGS:
        raise ValueError(
            f"no random-weights architecture for pair {name!r}; known: {sorted(RANDOM_PAIR_CONFIGS)}"
        )
    target, draft = RANDOM_PAIR_CONFIGS[name]
    extra = overrides or {}
    return Qwen2Config(**{**target, **extra}), Qwen2Config(**{**draft, **extra})


def build_random_pair(
    name: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> ModelPair:
    """The named pair's architecture with seeded random weights, built directly on ``device`` in ``dtype``.

    Building in place matters: a 1.5B model initialised in float32 on the CPU and then cast and moved
    would take minutes and twice the memory. ``device="meta"`` allocates nothing (shapes and parameter
    counts only).
    """
    dev = torch.device(device)
    target_cfg, draft_cfg = random_pair_configs(name, overrides)
    previous = torch.get_default_dtype()
    try:
        # created in ``dtype`` on ``dev`` with initialisation skipped, then filled once by a cheap seeded
        # draw: the library init would draw every matrix twice (torch's, then transformers')
        torch.set_default_dtype(dtype)
        with dev, _no_init():
            target = Qwen2ForCausalLM(target_cfg)
            draft = Qwen2ForCausalLM(draft_cfg)
    finally:
        torch.set_default_dtype(previous)
    if dev.type != "meta":
        generator = torch.Generator(device=dev).manual_seed(seed)
        _fill_random(target, generator, target_cfg.initializer_range)
        _fill_random(draft, generator, draft_cfg.initializer_range)
    target, draft = (
        target.eval(),
        draft.eval(),
    )  # buffers (rotary inv_freq) keep their dtype, as from_pretrained leaves them
    tokenizer = StubTokenizer(target_cfg.vocab_size, target_cfg.eos_token_id)
    return make_pair(target, draft, tokenizer, tokenizer, f"{name}[random]")


_PERIOD = 1_048_573  # a prime: the repeated draw never lines up with a row length (rows stay distinct)


@torch.no_grad()
def _fill_random(model: torch.nn.Module, generator: torch.Generator, std: float) -> None:
    """Uniform weights with the library init's standard deviation; RMSNorm scales 1 and biases 0, as the
    library init sets them.

    One block of ``_PERIOD`` values is drawn and repeated through all matrices: drawing two billion
    independent values takes about a minute on a CPU, and a forward's time does not depend on the values
    (only NaN or subnormal numbers would, and these are neither).
    """
    bound = std * 3**0.5
    ref = next(model.parameters())
    block = torch.empty(_PERIOD, device=ref.device, dtype=torch.float32)
    block = block.uniform_(-bound, bound, generator=generator).to(ref.dtype)
    offset = 0
    for name, param in model.named_parameters():
        if param.dim() == 1:
            param.fill_(1.0 if "norm" in name else 0.0)
            continue
        flat, done = param.view(-1), 0
        while done < flat.numel():
            start = (offset + done) % _PERIOD
            take = min(_PERIOD - start, flat.numel() - done)
            flat[done : done + take].copy_(block[start : start + take])
            done += take
        offset += flat.numel()


def _no_init():
    """transformers' context that skips weight initialisation (an internal helper: fall back to the
    ordinary, slower init if a version lacks it)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - depends on the installed version
        return contextlib.nullcontext()
    return no_init_weights()


def parameter_count(config: Qwen2Config) -> int:
    """Parameters of a ``Qwen2ForCausalLM`` with this config, from the shapes alone (for checks)."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    attention = hidden * hidden + hidden + 2 * (hidden * kv + kv) + hidden * hidden  # q, k, v (bias), o
    layer = attention + 3 * hidden * inter + 2 * hidden  # MLP (gate, up, down) and two RMSNorms
    embeddings = vocab * hidden * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * layer + embeddings + hidden  # + final norm
