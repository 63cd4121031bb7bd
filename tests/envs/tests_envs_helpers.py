"""Synthetic traces and a linear cost profile for environment tests that need no model."""

from __future__ import annotations

import numpy as np

from envs.trace import Trace


class LinearProfile:
    """draft step = a + b * width; verify = c + d * nodes; overhead = e (seconds)."""

    def __init__(self, a=0.010, b=0.002, c=0.050, d=0.004, e=0.001):
        self.a, self.b, self.c, self.d, self.e = a, b, c, d, e

    def draft_step_s(self, width, context):
        return self.a + self.b * width

    def draft_chunk_s(self, num_pending, context):
        return self.a + self.b * num_pending

    def verify_s(self, num_nodes, context, chain=False):
        return self.c + self.d * num_nodes

    def overhead_s(self, num_nodes, depth=1, tree_width=1):
        return self.e


def make_synthetic_trace(
    seed: int,
    length: int = 60,
    width: int = 2,
    max_depth: int = 6,
    vocab: int = 50,
    follow: float = 0.75,
    max_new_tokens: int | None = None,
) -> Trace:
    """A structurally valid trace whose trees contain the trajectory's next tokens often (so accepted
    lengths vary), built like the engine builds trees: each level expands the top-``width`` frontier."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=length).astype(np.int32)
    offsets, n_tok, n_par, n_dep, n_sc = [0], [], [], [], []
    for t in range(length):
        toks, pars, deps, scs = [], [], [], []
        frontier, on_path = [(-1, 0.0)], {-1: True}
        for depth in range(1, max_depth + 1):
            cands = []
            for parent, pscore in frontier:
                probs = np.sort(rng.dirichlet(np.ones(width) * 0.5))[::-1]
                choices = [int(x) for x in rng.choice(vocab, size=width, replace=False)]
                target = t + depth
                if on_path.get(parent) and target < length and rng.random() < follow:
                    z = int(tokens[target])
                    if z in choices:
                        choices.remove(z)
                    choices = [z] + choices[: width - 1]
                for tok, prob in zip(choices, probs):
                    idx = len(toks)
                    toks.append(tok)
                    pars.append(parent)
                    deps.append(depth)
                    scs.append(np.float32(pscore + np.log(prob)))
                    on_path[idx] = bool(on_path.get(parent) and target < length and tok == tokens[target])
                    cands.append((idx, scs[-1]))
            order = sorted(range(len(cands)), key=lambda i: (-cands[i][1], cands[i][0]))[:width]
            frontier = [cands[i] for i in order]
        offsets.append(offsets[-1] + len(toks))
        n_tok += toks
        n_par += pars
        n_dep += deps
        n_sc += scs
    meta = {
        "tree_width": width,
        "max_depth": max_depth,
        "max_new_tokens": max_new_tokens or length,
        "max_context": 10_000,
        "pair": "synthetic",
        "prompt_ids": [int(x) for x in tokens[:10]],  # context lookup replay reads the prompt
    }
    return Trace(
        f"synthetic-{seed}",
        10,
        tokens,
        np.asarray(offsets, np.int64),
        np.asarray(n_tok, np.int32),
        np.asarray(n_par, np.int16),
        np.asarray(n_dep, np.int8),
        np.asarray(n_sc, np.float32),
        meta,
    )


def recorded_chains(pair, prompts, max_depth, new):
    """(prompt ids, greedy chain traces recorded alone) of ``prompts`` on ``pair``."""
    from engine.sampling import SamplingConfig
    from envs.record_traces import record_trace
    from envs.replay import ReplayTrace

    ids = [pair.tokenizer.encode(p) for p in prompts]
    rts = [
        ReplayTrace(
            record_trace(pair, i, p, SamplingConfig(), max_depth, 1, max_new_tokens=new),
            engine_max_depth=max_depth,
        )  # fmt: skip
        for i, p in zip(ids, prompts)
    ]
    return ids, rts


LATE_STARTS = (0, 3, 9)
"""Cycles each of the three requests of ``three_late_starters`` holds back before it drafts."""


def three_late_starters(pair, new):
    """(prompt ids, their chain traces, a ``BatchConfig``) of three prompts decoded together under a row cap that
    cuts verifications (5 rows) and a catch-up bound of 6, at depth 4, ``new`` tokens each: with
    ``late_starter(s, depth=3)`` controllers (s in ``LATE_STARTS``) the live batch makes catch-up cycles."""
    from engine.batch_api import BatchConfig
    from engine.inputs import EngineConfig

    max_depth = 4
    prompts = ["def main():\n    return", "The quick brown fox jumps over", "Once upon a time, in a land far"]
    ids, rts = recorded_chains(pair, prompts, max_depth, new)
    config = BatchConfig(
        max_requests=3, max_rows=5, engine=EngineConfig(max_depth=max_depth, draft_catch_up_tokens=6)
    )
    return ids, rts, config
