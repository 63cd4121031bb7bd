"""The generation result: what ``SpeculativeEngine.generate`` returns, its per-cycle records and its summary
statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class CycleRecord:
    """One draft-and-verify cycle (an autoregressive step is a cycle with depth 0)."""

    context_len: int
    """Committed tokens when the cycle started."""
    depth: int
    """Draft steps taken."""
    num_drafted: int
    """Nodes in the draft tree."""
    num_verified: int
    """Drafted nodes sent to the target."""
    accepted: int
    """Drafted tokens accepted."""
    emitted: int
    """Tokens committed by this cycle (accepted + recovered/bonus, cut at EOS and budget)."""
    draft_s: float = 0.0
    """Drafting wall time (draft forwards, selection, masks), controller calls excluded."""
    verify_s: float = 0.0
    """Target forward plus acceptance sampling."""
    controller_s: float = 0.0
    """Time spent inside the controller."""
    overhead_s: float = 0.0
    """Everything else in the cycle: cache compaction, bookkeeping."""
    forward_s: float = 0.0
    """Time inside model forward calls only (draft and target); the rest is engine overhead."""
    lookup: bool = False
    """A context-lookup cycle (``engine.lookup``): ``num_drafted``/``num_verified`` proposed tokens, depth 0 (no
    draft step), the controller neither asked nor shown it through ``observe``; ``draft_s`` is the lookup."""
    catch_up: int = 0
    """Tokens a catch-up cycle ran on the draft (``engine.inputs.EngineConfig.draft_catch_up_tokens``: under
    load, a chunk of what the draft is behind by, next to an autoregressive step, depth 0; ``draft_s`` is the
    chunk's forward); 0 for every other cycle."""

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.controller_s + self.overhead_s


@dataclass
class GenerationResult:
    """Output of ``SpeculativeEngine.generate``."""

    tokens: list[int]
    """Generated token ids only (the prompt excluded)."""
    text: str
    prompt_len: int
    finish_reason: str
    """"eos", "length" (max_new_tokens), "context" (context limit) or "stop" (a request's stop token,
    ``engine.batch.BatchRequest.stop_token_ids``)."""
    prefill_s: float
    """Prefill of the target (with the first token: the time to first token) plus the draft's, which runs
    lazily at the first drafting cycle (0 for a request decoded without drafting); the cycles' times
    exclude it. Under load, prompt chunks that catch-up cycles ran on the draft (``CycleRecord.catch_up``)
    are those cycles' drafting time, not prefill."""
    cycles: list[CycleRecord] = field(default_factory=list)
    peak_memory_bytes: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose target KV came from the prefix cache (``engine.prefix_cache``) instead of the
    prefill (OpenAI's ``usage.prompt_tokens_details.cached_tokens``); 0 without one."""

    @property
    def stats(self) -> dict[str, float]:
        return summarize(self)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["stats"] = self.stats
        return out


def summarize(res: GenerationResult) -> dict[str, float]:
    """Throughput and latency figures for one request.

    Inter-token latency is amortised: a cycle that takes T and commits n tokens contributes n samples
    of T / n (tokens of one cycle reach the caller together; this is the per-token cost a stream sees).
    """
    cycles = res.cycles
    decode_s = float(sum(c.total_s for c in cycles))
    total_s = res.prefill_s + decode_s
    n = len(res.tokens)
    itl = np.concatenate([np.full(c.emitted, c.total_s / c.emitted) for c in cycles if c.emitted] or [[]])
    spec = [c for c in cycles if c.num_verified > 0]
    verified = sum(c.num_verified for c in spec)
    accepted = sum(c.accepted for c in spec)
    forward_s = sum(c.forward_s for c in cycles)

    def pct(q: float) -> float:
        return float(np.percentile(itl, q)) if itl.size else float("nan")

    return {
        "num_tokens": float(n),
        "num_cycles": float(len(cycles)),
        "total_s": total_s,
        "tokens_per_s": n / total_s if total_s > 0 else float("nan"),
        "decode_tokens_per_s": (n - 1) / decode_s if decode_s > 0 and n > 1 else float("nan"),
        "ttft_s": res.prefill_s,
        "itl_mean_s": float(itl.mean()) if itl.size else float("nan"),
        "itl_p50_s": pct(50),
        "itl_p90_s": pct(90),
        "itl_p99_s": pct(99),
        "mean_accepted": accepted / len(spec) if spec else 0.0,
        "tokens_per_cycle": (n - 1) / len(cycles) if cycles else float("nan"),
        "acceptance_rate": accepted / verified if verified else float("nan"),
        "lookup_cycles": float(sum(c.lookup for c in cycles)),
        "mean_depth": float(np.mean([c.depth for c in cycles])) if cycles else 0.0,
        "mean_verified": float(np.mean([c.num_verified for c in cycles])) if cycles else 0.0,
        "overhead_fraction": 1.0 - forward_s / decode_s if decode_s > 0 else float("nan"),
        "controller_fraction": sum(c.controller_s for c in cycles) / decode_s
        if decode_s > 0
        else float("nan"),
        "peak_memory_mb": res.peak_memory_bytes / 2**20,
    }
