"""What the engine accepts: its settings (``EngineConfig``) and the checks of a request's arguments (prompt,
token budget, controller, seed), each refusal an ``InputError`` (``ControllerError``) naming the argument,
raised before any model runs (``SpeculativeEngine.generate``, ``engine.batch.BatchedEngine.add``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.backends.attention import MAX_VERIFY_NODES
from engine.backends.pair import ModelPair
from engine.control import Controller, ControllerError
from engine.cycle import DRAFT_CATCH_UP_TOKENS
from engine.errors import InputError, is_int, short_repr
from engine.lookup import LookupConfig
from engine.sampling import SamplingConfig
from engine.tree import MAX_TREE_NODES

MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings (the controller decides depth and size per cycle)."""

    draft_mode: str = "deterministic"
    """"deterministic": drafts are top-k expansions / argmax chains (exactly replayable);
    "sampled": chain drafts sampled from the draft distribution (Leviathan rule; tree_width must be 1)."""
    max_depth: int = 32
    """Hard cap on draft depth per cycle, whatever the controller says."""
    max_verify: int = MAX_VERIFY_NODES
    """Hard cap on drafted nodes verified in one target forward, whatever the controller asks (1 to 64: the
    root plus these nodes stay within row-wise attention, ``engine.backends.attention.MAX_ROWWISE_ROWS``)."""
    max_tree_nodes: int = MAX_TREE_NODES
    """Hard cap on the nodes of one cycle's draft tree. A width-W tree has ``W + (d - 1) W^2`` nodes at depth d
    (``engine.tree.tree_size``), so the cap is a depth cap, ``engine.tree.depth_limit(W, max_tree_nodes)``,
    folded into the cycle's depth cap (controllers see it in ``DraftState.max_depth``; replay applies the
    same one). A ``tree_width`` above it is refused."""
    check_finite: bool = True
    """Stop with an error on NaN/inf logits."""
    validate_caches: bool = False
    """Debug: after every cycle, check both KV caches against a fresh forward of the committed tokens
    (slow; tests use it to prove the cache invariant)."""
    lookup: LookupConfig | None = None
    """Context lookup drafting (``engine.lookup``): a cycle whose context's last n-gram occurred earlier
    verifies the tokens that followed it, without running the draft or asking the controller; None: off."""
    draft_catch_up_tokens: int = DRAFT_CATCH_UP_TOKENS
    """Under load (the request's step holds other requests' work, decoding or prefilling: ``shares_its_step``), the most tokens the
    draft catches up on in one cycle: a cycle whose controller wants to draft while the draft is behind by
    more (the prompt it has not run plus its pending tokens: after depth-0 or lookup cycles, or at its first
    drafting cycle after a long prompt) runs the next this-many of them on the draft next to an
    autoregressive step (a *catch-up cycle*, ``CycleRecord.catch_up``), and drafts once the rest fits, so no
    step carries more than this many draft rows of one request's catch-up. Alone the whole catch-up runs
    in the drafting cycle, as it always did. The draft's cache ends the same either way (bitwise on the
    native decoder, which computes every row alone), so outputs do not change, only when the cost is paid."""

    def __post_init__(self) -> None:
        if self.lookup is not None and not isinstance(self.lookup, LookupConfig):
            raise InputError(f"lookup must be an engine.lookup.LookupConfig or None, got {self.lookup!r}")
        if self.draft_mode not in ("deterministic", "sampled"):
            raise InputError(f"draft_mode must be 'deterministic' or 'sampled', got {self.draft_mode!r}")
        for name, low, high in (
            ("max_depth", 1, None),
            ("max_verify", 1, MAX_VERIFY_NODES),
            ("max_tree_nodes", 1, None),
            ("draft_catch_up_tokens", 1, None),
        ):
            value = getattr(self, name)
            if not is_int(value) or value < low or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise InputError(f"{name} must be an integer {bound}, got {value!r}")


