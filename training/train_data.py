"""A training run's inputs and yardsticks (training only): its prompts, cost profile and traces (cached through
``envs.workspace``), the randomised-device mix, the replay validation, the baselines on the validation traces and
the verdict on the exported policy."""

from __future__ import annotations

import numpy as np

from engine.control import StaticController
from engine.costs.cost_profile import CostProfile
from engine.costs.observation import device_features
from engine.errors import DraftpilotError, InputError
from engine.lookup import LookupConfig, parse_lookup
from envs import workspace
from envs.oracle import oracle_throughput, static_grid
from envs.profiles import ProfileMix
from envs.prompts import LONG_SUITE, interleave_languages, load_suite
from envs.replay import replay_generate, throughput
from policies.analytic import AnalyticController
from training import load_training
from training.train_config import TrainConfig


def load_models(config: TrainConfig):
    return config.load()


def ensure_profile(config: TrainConfig, pair):
    profile = workspace.ensure_profile(
        pair, config.cache_dir, config.profile, widths=(1, 2, config.tree_width), progress=config.progress
    )
    if config.load_aware and config.backend == "replay" and not profile.batched:
        raise InputError(
            "--load-aware needs the cost profile's batch axis, which this profile lacks: measure it with "
            "`python -m engine.costs.measure_costs --batch-axis --out FILE` and pass --profile FILE (or delete "
            "the cached profile.json to measure it again), or train with --no-load-aware"
        )
    return profile


def ensure_traces(
    config: TrainConfig,
    pair,
    prompts: list[dict],
    tag: str,
    temperatures: list[float] | None = None,
    max_new_tokens: int | None = None,
):
    """The traces of ``prompts`` at every temperature of the config (or ``temperatures``; ``samples_per_prompt``
    per prompt at temperatures > 0), temperature by temperature, ``max_new_tokens`` (default: the config's)
    each."""
    traces = []
    for temperature in config.temperature_list() if temperatures is None else temperatures:
        traces += workspace.ensure_traces(
            pair,
            prompts,
            config.cache_dir,
            temperature=temperature,
            tree_width=config.tree_width,
            max_depth=config.max_depth,
            max_new_tokens=max_new_tokens or config.max_new_tokens,
            seed=config.seed,
            samples_per_prompt=config.samples_per_prompt,
            progress=config.progress,
            tag=f"{tag} (temperature {temperature:g})" if temperature else tag,
        )
    return traces


def _split_pair(
    path, langs: list[str], train: tuple[str, int], val: tuple[str, int], what: str
) -> tuple[list[dict], list[dict]]:
    """(train, validation) prompts of a suite, each ``(split, per language)`` (0: none), never overlapping."""
    picked = [
        interleave_languages(load_suite(path, split=split, languages=langs, limit_per_language=count))
        if count
        else []
        for split, count in (train, val)
    ]
    overlap = {p["id"] for p in picked[0]} & {p["id"] for p in picked[1]}
    if overlap:
        raise ValueError(f"{what} overlap: {sorted(overlap)}")
    return picked[0], picked[1]


def _languages(config: TrainConfig) -> list[str]:
    return [x.strip() for x in config.languages.split(",") if x.strip()]


def select_prompts(config: TrainConfig):
    return _split_pair(
        config.prompts,
        _languages(config),
        (config.train_split, config.train_prompts),
        (config.val_split, config.val_prompts),
        "train and validation prompts",
    )


def select_long_prompts(config: TrainConfig) -> tuple[list[dict], list[dict]]:
    """The long requests added to training and validation (empty lists when neither flag asks for any)."""
    if not (config.long_train_prompts or config.long_val_prompts):
        return [], []
    return _split_pair(
        config.long_prompts or LONG_SUITE,
        _languages(config),
        (config.train_split, config.long_train_prompts),
        (config.val_split, config.long_val_prompts),
        "long train and validation prompts",
    )


def ensure_long_traces(config: TrainConfig, pair, prompts: list[dict], tag: str):
    """Greedy traces of the long requests at --long-max-new-tokens."""
    if not prompts:
        return []
    return ensure_traces(
        config, pair, prompts, tag, temperatures=[0.0], max_new_tokens=config.long_max_new_tokens
    )


# ----------------------------------------------------------------------------------------- training
def replay_eval(traces, profile: CostProfile, lookup: LookupConfig | None = None):
    return lambda controller: throughput(
        [replay_generate(rt, controller, profile, lookup=lookup) for rt in traces]
    )


def profile_mix(config: TrainConfig, profile: CostProfile) -> ProfileMix | None:
    """The randomised-device mix (``envs.profiles``) of --train-profiles / --profile-perturbation, or None."""
    paths = [p.strip() for p in config.train_profiles.split(",") if p.strip()]
    if not paths and not config.profile_perturbation:
        return None
    members = []
    for path in paths:
        try:
            members.append(CostProfile.load(path))
        except (DraftpilotError, OSError) as err:
            raise InputError(f"--train-profiles: {err}") from None
    return ProfileMix(members or [profile], reference=profile, perturbation=config.profile_perturbation)


