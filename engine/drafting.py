"""The draft phase of a speculative cycle, level by level: the first draft forward runs the draft's pending
tokens, each later one the frontier of a width-W tree (a tree mask: each node sees the committed prefix and its
own ancestors), the frontier chosen by ``engine.tree.expand_topk`` (or drawn, for a sampled chain); between
levels the cycle's plan (``engine.cycle.CyclePlan``) asks the controller in the ``DraftState`` built here
whether to go on. A part of ``SpeculativeEngine`` (it inherits ``DraftPhase``), kept apart to keep the
module of the cycle's other phases readable."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.backends.kvcache import cache_len
from engine.backends.pair import ModelPair
from engine.control import DraftState
from engine.cycle import CyclePlan
from engine.forward import Clock, Forward, Steps
from engine.sampling import check_finite, logits_to_probs, score_logprobs
from engine.tree import DraftTree, expand_topk, tree_attention_mask

if TYPE_CHECKING:
    from engine.inputs import EngineConfig
    from engine.prefill import RequestState


class DraftPhase:
    """The draft phase's methods of ``SpeculativeEngine`` (module docstring)."""

    pair: ModelPair
    config: EngineConfig
    clock: Clock
    device: torch.device
    _run: Callable[[Steps], Any]
    """``SpeculativeEngine._run``: drives a phase alone."""

    def _draft(
        self, req: RequestState, plan: CyclePlan, cap: int
    ) -> tuple[DraftTree, list[int], list[torch.Tensor], float, float]:
        """Draft level by level while ``plan`` asks whether to go on (below ``cap``) and its controller says
        yes: (tree, frontier, draft distributions of a sampled chain, forward seconds, controller seconds)."""
        return self._run(self._draft_steps(req, plan, cap))

    def _draft_steps(self, req: RequestState, plan: CyclePlan, cap: int) -> Steps:
        """``_draft`` as a generator of its forwards (one a draft step)."""
        clock, ctx, width = self.clock, len(req.tokens), plan.controller.tree_width
        sampled = self.config.draft_mode == "sampled"
        tree, draft_probs, fwd_s, ctrl_s = DraftTree(), [], 0.0, 0.0

        # step 1: run the draft's pending tokens; the last row predicts the root's children
        t0 = clock()
        pending = req.tokens[req.draft_len :]
        logits = yield Forward(self.pair.draft, pending, req.draft_len, req.draft_cache, keep=1)  # [1, V]
        fwd_s += clock() - t0
        req.draft_len = ctx
        frontier = self._expand(tree, [-1], [0.0], logits, width, sampled, draft_probs, req)

        while plan.question[0] == "depth":  # asked after each level below the cap
            t0 = clock()
            go = plan.ask(self._state(tree, frontier, ctx, cap, req))
            ctrl_s += clock() - t0
            if not go:
                break
            depth = tree.depths[frontier[0]]
            base = cache_len(req.draft_cache)
            for j, node in enumerate(frontier):
                tree.draft_slot[node] = base - ctx + j
            mask = None
            if width > 1:  # each frontier node sees the committed prefix and its own ancestors only
                allowed = np.zeros((len(frontier), base - ctx + len(frontier)), dtype=bool)  # [W, tail]
                for j, node in enumerate(frontier):
                    for anc in tree.path_to(node):
                        allowed[j, tree.draft_slot[anc]] = True
                mask = tree_attention_mask(ctx, allowed, self.pair.dtype, self.device)
            t0 = clock()
            logits = yield Forward(
                self.pair.draft,
                [tree.tokens[n] for n in frontier],
                ctx - 1 + depth,
                req.draft_cache,
                mask=mask,
                positions=[ctx - 1 + depth] * len(frontier),
            )  # [W, V]
            fwd_s += clock() - t0
            scores = [tree.scores[n] for n in frontier]
            frontier = self._expand(tree, frontier, scores, logits, width, sampled, draft_probs, req)
        return tree, frontier, draft_probs, fwd_s, ctrl_s

    def _expand(
        self,
        tree: DraftTree,
        parents: Sequence[int],
        parent_scores: Sequence[float],
        logits: torch.Tensor,
        width: int,
        sampled: bool,
        draft_probs: list[torch.Tensor],
        req: RequestState,
    ) -> list[int]:
        """Add the children of ``parents`` (one row of ``logits`` each); return the new frontier."""
        if self.config.check_finite:
            check_finite(logits, "draft")
        logprobs = score_logprobs(logits, req.sampling)  # [P, V]
        if sampled:  # chain of draws from the processed draft distribution (Leviathan)
            probs = logits_to_probs(logits[-1], req.sampling)  # [V]
            token = int(torch.multinomial(probs, 1, generator=req.generator))
            draft_probs.append(probs)
            return [tree.add(token, parents[-1], parent_scores[-1] + float(logprobs[-1, token]))]
        return expand_topk(tree, parents, parent_scores, logprobs, width)

    def _state(
        self, tree: DraftTree, frontier: list[int], ctx: int, cap: int, req: RequestState
    ) -> DraftState:
        scores = np.asarray(tree.scores, dtype=np.float32)
        frontier_scores = scores[frontier]
        step = frontier_scores - np.asarray(
            [tree.scores[p] if p >= 0 else 0.0 for p in (tree.parents[n] for n in frontier)], dtype=np.float32
        )
        return DraftState(
            depth=tree.depths[frontier[0]] if frontier else 0,
            frontier_scores=-np.sort(-frontier_scores),
            step_probs=np.exp(step),
            node_scores=-np.sort(-scores),
            context_len=ctx,
            max_depth=cap,
            history=req.cycles,
            temperature=req.sampling.temperature,
            load=req.load,
        )
