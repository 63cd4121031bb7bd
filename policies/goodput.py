"""A goodput controller in the manner of SmartSpec (arXiv 2406.14066): each request chooses its draft length from
its own acceptance history and what a step costs at the load it decodes under, 0 (no draft) included.

The request's acceptance. Two estimates per request, each an exponential moving average with a prior, read
from the request's own cycles (``DraftState.history``): of the draft model (its speculative cycles) and of
context lookup (its lookup cycles, which the engine decides, ``engine.lookup``). A cycle that verified v tokens
and accepted a of them is a + 1 Bernoulli trials of the per-token acceptance (a successes) when a < v, a trials
when all were accepted (the geometric maximum likelihood the analytic controller uses too). The estimate is
``(A + w p) / (T + w)``, A and T the successes and trials, each decayed by ``decay`` at every new cycle of its
kind, p the prior and w its weight: until the draft has run, its prior is the lookup's estimate when the request
has had lookup cycles (a request whose lookup proposals are accepted copies its input, and the draft copies it
as well), else ``prior``.

The length. Alpha the draft's estimate, a chain of d drafted tokens all verified is expected to emit
E(alpha, d) = (1 - alpha^(d+1)) / (1 - alpha) tokens (``engine.costs.speedup_model.expected_tokens``; d = 0:
one, an autoregressive step) for the cycle's cost at the load: d draft steps and the verification of d rows in
the batched step, each charged what it adds to the forwards every request in the step waits on plus an equal
share of the rest (``engine.costs.load_model``, the server replay's accounting). The controller drafts the d in
0..max_depth with the most expected tokens per second of that cost: the request's goodput in the batch's step,
so under load, where a verified row costs more of the step, only drafts likely accepted pay. Alone (no load)
it is the request's own cycle time. While it does not draft, it drafts one token every ``probe_every`` cycles
to refresh its estimate.

Context lookup (``decides_lookup``, on by default). Where the engine's lookup proposes k tokens, the controller
verifies them when their expected tokens per second, E(alpha_lookup, k) over the cost of verifying k rows at the
load, is at least that of its best draft length; else the cycle is its own. So a request whose input it copies
keeps lookup under any load, and one whose proposals miss drops it, whatever the engine's one load limit says
(``LookupConfig.max_requests``: the rule of controllers that do not decide). After ``probe_every`` proposals
declined in a row it takes one, to refresh the estimate.

Exact like every controller: it only chooses how much to draft and verify.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.control import Controller, DraftState
from engine.costs.cost_profile import CostProfile
from engine.costs.load_model import LoadedProfiles
from engine.costs.speedup_model import cycle_cost_s, expected_tokens
from engine.results import CycleRecord

MAX_ALPHA = 0.99
"""The largest per-token acceptance an estimate takes (alpha = 1 would make every length worth drafting)."""


class AcceptanceEstimate:
    """A per-token acceptance estimate: decayed successes and trials with a prior (module docstring)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.successes = 0.0
        self.trials = 0.0
        self.cycles = 0

    def add(self, accepted: int, verified: int) -> None:
        """One cycle that verified ``verified`` tokens and accepted ``accepted`` of them."""
        trials = accepted + (1 if accepted < verified else 0)
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + trials
        self.cycles += 1

    def value(self, prior: float, weight: float) -> float:
        """(successes + weight x prior) / (trials + weight), at most ``MAX_ALPHA``."""
        return min((self.successes + weight * prior) / (self.trials + weight), MAX_ALPHA)


