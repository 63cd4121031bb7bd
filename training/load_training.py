"""Training only (and the reports on it): the load-aware main job's pieces on the server replay
(``envs.server``): the per-load static table, the training backend whose episodes decode among other requests,
the validation score across load levels, every baseline measured per load level and on a Poisson run whose
rate changes, and the per-load draft lengths a trained policy chooses (what the vLLM and SGLang export files
carry). ``load_report`` is the per-load report train.py stores (``metrics.json["load"]``),
``benchmarks/server_replay.py`` prints for any policy file and ``evaluate.py`` reports ("Under load (server
replay)"), each on its own traces.

Why these baselines: autoregressive decoding; the static chain tuned alone (N=1: what a user tunes on one
client and then serves with); the static chain tuned per load level (the table serving engines ship); the
analytic controller given the load (``policies.analytic``: the cost model at the request's load, the best
causal rule we know); the goodput controller given the load (``policies.goodput``: SmartSpec's rule, each
request's draft length from its own acceptance and the step's cost at the load).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from engine.batch_api import BatchConfig
from engine.control import Controller, StaticController
from engine.costs.cost_profile import CostProfile
from engine.lookup import LookupConfig
from envs.replay import ReplayTrace
from envs.server import (
    ServerReplay,
    ServerReplayBackend,
    closed_loop,
    load_score,
    tune_lookup_limit,
    tune_table,
)
from envs.server_runs import Arrivals
from policies.analytic import AnalyticController
from policies.goodput import GoodputController
from policies.learned_controller import LearnedController
from policies.static import BatchSizeTableController

MIXED_RATES = ((0.0, 0.15), (40.0, 0.8), (80.0, 0.25))
"""The Poisson run's rate schedule (requests/s from each second on): a quiet start, a burst that fills the
batch, a moderate end."""


@dataclass
class LoadSetup:
    """The server replays of the train and validation traces and the per-load table tuned on the train ones."""

    train: ServerReplay
    val: ServerReplay
    concurrencies: tuple[int, ...]
    table: dict[int, tuple[int, float]]
    """n -> (depth, system tokens/s on the train traces)."""
    reference: dict[int, float]
    """n -> autoregressive system tokens/s on the validation traces (the score's denominators)."""
    plain: ServerReplay | None = None
    """The validation replay without context lookup (plain autoregressive decoding's row), when the engine
    trains with lookup."""
    looked: ServerReplay | None = None
    """The validation replay with context lookup (lookup-only decoding's row), when the engine runs without
    lookup and a report asks for that row (``load_setup``'s ``lookup_row``), or when the engine's lookup has
    a load limit: then lookup at every load, as practitioners run prompt lookup (the row's setting)."""

    def table_controller(self) -> BatchSizeTableController:
        return BatchSizeTableController({n: d for n, (d, _) in self.table.items()}, self.train.width)

    def background(self, n: int) -> Callable[[], Controller | None]:
        """The other requests of a training episode at load ``n``: the table's static chain."""
        depth, width = self.table[n][0], self.train.width
        return lambda: StaticController(depth, depth, width)

    def backend(self, profile: CostProfile, profiles, lookup: LookupConfig | None, max_requests: int):
        return ServerReplayBackend(
            self.train.traces,
            profile,
            self.background,
            self.concurrencies,
            profiles=profiles,
            lookup=lookup,
            config=BatchConfig(max_requests=max_requests),
            step_overhead_s=self.train.step_overhead_s,
        )

    def score(self, make_controller: Callable[[], Controller | None]) -> float:
        """The validation score: mean over the load levels of system tokens/s over autoregressive's."""
        return load_score(self.val, make_controller, self.concurrencies, self.reference)


def load_setup(
    train_traces: Sequence[ReplayTrace],
    val_traces: Sequence[ReplayTrace],
    profile: CostProfile,
    lookup: LookupConfig | None,
    concurrencies: Sequence[int],
    max_requests: int = 8,
    step_overhead_s: float = 0.0,
    lookup_row: LookupConfig | None = None,
) -> LoadSetup:
    """The replays of ``train_traces`` (the per-load table is tuned there) and ``val_traces`` (what is
    scored and reported). ``lookup_row``: without ``lookup``, a context lookup setting for a lookup-only row
    next to plain autoregressive decoding (with ``lookup`` that row is there anyway)."""
    config = BatchConfig(max_requests=max_requests)
    train = ServerReplay(train_traces, profile, lookup, config, step_overhead_s=step_overhead_s)
    val = ServerReplay(val_traces, profile, lookup, config, step_overhead_s=step_overhead_s)
    concurrencies = tuple(int(n) for n in concurrencies)
    table = tune_table(train, concurrencies)
    reference = {
        n: val.run(closed_loop(n, len(val.traces)), lambda: None).tokens_per_s for n in concurrencies
    }
    plain = val.with_lookup(None) if lookup is not None else None
    unlimited = lookup_row if lookup is None else (lookup.rules if lookup.max_requests else None)
    looked = val.with_lookup(unlimited) if unlimited is not None else None
    return LoadSetup(train, val, concurrencies, table, reference, plain, looked)


def tuned_lookup(
    train_traces: Sequence[ReplayTrace],
    profile: CostProfile,
    lookup: LookupConfig,
    concurrencies: Sequence[int],
    max_requests: int = 8,
    step_overhead_s: float = 0.0,
) -> tuple[LookupConfig, dict[int, float]]:
    """``lookup`` with its load limit tuned on the train traces' server replay (``envs.server.tune_lookup_limit``):
    (the setting, n -> lookup-only over autoregressive system tokens/s)."""
    config = BatchConfig(max_requests=max_requests)
    sim = ServerReplay(train_traces, profile, lookup.rules, config, step_overhead_s=step_overhead_s)
    limit, ratios = tune_lookup_limit(sim, concurrencies)
    return replace(lookup, max_requests=limit), ratios


def load_baselines(setup: LoadSetup, profile: CostProfile, width: int, max_depth: int) -> dict[str, Callable]:
    """name -> controller factory of every baseline (each request gets its own controller); the goodput
    controller's row only on chain traces (``width`` 1)."""
    alone = setup.table[min(setup.concurrencies)][0]
    table = setup.table_controller()
    out = {
        "autoregressive": lambda: None,
        f"static tuned at N=1 (depth {alone})": lambda: StaticController(alone, alone, width),
        "static per load (table)": lambda: table,
        "analytic given the load": lambda: AnalyticController(profile, width, max_depth),
    }
    if width == 1:  # the goodput controller drafts chains
        out["goodput given the load"] = lambda: GoodputController(profile, max_depth)
    return out


def per_load(setup: LoadSetup, factories: dict[str, Callable], mixed_requests: int = 0) -> dict[str, dict]:
    """name -> {"N=n": system tokens/s, ..., "poisson": tokens/s, "poisson_itl_p99_ms": ..., "score": ...}
    on the validation traces (closed loop at each load level, then the Poisson run of ``MIXED_RATES``)."""
    out = {}
    requests = mixed_requests or 3 * len(setup.val.traces)
    rows = []
    if setup.plain is not None:  # with lookup, "autoregressive" is lookup-only decoding: plain decoding too
        rows.append(("autoregressive, no lookup", lambda: None, setup.plain))
    for name, make in factories.items():
        if name == "autoregressive" and setup.plain is not None:  # at every load (``LoadSetup.looked``)
            rows.append(("lookup only (no draft model)", make, setup.looked or setup.val))
            continue
        rows.append((name, make, setup.val))
        if name == "autoregressive" and setup.looked is not None:
            rows.append(("lookup only (no draft model)", lambda: None, setup.looked))
    for name, make, sim in rows:
        row = {}
        for n in setup.concurrencies:
            run = sim.run(closed_loop(n, len(sim.traces)), make)
            row[f"N={n}"] = run.tokens_per_s
            row[f"N={n} depth"] = run.summary()["mean_depth"]
        mixed = sim.run(Arrivals.poisson(MIXED_RATES, requests, seed=1), make).summary()
        row["poisson"] = mixed["tokens_per_s"]
        row["poisson_itl_p99_ms"] = mixed["itl_p99_ms"]
        row["score"] = float(np.mean([row[f"N={n}"] / setup.reference[n] for n in setup.concurrencies]))
        out[name] = row
    return out


DEFAULT_CONCURRENCIES = (1, 2, 4, 8)
"""The load levels of a report for a policy stored without them, or without a policy (train.py's default)."""


def trained_server(meta: dict | None) -> dict:
    """The server a policy file's metadata (``LearnedController.meta``) says it was trained for: its load
    levels, the requests decoded at once and a step's own cost (train.py's --concurrencies, --max-requests,
    --step-overhead-ms, or the cost it measured: ``metrics["step_overhead_ms"]``); for a setting the file does
    not carry, and without a policy, (1, 2, 4, 8), 8 and 0."""
    config = (meta or {}).get("train_config") or {}
    overhead = config.get("step_overhead_ms")
    if overhead is None:
        overhead = ((meta or {}).get("metrics") or {}).get("step_overhead_ms", 0.0)
    return {
        "concurrencies": tuple(int(n) for n in config.get("concurrencies") or DEFAULT_CONCURRENCIES),
        "max_requests": int(config.get("max_requests", 8)),
        "step_overhead_ms": float(overhead),
    }


def load_awareness(policy: LearnedController) -> str | None:
    """Why a loaded policy may not follow the load, in one line, or None when it was trained for it
    (``train.py --load-aware``, the default, with device features that follow the load)."""
    config = policy.meta.get("train_config") or {}
    if not config.get("load_aware", False):
        return (
            "the policy was trained without load awareness (train.py --no-load-aware, or the live backend): it "
            "observes the load but was trained and validated one request at a time"
        )
    if policy.loads is None:
        return (
            "the policy's device features do not follow the load (no cost profile with a batch axis reached it); "
            "its load features do"
        )
    return None


def load_report(
    setup: LoadSetup,
    profile: CostProfile,
    width: int,
    max_depth: int,
    policy: Controller | None = None,
    name: str = "learned",
    mixed_requests: int = 0,
) -> dict:
    """Every baseline (``load_baselines``) and ``policy`` (row ``name``; one controller instance serves every
    request, as a learned policy without a fallback can) per load level and on the Poisson run, on
    ``setup``'s validation replay: {"concurrencies", "table" (n -> [depth, tokens/s on the train traces]),
    "reference_autoregressive", "rows" (``per_load``)}, with a policy also "learned_depths" and
    "table_ranges" (``chosen_depths``, ``table_ranges``). Keys are strings, as JSON stores them."""
    factories = load_baselines(setup, profile, width, max_depth)
    if policy is not None:
        factories[name] = lambda: policy
    rows = per_load(setup, factories, mixed_requests)
    out = {
        "concurrencies": list(setup.concurrencies),
        "table": {str(n): list(v) for n, v in setup.table.items()},
        "reference_autoregressive": {str(n): v for n, v in setup.reference.items()},
        "rows": rows,
    }
    if policy is not None:
        depths = chosen_depths(rows[name], setup.concurrencies)
        out["learned_depths"] = {str(n): d for n, d in depths.items()}
        out["table_ranges"] = [[a, b, k] for (a, b), k in table_ranges(depths).items()]
    return out


def chosen_depths(row: dict, concurrencies: Sequence[int]) -> dict[int, int]:
    """The draft length a controller chose at each load level, as one integer per level (what a
    per-batch-size table can carry): its mean drafted depth over every cycle it decided there (autoregressive
    steps count 0), rounded, from its ``per_load`` row."""
    return {n: int(round(row[f"N={n} depth"])) for n in concurrencies}


def table_ranges(depths: dict[int, int]) -> dict[tuple[int, int], int]:
    """Per-level draft lengths as inclusive batch-size ranges: each level from its batch size up to the next
    level's minus one, the last one open-ended (to 256)."""
    levels = sorted(depths)
    ranges = {}
    for i, n in enumerate(levels):
        last = levels[i + 1] - 1 if i + 1 < len(levels) else 256
        ranges[(1 if i == 0 else n, last)] = depths[n]
    return ranges


def load_summary(load: dict, traces: str = "validation traces") -> list[str]:
    """The per-load comparison (server replay of ``traces``): system tokens/s at each closed-loop load level
    and on the Poisson run, and the mean ratio over autoregressive decoding."""
    levels = [f"N={n}" for n in load["concurrencies"]]
    rows = load["rows"]
    width = max(len(name) for name in rows)
    head = "  ".join(f"{c:>7}" for c in levels + ["poisson", "p99 ms", "score"])
    lines = [
        "",
        f"server replay ({traces}, system tokens/s; score: mean over N of / autoregressive):",
    ]
    lines.append(f"  {'controller':<{width}}  {head}")
    for name, row in rows.items():
        cells = [row[c] for c in levels] + [row["poisson"], row["poisson_itl_p99_ms"], row["score"]]
        lines.append(f"  {name:<{width}}  " + "  ".join(f"{v:7.2f}" for v in cells))
    if load.get("learned_depths"):
        lines.append(
            "learned draft length per load level: "
            + ", ".join(f"N={n} {d}" for n, d in load["learned_depths"].items())
        )
    for name, where in (load.get("exports") or {}).items():
        lines.append(f"{name} export: {where}")
    return lines
