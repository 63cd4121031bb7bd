"""Randomised cost profiles for training one policy that serves devices it never saw (docs/training.md, "Randomised devices").

A policy observes its device only through ``engine.costs.observation.device_features`` (ratios of the cost profile:
draft step, verify(16), verify(64), verify(0), verify(2) and verify(4), each over verify(1)). Trained on one profile, it
sees one point of that space and learns nothing about how the right depth moves with it. ``ProfileMix``
draws, per training episode, one measured profile from a set (other weight formats, thread counts, CPUs)
and perturbs it: the draft cost, the slope of the verification curve (the cost of every row after the
first) and the per-cycle overhead are each scaled by an independent log-uniform factor. Every drawn
profile is first rescaled to the reference profile's one-token verify time, so that the average reward's
rho (tokens per second, set on the reference) keeps its meaning: the best decisions depend only on the
ratios, which the rescaling keeps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.costs.cost_profile import CostProfile, chunk_curve
from engine.errors import InputError

REFERENCE_CONTEXT = 512
"""Context at which profiles are rescaled to the reference (the device features' context)."""


@dataclass(frozen=True)
class PerturbedProfile:
    """``base`` with every time scaled by ``scale``, draft forwards by ``draft``, the cost of verified rows
    beyond the first by ``slope`` and the per-cycle overhead by ``overhead`` (the replay interface of
    ``CostProfile``: what ``envs.replay`` and ``engine.costs.observation`` call)."""

    base: CostProfile
    scale: float = 1.0
    draft: float = 1.0
    slope: float = 1.0
    overhead: float = 1.0

    @property
    def meta(self) -> dict:
        return {
            **self.base.meta,
            "perturbation": {
                "scale": self.scale,
                "draft": self.draft,
                "slope": self.slope,
                "overhead": self.overhead,
            },
        }

    def draft_step_s(self, width: int, context: int) -> float:
        return self.scale * self.draft * self.base.draft_step_s(width, context)

    def draft_chunk_s(self, num_pending: int, context: int) -> float:
        return self.scale * self.draft * self.base.draft_chunk_s(num_pending, context)

    def draft_chunk_curve(self, max_pending: int, context: int) -> np.ndarray:
        return self.scale * self.draft * chunk_curve(self.base, max_pending, context)

    def verify_s(self, num_nodes: int, context: int, chain: bool = False) -> float:
        one = self.base.verify_s(0, context, chain)  # the root alone: an autoregressive step
        more = self.base.verify_s(num_nodes, context, chain) - one
        return self.scale * (one + self.slope * more)

    def overhead_s(self, num_nodes: int, depth: int = 1, tree_width: int = 1) -> float:
        return self.scale * self.overhead * self.base.overhead_s(num_nodes, depth, tree_width)

    def noise_scale(self, rng: np.random.Generator) -> float:
        return self.base.noise_scale(rng)

    def prefill_s(self, prompt_len: int, with_draft: bool = True) -> float:
        """The prefills, scaled with every time (the draft's also by ``draft``)."""
        target = self.base.prefill_s(prompt_len, with_draft=False)
        draft = self.base.prefill_s(prompt_len, with_draft=True) - target if with_draft else 0.0
        return self.scale * (target + self.draft * draft)


class ProfileMix:
    """Draws a training profile per episode: one of ``profiles`` (uniformly), rescaled to ``reference``'s
    one-token verify time, each factor (draft, slope, overhead) log-uniform in [1 / (1 + p), 1 + p] for
    ``perturbation`` p (0: the measured profiles as they are)."""

    def __init__(self, profiles: Sequence[CostProfile], reference: CostProfile, perturbation: float = 0.0):
        if not profiles:
            raise InputError("a profile mix needs at least one profile")
        if not (math.isfinite(perturbation) and 0.0 <= perturbation <= 10.0):
            raise InputError(f"profile perturbation must be in [0, 10], got {perturbation}")
        self.profiles, self.reference, self.perturbation = list(profiles), reference, float(perturbation)
        target = reference.verify_s(1, REFERENCE_CONTEXT)
        self.scales = [target / p.verify_s(1, REFERENCE_CONTEXT) for p in self.profiles]

    def __deepcopy__(self, memo):
        return self  # read-only

    def sample(self, rng: np.random.Generator) -> PerturbedProfile:
        i = int(rng.integers(len(self.profiles)))
        span = math.log1p(self.perturbation)
        draft, slope, overhead = (float(math.exp(rng.uniform(-span, span))) for _ in range(3))
        return PerturbedProfile(self.profiles[i], self.scales[i], draft, slope, overhead)

    def members(self) -> list[PerturbedProfile]:
        """The measured profiles, rescaled, unperturbed (what validation averages over)."""
        return [PerturbedProfile(p, s) for p, s in zip(self.profiles, self.scales)]