class GoodputController(Controller):
    """Draft the chain length with the most expected tokens per second of the request's share of the batch's
    step, from the request's own acceptance (module docstring); verify every drafted token. ``profile``: a cost
    profile (``engine.costs.cost_profile.CostProfile``; its batch axis, when it has one, prices the load)."""

    decides_depth_zero = True
    tree_width = 1

    def __init__(
        self,
        profile: CostProfile,
        max_depth: int = 8,
        prior: float = 0.6,
        prior_weight: float = 2.0,
        decay: float = 0.8,
        probe_every: int = 16,
        load_aware: bool = True,
        gate_lookup: bool = True,
    ):
        if profile is None:
            raise ValueError("GoodputController needs a cost profile (python -m engine.costs.measure_costs)")
        if not 0.0 <= prior <= 1.0 or prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(
                f"prior must be in [0, 1], prior_weight > 0 and decay in (0, 1], got {prior}, {prior_weight}, "
                f"{decay}"
            )
        if max_depth < 1 or probe_every < 1:
            raise ValueError(f"max_depth and probe_every must be >= 1, got {max_depth}, {probe_every}")
        self.profile, self.max_depth = profile, max_depth
        self.prior, self.prior_weight, self.decay, self.probe_every = prior, prior_weight, decay, probe_every
        self.loads = LoadedProfiles(profile) if load_aware else None
        self.decides_lookup = bool(gate_lookup)
        self.reset()

    def reset(self) -> None:
        self.draft = AcceptanceEstimate(self.decay)
        self.lookup = AcceptanceEstimate(self.decay)
        self._seen = 0
        self._length = 0
        self._off = 0
        self._declined = 0

    # ------------------------------------------------------------------------------------ estimates
    def absorb(self, history: Sequence[CycleRecord]) -> None:
        """Add the request's cycles not yet counted (lookup cycles to the lookup's estimate, speculative ones to
        the draft's; autoregressive and catch-up cycles carry no evidence)."""
        if len(history) < self._seen:  # another request's history: start over
            self.reset()
        for record in history[self._seen :]:
            if record.num_verified <= 0:
                continue
            if record.lookup:
                self.lookup.add(record.accepted, record.num_verified)
            elif record.depth > 0:
                self.draft.add(record.accepted, record.num_verified)
        self._seen = len(history)

    def lookup_alpha(self) -> float:
        """The request's per-token acceptance of lookup proposals (the prior before any)."""
        return self.lookup.value(self.prior, self.prior_weight)

    def draft_alpha(self) -> float:
        """The request's per-token acceptance of the draft; before the draft has run, the lookup's estimate where
        there is one, else the prior."""
        prior = self.lookup_alpha() if self.lookup.cycles else self.prior
        return self.draft.value(prior, self.prior_weight)

    # ------------------------------------------------------------------------------------ the rule
    def _profile(self, state: DraftState):
        return self.loads.at(state.load) if self.loads is not None else self.profile

    def goodputs(self, alpha: float, state: DraftState) -> np.ndarray:
        """[d + 1] expected tokens per second of drafting d = 0..cap tokens (all verified) at the state's load."""
        profile = self._profile(state)
        cap = max(0, min(self.max_depth, state.max_depth))
        out = np.empty(cap + 1)
        for d in range(cap + 1):
            cost = cycle_cost_s(profile, d, [d], state.context_len, 1)[0]
            out[d] = expected_tokens(alpha, d) / max(cost, 1e-9)
        return out

    def length(self, state: DraftState) -> int:
        """The draft length this cycle (0: an autoregressive step)."""
        self.absorb(state.history)
        best = int(np.argmax(self.goodputs(self.draft_alpha(), state)))
        if best == 0 and self._off + 1 >= self.probe_every and state.max_depth >= 1:
            best = 1  # refresh the estimate
        self._off = self._off + 1 if best == 0 else 0
        return best

    def lookup_goodput(self, state: DraftState) -> float:
        """Expected tokens per second of verifying the lookup's ``state.lookup_proposed`` tokens at the state's
        load (a lookup cycle is charged as the replay charges it: a k-token chain verified, no draft step)."""
        profile, k, ctx = self._profile(state), int(state.lookup_proposed), state.context_len
        cost = profile.verify_s(k, ctx, chain=True) + profile.overhead_s(k, depth=1)
        return expected_tokens(self.lookup_alpha(), k) / max(cost, 1e-9)

    def use_lookup(self, state: DraftState) -> bool:
        self.absorb(state.history)
        best_draft = float(self.goodputs(self.draft_alpha(), state).max())
        take = self.lookup_goodput(state) >= best_draft or self._declined + 1 >= self.probe_every
        self._declined = 0 if take else self._declined + 1
        return take

    def should_continue(self, state: DraftState) -> bool:
        if state.depth == 0:
            self._length = self.length(state)
            return self._length > 0
        return state.depth < self._length

    def num_to_verify(self, state: DraftState) -> int:
        return state.depth

    def __repr__(self) -> str:
        return (
            f"GoodputController(max_depth={self.max_depth}, prior={self.prior}, decay={self.decay}, "
            f"load_aware={self.loads is not None}, gate_lookup={self.decides_lookup})"
        )
