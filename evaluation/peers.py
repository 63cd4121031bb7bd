"""The peer a practitioner would use today: transformers' assisted generation (``assistant_model=``) on
the same two models, dtype and prompts, with its default dynamic schedule and with its heuristic one.

A streamer timestamps every chunk ``generate`` emits (one chunk per assisted step: the accepted drafts
plus the target's own token), which gives the same figures our engine records per cycle: time to first
token, amortised inter-token latency and accepted length per step (chunk size - 1).
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator

import torch

HF_DEFAULT = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}
"""transformers 5.x defaults (``GenerationConfig._get_default_generation_params``); the confidence threshold
adapts during generation when scikit-learn is installed."""
HF_HEURISTIC = {
    "num_assistant_tokens": 5,
    "num_assistant_tokens_schedule": "heuristic_transient",
    "assistant_confidence_threshold": 0.0,
}
"""The +2/-1 schedule from 5 drafted tokens (reset per call), no confidence stop."""
SCHEDULES = {"hf_assisted_default": HF_DEFAULT, "hf_assisted_heuristic": HF_HEURISTIC}


class _ChunkTimer:
    """A transformers streamer that records (tokens, time) of every chunk after the prompt."""

    def __init__(self, clock):
        self.clock, self.chunks, self._prompt_seen = clock, [], False
        self.t0 = clock()

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt itself
            self._prompt_seen = True
            return
        self.chunks.append((int(value.numel()), self.clock()))

    def end(self) -> None:
        pass


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Assisted generation warns about its own internal generate() call on every request."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def run_peer(
    pair, ids: list[int], max_new_tokens: int, schedule: str, temperature: float = 0.0, seed: int = 0
) -> dict:
    """One request through ``pair.target.generate(assistant_model=pair.draft)``; a measurement with the
    same keys as ``evaluation.measurements.run_engine`` (greedy, or ``do_sample`` at ``temperature`` with no
    top-k/top-p truncation, like our ``SamplingConfig(temperature)``)."""
    device = pair.device
    input_ids = torch.as_tensor([ids], device=device)
    eos = sorted(pair.eos_token_ids)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos[0],
        attention_mask=torch.ones_like(input_ids),
        assistant_model=pair.draft,
        repetition_penalty=1.0,
    )
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
        torch.manual_seed(seed)  # transformers samples from the global generator
    else:
        kwargs.update(do_sample=False)
    for key, value in SCHEDULES[schedule].items():  # the heuristic schedule mutates these: reset every call
        setattr(pair.draft.generation_config, key, value)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = _ChunkTimer(clock)
    with _quiet_transformers(), torch.inference_mode():
        out = pair.target.generate(input_ids, streamer=timer, **kwargs)
    end = clock()
    tokens = out[0, len(ids) :].tolist()
    stamps = [timer.t0] + [t for _, t in timer.chunks]
    steps = [[n, stamps[i + 1] - stamps[i], n - 1, -1, -1, 0] for i, (n, _) in enumerate(timer.chunks)]
    ttft = steps[0][1] if steps else end - timer.t0
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "tokens": tokens,
        "num_tokens": len(tokens),
        "total_s": end - timer.t0,
        "ttft_s": ttft,
        "decode_s": end - timer.t0 - ttft,
        "finish_reason": "eos" if tokens and tokens[-1] in eos else "length",
        "peak_memory_mb": peak / 2**20,
        "cycles": steps[1:],
        "first_chunk": steps[0][0] if steps else 0,
    }