def validation(val_traces, profile: CostProfile, mix: ProfileMix | None, lookup: LookupConfig | None = None):
    """Validation throughput of a controller: on ``profile``, or the mean over the mix's measured profiles
    (each unperturbed, the controller conditioned on each one's device features)."""
    if mix is None:
        return replay_eval(val_traces, profile, lookup)

    def mean_over_mix(controller) -> float:
        own = controller.device_feats
        values = []
        try:
            for member in mix.members():
                controller.device_feats = device_features(member, controller.tree_width)
                values.append(replay_eval(val_traces, member, lookup)(controller))
        finally:
            controller.device_feats = own
        return float(np.mean(values))

    return mean_over_mix


def baselines(train_traces, val_traces, profile: CostProfile, config: TrainConfig) -> dict:
    """Static grid (train: the baseline depth; validation: the best static a user could tune there),
    analytic, autoregressive and the oracle on the validation traces (all with the config's context
    lookup: the oracle plans around its cycles, so it bounds every controller replayed with it that does not
    decide lookup itself; a policy trained with ``lookup_gate`` may decline proposals and pass it)."""
    width, depth = config.tree_width, config.max_depth
    lookup = parse_lookup(config.lookup)
    grid_train = static_grid(train_traces, profile, lookup=lookup)
    best_train = max(grid_train, key=grid_train.get)
    grid_val = static_grid(val_traces, profile, lookup=lookup)
    best_val = max(grid_val, key=grid_val.get)
    val = replay_eval(val_traces, profile, lookup)
    return {
        "best_static_train": list(best_train),
        "static_train_on_val": val(StaticController(best_train[0], best_train[1], tree_width=width)),
        "best_static_val": list(best_val),
        "static_best_on_val": grid_val[best_val],
        "analytic_on_val": val(AnalyticController(profile, width, depth)),
        "autoregressive_on_val": val(None),
        "oracle_on_val": oracle_throughput(val_traces, profile, lookup=lookup),
    }


def starting_rho(base: dict, config: TrainConfig) -> float:
    """The average reward's starting rho (and its floor): the best validation throughput of the static
    baseline, the analytic controller and (when the policy may choose depth 0) autoregressive decoding. rho
    should be the best throughput known to be reachable: a lower one makes time look cheap and teaches
    drafting where it does not pay (docs/training.md, "Training")."""
    rho = max(base["static_train_on_val"], base.get("analytic_on_val", 0.0))
    if config.depth_zero:
        rho = max(rho, base["autoregressive_on_val"])
    return rho


BASELINES = (
    ("autoregressive", "autoregressive_on_val"),
    ("best static", "static_best_on_val"),
    ("analytic", "analytic_on_val"),
)
"""The controllers the exported policy is compared with on validation (label, metrics key); the oracle, a
bound no controller reaches, is reported beside them."""


def verdict(metrics: dict) -> dict:
    """Which controller won on validation and how the learned policy stands against each baseline:
    ``{"winner", "learned_over": {label: ratio}, "verdict": one line}``."""
    learned = metrics["learned_on_val"]
    ratios = {label: learned / metrics[key] for label, key in BASELINES}
    best_label, best_key = max(BASELINES, key=lambda b: metrics[b[1]])
    if learned >= metrics[best_key]:
        winner = "learned"
        line = (
            f"the learned policy is the fastest: {ratios['analytic']:.3f}x the analytic controller, "
            f"{ratios['best static']:.3f}x the best static setting"
        )
    else:
        winner = best_label
        line = (
            f"the {best_label} controller beats the learned policy ({ratios[best_label]:.3f}x): on this device "
            "and data the exported policy is not worth deploying over it (train longer, on more prompts, or "
            f"deploy the {best_label} controller)"
        )
    return {"winner": winner, "learned_over": ratios, "verdict": line}


def summary_text(metrics: dict) -> str:
    """The validation summary: every baseline with the learned policy's ratio over it, and the verdict."""
    learned = metrics["learned_on_val"]
    static = f" (D, V) = {tuple(metrics['best_static_val'])}"
    rows = [("learned (exported)", learned, "")]
    rows += [
        (label + (static if label == "best static" else ""), metrics[key], f"{learned / metrics[key]:.3f}x")
        for label, key in BASELINES
    ]
    rows.append(
        ("oracle (hindsight bound)", metrics["oracle_on_val"], f"{metrics['learned_over_oracle']:.3f}x")
    )
    width = max(len(r[0]) for r in rows)
    lines = [
        f"validation throughput (replay, {len(metrics['val_prompts'])} held-out prompts, tokens/s; "
        "learned / each):"
    ]
    lines += [f"  {label:<{width}}  {value:8.3f}  {ratio}".rstrip() for label, value, ratio in rows]
    lines.append(f"verdict: {metrics['verdict']}")
    if metrics.get("load"):
        lines += load_training.load_summary(metrics["load"])
    return "\n".join(lines)
