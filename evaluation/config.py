"""The evaluation's one config dataclass (command-line flags are generated from it), its quick preset,
the controller names, prompt selection and the default policy lookup."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from engine.cli import ModelConfig
from engine.lookup import LookupConfig, resolve_lookup
from envs.prompts import interleave_languages, is_prompt_set, load_suite, read_suite
from envs.recording import MAX_TRACE_DEPTH
from peers.llama_peer import parse_lookup_setting, parse_spec_setting
from policies.selection import parse_policy

ENGINE_CONTROLLERS = (
    "autoregressive",
    "static_chain",
    "static_tree",
    "heuristic",
    "confidence",
    "analytic",
    "goodput",
    "learned",
    "autoregressive+lookup",
    "static_chain+lookup",
    "goodput+lookup",
    "learned+lookup",
)
"""Controllers measured live on our engine (autoregressive: ``controller=None``); a name ending in
``LOOKUP_SUFFIX`` is its base controller on an engine with context lookup drafting (``EvalConfig.lookup``)."""
LOOKUP_SUFFIX = "+lookup"
PEERS = ("hf_assisted_default", "hf_assisted_heuristic")
"""transformers' assisted generation (``assistant_model=``) with its default and its heuristic schedule."""
LLAMA_PEERS = ("llama_cpp", "llama_cpp_spec", "llama_cpp_lookup")
"""llama.cpp on the same GGUF files (peers.llama_peer): its autoregressive decoding, its speculative
decoding with the draft model, and its n-gram lookup drafting (no draft model)."""
REPLAY_ONLY = ("oracle",)
"""The hindsight oracle: replay numbers on the test traces (it needs the future)."""
CONTROLLERS = ENGINE_CONTROLLERS + PEERS + LLAMA_PEERS + REPLAY_ONLY
BASELINE = "autoregressive"