def check_request(
    pair: ModelPair,
    config: EngineConfig,
    prompt: str | Sequence[int] | torch.Tensor | np.ndarray,
    max_new_tokens: object,
    controller: Controller | None,
    seed: object,
    sampling: SamplingConfig,
) -> tuple[list[int], int]:
    """(prompt ids, max_new_tokens) of a request, or an ``InputError`` (``ControllerError``) naming the bad
    argument (``sampling``: the request's); nothing runs."""
    prompt_ids = prompt_ids_of(pair, prompt)
    if not is_int(max_new_tokens) or max_new_tokens <= 0:
        raise InputError(f"max_new_tokens must be a positive integer, got {short_repr(max_new_tokens)}")
    if len(prompt_ids) >= pair.max_context:
        raise InputError(f"prompt has {len(prompt_ids)} tokens; the context limit is {pair.max_context}")
    check_controller(pair, config, controller, sampling)
    if not is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise InputError(f"seed must be an integer in [0, 2**64), got {short_repr(seed)}")
    return prompt_ids, int(max_new_tokens)


def prompt_ids_of(pair: ModelPair, prompt: str | Sequence[int] | torch.Tensor | np.ndarray) -> list[int]:
    """Token ids of ``prompt``; anything but text or integer ids of one sequence is an ``InputError``
    (floats would be truncated, a batch flattened into one sequence)."""
    if isinstance(prompt, str):
        ids = [int(t) for t in pair.tokenizer.encode(prompt)]
    elif isinstance(prompt, (torch.Tensor, np.ndarray)):
        shape = tuple(prompt.shape)
        if len(shape) == 2 and shape[0] == 1:
            prompt = prompt[0]  # a batch of one, as tokenizers return it
        elif len(shape) != 1:
            raise InputError(
                f"prompt must be one sequence of token ids (shape [n] or [1, n]), got shape {shape}"
            )
        integer = (
            not (prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool)
            if isinstance(prompt, torch.Tensor)
            else np.issubdtype(prompt.dtype, np.integer)
        )
        if not integer:
            raise InputError(f"prompt token ids must be integers, got a tensor of dtype {prompt.dtype}")
        ids = [int(t) for t in prompt.tolist()]
    elif isinstance(prompt, (list, tuple, range)):
        bad = [t for t in prompt if not is_int(t)]
        if bad:
            raise InputError(
                f"prompt token ids must be integers, got {short_repr(bad[0])} ({type(bad[0]).__name__})"
            )
        ids = [int(t) for t in prompt]
    else:
        raise InputError(
            f"prompt must be a string, a list of token ids or an integer tensor, got {type(prompt).__name__}"
        )
    if not ids:
        raise InputError("empty prompt: give at least one token")
    vocab = pair.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise InputError(f"prompt token ids must be in [0, {vocab})")
    return ids


def check_controller(
    pair: ModelPair, config: EngineConfig, controller: Controller | None, sampling: SamplingConfig
) -> None:
    """An ``InputError`` (``ControllerError``) unless ``controller`` is None or a ``Controller`` whose tree width
    the pair, the engine's caps and its draft mode (with the request's ``sampling``) allow."""
    if controller is None:
        return
    if not isinstance(controller, Controller):
        raise ControllerError(
            f"controller must be an engine.Controller (subclass it) or None, got "
            f"{short_repr(controller)} ({type(controller).__name__})"
        )
    width = getattr(controller, "tree_width", None)
    if not is_int(width) or width < 1:
        raise ControllerError(f"controller.tree_width must be an integer >= 1, got {short_repr(width)}")
    vocab = pair.vocab_size
    if width > vocab:
        raise ControllerError(
            f"controller.tree_width {width} exceeds the vocabulary ({vocab} tokens): a node "
            f"has at most {vocab} children"
        )
    if width > config.max_tree_nodes:
        raise ControllerError(
            f"controller.tree_width {width} drafts more than EngineConfig.max_tree_nodes="
            f"{config.max_tree_nodes} nodes in its first step"
        )
    if config.draft_mode == "sampled":
        if width != 1:
            raise InputError("draft_mode='sampled' drafts chains only: use tree_width=1")
        if sampling.greedy:
            raise InputError("draft_mode='sampled' needs temperature > 0 (greedy drafts are deterministic)")
