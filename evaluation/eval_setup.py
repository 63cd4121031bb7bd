"""What every part of the evaluation shares (``evaluation.runner``): ``Setup`` (the config, the tune and test
prompts, the models, the cost profile, the policy file, W and D_max, the controller factories, the warnings on
what was left out or differs from training) and ``Engines`` (the plain engine and the one with context lookup
drafting for the ``+lookup`` controllers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.control import StaticController
from engine.costs.cost_profile import load_profile_arg
from engine.engine import SpeculativeEngine
from engine.errors import DraftpilotError, InputError
from engine.inputs import EngineConfig
from engine.lookup import LookupConfig, describe_lookup, resolve_lookup
from engine.sampling import SamplingConfig
from envs import workspace
from evaluation.config import LLAMA_PEERS, LOOKUP_SUFFIX, EvalConfig, find_policy, select_prompts
from peers.llama_peer import LlamaPeer
from policies.analytic import AnalyticController
from policies.goodput import GoodputController
from policies.heuristic import ConfidenceController, HeuristicController
from policies.learned import load_policy
from policies.learned_controller import trained_lookup

STATIC = ("static_chain", "static_tree")
DEFAULT_WIDTH, DEFAULT_DEPTH = 4, 8
"""W and D_max without a policy (and the static tree's W next to a chain policy); D_max is train.py's
default, W is not: train.py trains chains by default (W 1), the static tree baseline stays a tree."""


class Setup:
    """What every part of the evaluation shares: config, prompts, models, profile, policy, W and D_max."""

    def __init__(self, config: EvalConfig):
        self.config = config
        self.names = config.controller_names()
        self.tune_prompts, self.test_prompts, self.warnings = select_prompts(config)
        self.policy_path = find_policy(config) if config.uses_policy() else None
        try:  # fail early on a bad file
            policy = load_policy(self.policy_path) if self.policy_path else None
        except (DraftpilotError, OSError) as err:
            raise InputError(f"--policy: {err}") from None
        self.policy_meta = policy.meta if policy else None
        self.lookup = resolve_lookup(config.lookup, policy.trained_lookup if policy else None, LookupConfig())
        """The engine's context lookup setting of the ``+lookup`` controllers."""
        self.width = config.tree_width or (policy.tree_width if policy else DEFAULT_WIDTH)
        self.max_depth = config.max_depth or (policy.max_depth if policy else DEFAULT_DEPTH)
        if policy and self.width != policy.tree_width:
            self.warnings.append(
                f"tree_width {self.width} differs from the policy's {policy.tree_width}: the "
                "learned policy keeps its own width and has no replay prediction"
            )
        self.tree_width = self.width if (self.width > 1 or config.tree_width) else DEFAULT_WIDTH
        """W of the static tree baseline: W, except that a chain policy (W 1) is still compared with a
        width-4 tree unless --tree-width 1 is asked for."""
        if "static_tree" in self.names and self.tree_width == 1:
            self.names.remove("static_tree")
            self.warnings.append("tree_width is 1: the static tree is the static chain, measured once")
        self.pair = config.load()
        self.llama = None
        if any(n in LLAMA_PEERS for n in self.names):
            self.llama, why = LlamaPeer.find(config, self.pair, threads=torch.get_num_threads())
            if self.llama is None:
                self.names = [n for n in self.names if n not in LLAMA_PEERS]
                self.warnings.append(why)
            elif "llama_cpp_lookup" in self.names and not self.llama.binaries.ngram_simple:
                self.names.remove("llama_cpp_lookup")
                self.warnings.append(
                    "llama_cpp_lookup left out: this llama.cpp build has no --spec-type ngram-simple"
                )
        if policy:
            self.warnings += lookup_mismatches(self.policy_meta, self.names, self.lookup)
        if policy and self.policy_meta.get("pair") not in (None, self.pair.name):
            self.warnings.append(
                f"the policy was trained on pair {self.policy_meta.get('pair')!r}, evaluated on "
                f"{self.pair.name!r}"
            )
        self._profile = None
        if config.profile:  # a given profile file is read now: a bad one fails before anything is written
            self._profile = load_profile_arg(config.profile)

    @property
    def loaded_profile(self):
        """The profile if something has used it, else None (never measures one)."""
        return self._profile

    @property
    def profile(self):
        """The cost profile, loaded (or measured once and cached) on first use only."""
        if self._profile is None:
            config = self.config
            self._profile = workspace.ensure_profile(
                self.pair,
                config.cache_dir,
                config.profile,
                widths=(1, 2, self.width, self.tree_width),
                progress=config.progress,
            )
        return self._profile

    def learned(self):
        return load_policy(self.policy_path, profile=self.profile)  # device features of this device's profile

    def factories(self, static_best: dict[str, dict]) -> dict[str, Callable[[], object] | None]:
        """Engine controller name -> factory of a fresh controller (None: autoregressive); a ``+lookup`` name
        gets its base controller's factory (the lookup is the engine's: ``Engines``)."""
        made: dict[str, Callable[[], object] | None] = {"autoregressive": None}
        for full in self.names:
            name = full.removesuffix(LOOKUP_SUFFIX)
            if name == "autoregressive":
                made[full] = None
            elif name in STATIC:
                if name in static_best:
                    best = static_best[name]
                    made[full] = lambda b=best: StaticController(
                        b["depth"], b["verify"], tree_width=b["tree_width"]
                    )
            elif name == "heuristic":
                made[full] = HeuristicController
            elif name == "confidence":
                made[full] = lambda: ConfidenceController(0.4)
            elif name == "analytic":
                made[full] = lambda: AnalyticController(
                    self.profile, tree_width=self.width, max_depth=self.max_depth
                )
            elif name == "goodput":
                made[full] = lambda: GoodputController(self.profile, max_depth=self.max_depth)
            elif name == "learned":
                made[full] = self.learned
        return made


def lookup_mismatches(policy_meta: dict, names: Sequence[str], lookup: LookupConfig | None) -> list[str]:
    """Warnings for a learned row whose engine's context lookup differs from the one the policy was trained
    with (``train.py --lookup``; policies stored before the setting were trained without)."""
    trained = trained_lookup(policy_meta)
    out = []
    for name, used in (("learned", None), ("learned" + LOOKUP_SUFFIX, lookup)):
        # the rows decode one request at a time: a load limit (``LookupConfig.max_requests``) changes nothing
        if name in names and (used and used.rules) != (trained and trained.rules):
            out.append(
                f"{name} runs with context lookup {describe_lookup(used)}, the policy was trained with "
                f"{describe_lookup(trained)} (train.py --lookup): its decisions assume the other engine"
            )
    return out


class Engines:
    """The evaluation's engines: plain, and with context lookup drafting for the ``+lookup`` controllers."""

    def __init__(self, pair, temperature: float, lookup: LookupConfig | None):
        sampling = SamplingConfig(temperature=temperature)
        self.plain = SpeculativeEngine(pair, sampling)
        self.lookup = SpeculativeEngine(pair, sampling, EngineConfig(lookup=lookup)) if lookup else None

    def __call__(self, name: str) -> SpeculativeEngine:
        if name.endswith(LOOKUP_SUFFIX):
            if self.lookup is None:
                raise ValueError(f"{name}: this evaluation has no lookup setting")
            return self.lookup
        return self.plain