@dataclass
class EvalConfig(ModelConfig):
    """One evaluation run (saved as ``config.json`` in the output directory); the model fields (pair, formats,
    device, threads) come from ``engine.cli.ModelConfig``."""

    policy: str | None = None
    """Exported learned policy (policy.pt); none: the newest runs/*/policy.pt."""
    controllers: str = "all"
    """Comma list of controllers to run (all: every one). Names: autoregressive, static_chain, static_tree,
    heuristic, confidence, analytic, goodput (policies.goodput), learned, autoregressive+lookup,
    static_chain+lookup, goodput+lookup, learned+lookup (the controller on an engine with context lookup
    drafting, --lookup), hf_assisted_default, hf_assisted_heuristic,
    llama_cpp, llama_cpp_spec, llama_cpp_lookup, oracle. autoregressive always runs: every speedup is measured against it."""
    lookup: str = "auto"
    """The context lookup setting of the +lookup controllers: "auto" (the policy's own, train.py --lookup, else
    "on"), "on" (engine.lookup.LookupConfig's defaults), MIN-MAX:K (n-gram sizes MIN..MAX, up to K proposed
    tokens) or MIN-MAX:K+L:J (and up to J after an L-token match)."""
    llama_bin: str = ""
    """Directory with llama.cpp's llama-completion and llama-speculative-simple for the llama_cpp rows (empty:
    where benchmarks/llama_cpp.py builds and caches them). evaluate.py never builds llama.cpp: without the
    programs, or for a pair not published as GGUF, the rows are left out with a warning."""
    llama_lookup: str = "3:3"
    """llama_cpp_lookup's N:M (--spec-type ngram-simple: lookup the last N tokens, draft up to M >= N)."""
    llama_spec: str = "16,0.75"
    """llama_cpp_spec's --spec-draft-n-max,--spec-draft-p-min (the default comes from benchmarks/llama_cpp.py's
    grid on the default pair)."""
    prompts: str | None = None
    """Prompt suite JSONL ({"id", "language", "task", "prompt"} per line, optional "split") or a built-in set's
    name: suite, long, grounded (input-grounded requests) or mixed (grounded and suite one to one; envs.prompts);
    none: the built-in suite. A file without split keys is all test set, and the static grid is then tuned on the same prompts
    (the report warns loudly)."""
    split: str = "test"
    """Split the controllers are measured on."""
    tune_split: str = "tune"
    """Split the static grid is searched on (never the measured split)."""
    languages: str = "all"
    """Comma list of languages (it, en, zh, es, ...); all: every language of the suite."""
    prompts_per_language: int | None = None
    """Measured prompts per language (none: all of the split, 12 per language in the built-in suite)."""
    tune_prompts_per_language: int = 2
    """Tune prompts per language for the static grid search."""
    max_new_tokens: int = 128
    """Tokens generated per measured prompt."""
    tune_max_new_tokens: int | None = None
    """Tokens per tune prompt (none: --max-new-tokens, so the static grid is searched under the conditions it
    is measured in; a shorter grid search favours shallower drafts)."""
    temperature: float = 0.0
    """0: greedy; > 0: sampled (drafts stay deterministic top-k trees; the exact sampler keeps the law)."""
    audit_temperature: float = 0.7
    """Temperature of the sampled exactness test when the evaluation itself is greedy."""
    tree_width: int | None = None
    """Draft tree width W of the static tree, the analytic controller and replay traces (none: the policy's;
    with a chain policy the static tree keeps width 4 unless 1 is given)."""
    max_depth: int | None = None
    """Deepest draft level D_max of the grid, the analytic controller and traces (none: the policy's)."""
    confirm_top: int = 3
    """Best replay-grid configurations of each kind (chain, tree) confirmed live on the tune prompts."""
    reps: int = 1
    """Repetitions of every live measurement (the per-prompt median is reported)."""
    concurrency: int = 1
    """> 1: also run N requests at once (N worker threads, one engine each, shared weights)."""
    server_replay: bool = True
    """Report the learned policy and the load baselines (autoregressive, lookup only, static tuned at N=1, the
    per-load static table, analytic given the load) under load in the server replay (envs.server: the batched
    engine's steps over the measured prompts' traces, recorded when --no-replay did not): system tokens/s per
    closed-loop load level and on a Poisson run whose rate changes (report section "Under load (server
    replay)"). Needs a cost profile with a batch axis (the cached one has it)."""
    server_concurrencies: tuple[int, ...] | None = None
    """Closed-loop load levels (concurrent clients) of the server replay; none: the policy's training levels
    (train.py --concurrencies), 1,2,4,8 without a policy or for one stored without them."""
    replay: bool = True
    """Record test-prompt traces for the hindsight oracle and the replay-vs-live comparison."""
    exactness: bool = True
    """Run the sampled exactness test and the sampler law checks (the greedy token audit is always made)."""
    exactness_prompts: int = 2
    """Prompts of the sampled two-sample test."""
    samples: int = 200
    """Samples per arm per prompt in the sampled two-sample test (different seeds)."""
    exactness_tokens: int = 3
    """k: the sampled test compares the joint law of the first k emitted tokens."""
    exactness_budget: int | None = 8
    """New tokens per speculative request of the sampled test (none: k). The engine caps draft depth at the
    remaining budget, so with a budget of k the first cycle drafts one level at most; 8 lets the controller
    draft as it would mid-answer before the k-th token (the autoregressive arm always stops at k)."""
    exactness_prompt_set: str = "open"
    """Prompts of the sampled test: "open" = built-in open-ended requests, one per language, whose first
    tokens vary at temperature 0.7 (a test where the first k tokens are nearly fixed has no power);
    "split" = the measured prompts."""
    law_trials: int = 20_000
    """Monte Carlo trials per case of the verify_chain law checks."""
    bootstrap: int = 2000
    """Bootstrap resamples (over prompts) of every confidence interval."""
    profile: str | None = None
    """Cost profile JSON; none: the cached one for this pair/device/dtype (measured on first use)."""
    seed: int = 0
    """Generation seed of every measured run (= the traces' seed) and of the bootstrap."""
    cache_dir: str = "runs/cache"
    """Where profiles and traces are cached (shared with train.py)."""
    out: str | None = None
    """Output directory (report.md, results.json, plots); none: runs/eval-<timestamp>."""
    progress: bool = True
    """Progress bars."""
    restart: bool = False
    """Start afresh in --out: remove what an earlier evaluation left there (a partial run, or a finished report
    with its results, figures and config). Without it, the same command resumes a partial run (static grid
    result and measured prompts kept); a partial run with another config or a finished one is an error."""

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_spec_setting(self.llama_spec)  # a bad setting fails before any model loads
        parse_lookup_setting(self.llama_lookup)
        if resolve_lookup(self.lookup, otherwise=LookupConfig()) is None:
            raise ValueError(
                f'lookup (--lookup) is the setting of the +lookup controllers: not "off", got {self.lookup!r}'
            )
        for name in (
            "tune_prompts_per_language",
            "max_new_tokens",
            "confirm_top",
            "reps",
            "concurrency",
            "exactness_prompts",
            "samples",
            "exactness_tokens",
            "law_trials",
            "bootstrap",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed (--seed) must be in [0, 2**32), got {self.seed}")
        if self.server_concurrencies is not None:  # a list when read from JSON
            self.server_concurrencies = tuple(int(n) for n in self.server_concurrencies)
            if not self.server_concurrencies or min(self.server_concurrencies) < 1:
                raise ValueError(
                    "server_concurrencies (--server-concurrencies) must be integers >= 1 or none, got "
                    f"{self.server_concurrencies}"
                )
        depth, width = self.max_depth or 1, self.tree_width or 1
        if depth > MAX_TRACE_DEPTH or width * width * depth > 32767:  # the trace format
            raise ValueError(
                f"--max-depth {self.max_depth}, --tree-width {self.tree_width} do not fit the trace format "
                f"(max_depth <= {MAX_TRACE_DEPTH} and tree_width^2 * max_depth <= 32767)"
            )
        if self.exactness_prompt_set not in ("open", "split"):
            raise ValueError(f"exactness_prompt_set must be open or split, got {self.exactness_prompt_set!r}")
        if self.exactness_budget is not None and self.exactness_budget < self.exactness_tokens:
            raise ValueError(f"exactness_budget must be >= exactness_tokens, got {self.exactness_budget}")
        for name in ("prompts_per_language", "tree_width", "max_depth", "tune_max_new_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or none, got {value}")
        if not self.temperature >= 0 or not self.audit_temperature > 0:
            raise ValueError("temperature must be >= 0 and audit_temperature > 0")
        if self.split == self.tune_split:
            raise ValueError(
                f"split and tune_split are both {self.split!r}: never tune on the measured prompts"
            )
        self.controller_names()  # unknown names fail before any model is loaded

    def controller_names(self) -> list[str]:
        """The controllers to run, in canonical order, autoregressive first."""
        if self.controllers.strip() == "all":
            return list(CONTROLLERS)
        names = [n.strip() for n in self.controllers.split(",") if n.strip()]
        unknown = [n for n in names if n not in CONTROLLERS]
        if unknown:
            raise ValueError(f"unknown controller(s) {unknown}; known: {', '.join(CONTROLLERS)}")
        return [n for n in CONTROLLERS if n in names or n == BASELINE]

    def uses_policy(self) -> bool:
        """Whether a learned policy runs (learned, or learned+lookup)."""
        return any(n.removesuffix(LOOKUP_SUFFIX) == "learned" for n in self.controller_names())

    def tune_tokens(self) -> int:
        """Tokens per tune prompt of the static grid search."""
        return self.tune_max_new_tokens or self.max_new_tokens

    def language_list(self) -> list[str] | None:
        if self.languages.strip() == "all":
            return None
        return [x.strip() for x in self.languages.split(",") if x.strip()]

    def out_dir(self) -> Path:
        return Path(self.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")

    def resolved(self, runs_dir: str | Path = "runs") -> EvalConfig:
        """A copy whose paths are absolute (out, cache_dir, prompts, profile) and whose policy is the file the
        learned policy will be loaded from (``find_policy``: the newest ``runs/*/policy.pt`` when none is
        given; None when the learned policy is not measured), so a stored config names what was used."""

        def absolute(path: str | None) -> str | None:
            return str(Path(path).resolve()) if path else None

        policy = str(find_policy(self, runs_dir).resolve()) if self.uses_policy() else None
        return replace(
            self,
            out=absolute(str(self.out_dir())),
            cache_dir=absolute(self.cache_dir),
            prompts=self.prompts if is_prompt_set(self.prompts) else absolute(self.prompts),
            profile=absolute(self.profile),
            policy=policy,
        )


OPEN_PROMPTS = (
    {"id": "open-it", "language": "it", "task": "open", "prompt": "Scrivi una frase qualsiasi sul mare."},
    {"id": "open-en", "language": "en", "task": "open", "prompt": "Write any one sentence about the sea."},
    {"id": "open-zh", "language": "zh", "task": "open", "prompt": "随便写一句关于大海的话。"},
    {
        "id": "open-es",
        "language": "es",
        "task": "open",
        "prompt": "Escribe una frase cualquiera sobre el mar.",
    },
)
"""Open-ended requests for the sampled exactness test: many plausible first tokens at temperature 0.7."""

QUICK = {
    "tune_prompts_per_language": 1,
    "prompts_per_language": 2,
    "max_new_tokens": 64,
    "reps": 1,
    "confirm_top": 1,
    "samples": 40,
    "exactness_prompts": 1,
    "law_trials": 4000,
    "bootstrap": 1000,
}
"""--quick: a first look (1 tune and 2 measured prompts per language, 64 tokens, 1 rep, confirm the best
grid point only, 40 samples per arm on 1 prompt in the sampled test); explicit flags win."""


def find_policy(config: EvalConfig, runs_dir: str | Path = "runs") -> Path:
    """The configured policy file, or the newest ``runs/*/policy.pt`` (``policies.selection.parse_policy``:
    evaluate.py reads every --policy value as a policy file, and none as the newest one)."""
    choice = parse_policy(config.policy or None, absent="newest")
    if choice.kind == "file":
        path = Path(choice.path)
        if path.is_dir():
            raise IsADirectoryError(f"--policy {path} is a directory, not a policy file")
        if not path.is_file():
            raise FileNotFoundError(
                f"--policy {path}: no policy file there: train one with `python train.py`"
            )
        return path
    found = sorted(Path(runs_dir).glob("*/policy.pt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            f"no policy given and none found under {runs_dir}/*/policy.pt: train one with "
            "`python train.py` (or pass --policy PATH, or leave 'learned' out of --controllers)"
        )
    return found[-1]


def select_prompts(config: EvalConfig) -> tuple[list[dict], list[dict], list[str]]:
    """(tune prompts, measured prompts, warnings), each list interleaved by language."""
    langs = config.language_list()
    warnings: list[str] = []
    has_splits = config.prompts is None or any("split" in item for item in read_suite(config.prompts))
    if has_splits:
        test = load_suite(
            config.prompts,
            split=config.split,
            languages=langs,
            limit_per_language=config.prompts_per_language,
        )
        tune = load_suite(
            config.prompts,
            split=config.tune_split,
            languages=langs,
            limit_per_language=config.tune_prompts_per_language,
        )
        overlap = {p["id"] for p in test} & {p["id"] for p in tune}
        if overlap:
            raise ValueError(f"tune and measured prompts overlap: {sorted(overlap)}")
    else:
        test = load_suite(config.prompts, languages=langs, limit_per_language=config.prompts_per_language)
        tune = load_suite(
            config.prompts, languages=langs, limit_per_language=config.tune_prompts_per_language
        )
        warnings.append(
            f"{config.prompts} has no split keys: all of it is the test set and the static grid was "
            "TUNED ON THE SAME PROMPTS it is measured on, which favours the static baselines; add "
            '"split": "tune" / "test" keys for an honest comparison.'
        )
    return interleave_languages(tune), interleave_languages(test), warnings
