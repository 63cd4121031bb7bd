"""A trained policy's per-load draft lengths in the files other serving engines read, and the per-load
baseline's table beside them.

* vLLM: ``speculative_config.num_speculative_tokens_per_batch_size``, a JSON list of ``[first, last, k]``
  (``policies.static.write_batch_size_table``, checked as vLLM 0.32.0 checks it). A range where the policy
  does not draft carries 1, not 0: in vLLM a 0 there still runs the draft model over every committed token
  and keeps the speculative step on, for no drafted token (measured on the CPU: 0.64x vLLM's autoregressive
  row at 4 clients, where a draft length of 1 was 0.99x; docs/results/2026-12-06-vllm-peer.md).
* SGLang: the adaptive speculative decoding config (``--speculative-adaptive-config FILE``): a JSON object
  whose keys are batch-size lower bounds (``"1"``, ``"8"``: batch sizes 1-7 use the first entry, 8 and up the
  second), each entry holding the tier settings SGLang reads (``candidate_steps``, ``ema_alpha``,
  ``update_interval``, ``warmup_batches``, ``down_hysteresis``, ``up_hysteresis``). One candidate step per
  range pins the draft steps to the policy's choice there. SGLang always drafts at least one step, so a
  range where the policy does not draft carries 1.
* The baseline: the static chain tuned per load level (``envs.server.tune_table``) in vLLM's format, as
  ``tuned_batch_size_table.json``, so that ``serve.py --policy table:FILE`` (and vLLM) serve it live.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from engine.backends.files import atomic_write
from policies.static import batch_size_table, write_batch_size_table

SGLANG_KEYS = (
    "candidate_steps",
    "ema_alpha",
    "update_interval",
    "warmup_batches",
    "down_hysteresis",
    "up_hysteresis",
)
"""The settings an entry of SGLang's adaptive config may hold."""


def sglang_adaptive_config(table: Mapping[tuple[int, int], int]) -> dict[str, dict]:
    """``{(first, last): k}`` (as ``batch_size_table`` takes it) as SGLang's per-batch-size adaptive config:
    each range's lower bound -> ``{"candidate_steps": [max(k, 1)]}``."""
    rows = (
        batch_size_table(table)
        if any(k for k in table.values())
        else sorted([*key, k] for key, k in table.items())
    )
    return {str(first): {"candidate_steps": [max(int(k), 1)]} for first, _, k in rows}


def check_sglang_adaptive_config(config: object) -> None:
    """ValueError unless ``config`` has the documented shape: an object keyed by increasing batch-size lower
    bounds (decimal strings, the first "1"), each value an object of SGLang's tier settings whose
    ``candidate_steps`` is a non-empty increasing list of integers >= 1."""
    if not isinstance(config, dict) or not config:
        raise ValueError("the SGLang adaptive config must be a non-empty JSON object")
    bounds = []
    for key, entry in config.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 1):
            raise ValueError(f"key {key!r} is not a batch-size lower bound (a decimal integer >= 1)")
        bounds.append(int(key))
        if not isinstance(entry, dict) or set(entry) - set(SGLANG_KEYS):
            raise ValueError(f"entry {key!r} must be an object of {SGLANG_KEYS}, got {entry!r}")
        steps = entry.get("candidate_steps")
        if steps is not None and (
            not isinstance(steps, list)
            or not steps
            or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in steps)
            or steps != sorted(set(steps))
        ):
            raise ValueError(
                f"entry {key!r}: candidate_steps must be increasing integers >= 1, got {steps!r}"
            )
    if bounds != sorted(set(bounds)) or bounds[0] != 1:
        raise ValueError(f"batch-size lower bounds must increase from 1, got {bounds}")


VLLM_FILE = "vllm_batch_size_table.json"
SGLANG_FILE = "sglang_adaptive_config.json"
TUNED_FILE = "tuned_batch_size_table.json"
EXPORTS = (VLLM_FILE, SGLANG_FILE, TUNED_FILE)
"""The files ``write_exports`` writes into a run directory."""


def vllm_lengths(table: Mapping[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """The policy's per-load draft lengths as the vLLM file carries them: a 0 becomes 1 (module docstring)."""
    return {key: max(int(k), 1) for key, k in table.items()}


def write_exports(
    table: Mapping[tuple[int, int], int],
    directory: str | Path,
    tuned: Mapping[tuple[int, int], int] | None = None,
) -> dict[str, str]:
    """Write ``vllm_batch_size_table.json`` (``vllm_lengths``; when the policy drafts anywhere, else vLLM runs
    best without speculation)
    and ``sglang_adaptive_config.json`` into ``directory``, and with ``tuned`` (the per-load baseline's
    ranges, as ``table``) ``tuned_batch_size_table.json`` (when it drafts anywhere); returns what was written
    (name -> path, or a reason)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    if any(table.values()):
        out["vllm"] = str(write_batch_size_table(vllm_lengths(table), directory / VLLM_FILE))
    else:
        out["vllm"] = "not written: the policy drafts at no load level (run vLLM without speculation)"
    config = sglang_adaptive_config(table)
    check_sglang_adaptive_config(config)
    path = directory / SGLANG_FILE
    atomic_write(path, json.dumps(config, indent=1) + "\n")
    out["sglang"] = str(path)
    if tuned is not None:
        if any(tuned.values()):
            out["tuned table"] = str(write_batch_size_table(tuned, directory / TUNED_FILE))
        else:
            out["tuned table"] = "not written: the static chain tuned per load level drafts at no level"
    return out
