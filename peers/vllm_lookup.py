"""The engine's context lookup (``engine.lookup``) as a vLLM custom proposer: what vLLM's proposer hook can
carry of our control.

vLLM 0.32.0 loads a class named by a dotted path in ``speculative_config.model`` (``method: custom_class``,
``vllm/v1/spec_decode/custom_class_proposer.py``), builds it with the ``VllmConfig`` and, after every step,
calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``: one list of the
tokens each request of the step just committed (empty for a request that skips speculation, e.g. mid
prefill), each request's committed length, and the batch's token rows. It returns one proposal per request,
of any length from 0 to ``num_speculative_tokens``, which the target verifies in the next step. So the hook
carries a per-request decision (how many tokens, which) and sees the step's load (how many requests decode),
but no model output: a proposer that wants a draft model's distributions must run that model itself.

``LookupProposer`` makes the engine's own lookup proposals (the same ``NgramIndex`` rules: the long match
first, then the longest short n-gram, the latest occurrence wins) with its load limit: while more than
``LookupConfig.max_requests`` requests decode in the step, every proposal is empty, as the engine's lookup
stops under load. The setting comes from ``$DRAFTPILOT_VLLM_LOOKUP`` (a ``--lookup`` setting such as
``3-4:2+8:4@2``; vLLM hands the class nothing but its config), ``speculative_config`` for it from
``proposer_config``. vLLM's process imports this module, so it imports nothing but ``engine.lookup``'s light
dependencies and numpy (the repository root on ``PYTHONPATH``: ``peers.vllm_peer.vllm_command``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from engine.load import LoadState
from engine.lookup import LookupConfig, NgramIndex, describe_lookup, parse_lookup

SETTING_ENV = "DRAFTPILOT_VLLM_LOOKUP"
CLASS_PATH = f"{__name__}.LookupProposer"


def proposer_config(setting: str) -> dict:
    """vLLM's ``--speculative-config`` for ``LookupProposer`` with a lookup ``setting`` ("off" is an error:
    then run vLLM without speculation): the class path and ``num_speculative_tokens``, the longest proposal
    the setting makes."""
    config = parse_lookup(setting)
    if config is None:
        raise ValueError("the lookup setting is off: run vLLM without speculation instead")
    return {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": config.most_tokens}


class LookupProposer:
    """Context lookup proposals for a vLLM batch (module docstring). One ``NgramIndex`` per batch row, kept
    while the row's tokens extend the ones it indexed (a row that now holds another request is indexed
    afresh)."""

    def __init__(self, vllm_config=None, *, config: LookupConfig | None = None):
        if config is None:
            config = parse_lookup(os.environ.get(SETTING_ENV, "on"))
        if config is None:
            raise ValueError(f"${SETTING_ENV} is off: run vLLM without speculation instead")
        self.config = config
        self.rules = config.rules  # the proposals, the load limit aside
        spec = getattr(vllm_config, "speculative_config", None)
        self.limit = min(
            config.most_tokens, getattr(spec, "num_speculative_tokens", None) or config.most_tokens
        )
        model = getattr(vllm_config, "model_config", None)
        self.max_model_len = getattr(model, "max_model_len", None) or 1 << 62
        self._rows: dict[int, tuple[NgramIndex, np.ndarray]] = {}

    def __repr__(self) -> str:
        return f"LookupProposer({describe_lookup(self.config)!r})"

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's model runner calls this on every drafter; a lookup loads nothing."""

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
        **_: object,
    ) -> list[list[int]]:
        """One proposal per request of the step (module docstring): empty for a request that skips
        speculation, at the end of its context room, without a match, or for every request while the step's
        load is over the limit."""
        decoding = [i for i, ids in enumerate(sampled_token_ids) if len(ids)]
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        if not self.config.runs_at(LoadState(requests=len(decoding))):
            return out
        for i in decoding:
            n = int(num_tokens_no_spec[i])
            room = min(self.limit, self.max_model_len - n - 1)
            if room < 1:
                continue
            out[i] = self._index(i, token_ids_cpu[i, :n]).propose(room)
        return out

    def _index(self, row: int, tokens: np.ndarray) -> NgramIndex:
        """The row's index, synced with ``tokens`` (rebuilt when they do not extend what it indexed)."""
        kept = self._rows.get(row)
        if kept is not None:
            index, seen = kept
            if len(tokens) >= len(seen) and np.array_equal(tokens[: len(seen)], seen):
                index.extend(tokens[len(seen) :].tolist())
                self._rows[row] = (index, tokens.copy())
                return index
        index = NgramIndex(self.rules, tokens.tolist())
        self._rows[row] = (index, tokens.copy())
        return index
