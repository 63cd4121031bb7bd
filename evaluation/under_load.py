"""The report's "Under load (server replay)" section: the evaluated policy and every load baseline (plain
autoregressive decoding, lookup-only decoding, the static chain tuned at N=1, the per-load static table, the
analytic controller given the load) in the server replay (``envs.server``) of the measured prompts' traces:
system tokens/s at each closed-loop load level and on the Poisson run whose rate rises and falls, with that
run's p99 inter-token latency. The rows are ``training.load_training.load_report``'s, the report train.py
stores for its validation traces and ``benchmarks/server_replay.py`` prints; the per-load table is tuned on the
tune prompts' traces.

The replay runs the engine the policy was trained for (its context lookup, its server's requests at once
and step cost: ``train.py --lookup``, ``--max-requests``, ``--step-overhead-ms``); without lookup, the
lookup-only row uses the evaluation's setting (``--lookup``). Without a policy the baselines run alone, on
the evaluation's lookup setting.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.lookup import describe_lookup
from envs import workspace
from envs.replay import ReplayTrace
from policies.learned_controller import trained_lookup
from training import load_training


def measured_traces(setup) -> list[ReplayTrace]:
    """The measured prompts' traces (``setup``: the evaluation's ``Setup``; width W, depth D, the evaluation's
    tokens and temperature), recorded the first time, then read from the cache: what the replay and the
    server replay sections replay."""
    config = setup.config
    return workspace.ensure_traces(
        setup.pair,
        setup.test_prompts,
        config.cache_dir,
        temperature=config.temperature,
        tree_width=setup.width,
        max_depth=setup.max_depth,
        max_new_tokens=config.max_new_tokens,
        seed=config.seed,
        progress=config.progress,
        tag="test traces",
    )


def server_replay_section(setup, measured: Sequence[ReplayTrace] | None = None) -> dict:
    """The section's results (module docstring) on ``measured`` (the measured prompts' traces; None: recorded
    or read from the cache here), or {"skipped": why} where the server replay cannot run."""
    config = setup.config
    started = time.perf_counter()
    profile = setup.profile
    if not profile.batched:
        return {
            "skipped": "the cost profile has no batch axis, which the server replay times its steps with: "
            "measure one with `python -m engine.costs.measure_costs --batch-axis --out FILE` and pass "
            "--profile FILE (or delete the cached profile.json to measure it again)"
        }
    notes = []
    policy = setup.learned() if setup.policy_path else None
    if policy is not None and policy.tree_width != setup.width:
        notes.append(
            f"no learned row: the policy drafts width-{policy.tree_width} trees and the traces have width "
            f"{setup.width} (--tree-width)"
        )
        policy = None
    elif policy is not None and (note := load_training.load_awareness(policy)):
        notes.append(note)
    server = load_training.trained_server(setup.policy_meta)
    concurrencies = config.server_concurrencies or server["concurrencies"]
    lookup = trained_lookup(setup.policy_meta) if setup.policy_meta else setup.lookup
    recorded = measured is None
    measured = list(measured) if measured is not None else measured_traces(setup)
    tune = workspace.ensure_traces(
        setup.pair,
        setup.tune_prompts,
        config.cache_dir,
        temperature=config.temperature,
        tree_width=setup.width,
        max_depth=setup.max_depth,
        max_new_tokens=config.tune_tokens(),
        seed=config.seed,
        progress=config.progress,
        tag="tune traces (server replay)",
    )
    load = load_training.load_setup(
        tune,
        measured,
        profile,
        lookup,
        concurrencies,
        server["max_requests"],
        step_overhead_s=server["step_overhead_ms"] / 1e3,
        lookup_row=setup.lookup if lookup is None else None,
    )
    requests = 3 * len(measured)
    report = load_training.load_report(
        load, profile, setup.width, setup.max_depth, policy, "learned", requests
    )
    return {
        **report,
        "traces": {
            "split": config.split,
            "measured": len(measured),
            "positions": sum(rt.trace.num_positions for rt in measured),
            "recorded_here": recorded,
            "tune_split": config.tune_split,
            "tune": len(tune),
            "width": setup.width,
            "max_depth": setup.max_depth,
            "max_new_tokens": config.max_new_tokens,
            "tune_max_new_tokens": config.tune_tokens(),
        },
        "max_requests": server["max_requests"],
        "step_overhead_ms": server["step_overhead_ms"],
        "lookup": describe_lookup(lookup),
        "lookup_row": describe_lookup(lookup or setup.lookup),
        "poisson": {"rates": [list(r) for r in load_training.MIXED_RATES], "requests": requests},
        "notes": notes,
        "seconds": time.perf_counter() - started,
    }
