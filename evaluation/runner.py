"""The evaluation from start to end: prompts, models, profile, static grid search on the tune split,
controllers, interleaved live runs on the measured split, replay (oracle and replay-vs-live), load (threads,
and the server replay per load level: ``evaluation.under_load``), and the exactness audit. Returns one results dict (``evaluation.summary`` and ``evaluation.report`` turn it
into tables, targets and plots).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from envs.oracle import oracle_throughput
from envs.prompts import language_of
from envs.replay import replay_generate, throughput
from evaluation.checkpoint import Checkpoint, stored_config
from evaluation.concurrency import run_load
from evaluation.config import (
    LLAMA_PEERS,
    LOOKUP_SUFFIX,
    OPEN_PROMPTS,
    PEERS,
    EvalConfig,
)
from evaluation.eval_setup import STATIC, Engines, Setup
from evaluation.exactness import greedy_audit, law_checks, sampled_test
from evaluation.measurements import DecisionLoggingController, run_engine
from evaluation.peers import SCHEDULES, run_peer
from evaluation.summary import conditions, summarize
from evaluation.tuning import tune_static
from evaluation.under_load import measured_traces, server_replay_section
from peers.llama_cpp import LlamaCppRunError
from policies.learned_controller import trained_lookup


def live_runs(
    setup: Setup,
    engine,
    controllers: dict[str, object],
    prompts: list[dict],
    *,
    max_new_tokens: int,
    reps: int,
    seed: int,
    progress: bool,
    done: Sequence[dict] = (),
    on_prompt: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Every prompt, every controller in turn (order rotated per prompt and repetition), ``reps`` times.
    ``done``: runs of an earlier sitting; a (repetition, prompt) they cover for every controller is reused,
    not measured again. ``on_prompt(runs so far)`` is called after each newly measured (repetition, prompt)."""
    temperature = setup.config.temperature
    names = list(controllers)
    earlier: dict[tuple[int, str], dict[str, dict]] = defaultdict(dict)
    for run in done:
        earlier[(run["rep"], run["prompt_id"])][run["controller"]] = run
    encoded = [setup.pair.encode(p["prompt"]) for p in prompts]
    runs = []
    with tqdm(total=reps * len(prompts) * len(names), desc="live runs", disable=not progress) as bar:
        for rep in range(reps):
            for index, (item, ids) in enumerate(zip(prompts, encoded)):
                kept = earlier.get((rep, item["id"]), {})
                if all(name in kept for name in names):
                    runs += [kept[name] for name in names]
                    bar.update(len(names))
                    continue
                shift = (index + rep) % len(names)
                for name in names[shift:] + names[:shift]:
                    bar.set_postfix_str(f"{item['id']} {name}")
                    if name in PEERS:
                        run = run_peer(setup.pair, ids, max_new_tokens, name, temperature, seed)
                    elif name in LLAMA_PEERS:
                        run = setup.llama.run(name, item["prompt"], max_new_tokens, seed)
                    else:
                        eng = engine(name) if isinstance(engine, Engines) else engine
                        run = run_engine(eng, ids, controllers[name], max_new_tokens, seed)
                    run.update(
                        controller=name, prompt_id=item["id"], language=language_of(item), rep=rep, seed=seed
                    )
                    runs.append(run)
                    bar.update()
                if on_prompt is not None:
                    on_prompt(runs)
    return runs


def replay_section(setup: Setup, controllers: dict[str, object], traces: list | None = None) -> dict:
    """Hindsight oracle and replay predictions on the measured prompts' traces (width W; ``traces``: those
    traces if the caller has them)."""
    started = time.perf_counter()
    traces = traces if traces is not None else measured_traces(setup)
    out = {"width": setup.width, "max_depth": setup.max_depth, "traces": len(traces), "predicted": {}}
    for name, ctrl in controllers.items():
        if ctrl is not None and getattr(ctrl, "tree_width", None) != setup.width:
            continue
        lookup = setup.lookup if name.endswith(LOOKUP_SUFFIX) else None
        records = [replay_generate(rt, ctrl, setup.profile, lookup=lookup) for rt in traces]
        out["predicted"][name] = {
            "tokens_per_s": throughput(records),
            "per_prompt": {rt.trace.prompt_id: throughput([r]) for rt, r in zip(traces, records)},
        }
    if "oracle" in setup.names:
        out["oracle_tokens_per_s"] = oracle_throughput(traces, setup.profile)
        if setup.lookup is not None:  # the upper bound of the rows run with the engine's context lookup
            out["oracle_lookup_tokens_per_s"] = oracle_throughput(traces, setup.profile, lookup=setup.lookup)
    out["seconds"] = time.perf_counter() - started
    return out


def exactness_section(setup: Setup, runs: list[dict], factories: dict, engine_names: list[str]) -> dict:
    """Greedy (or same-seed) token audit from the live runs; sampled two-sample test and law checks."""
    config = setup.config
    first = [r for r in runs if r["rep"] == 0]
    tokens = {
        name: {r["prompt_id"]: r["tokens"] for r in first if r["controller"] == name} for name in engine_names
    }
    out = {"greedy": config.temperature == 0, "token_audit": greedy_audit(tokens)}
    peers = {
        name: {r["prompt_id"]: r["tokens"] for r in first if r["controller"] == name}
        for name in setup.names
        if name in PEERS
    }
    if peers and config.temperature == 0:  # sampled: transformers draws from its own generator
        out["peer_token_audit"] = greedy_audit({"autoregressive": tokens["autoregressive"], **peers})
    if config.exactness:
        out.update(audit_sampled(setup, factories))
    return out


def exactness_prompts(setup: Setup) -> list[dict]:
    """The sampled test's prompts: the built-in open-ended ones (in the evaluated languages), or the split's."""
    if setup.config.exactness_prompt_set == "split":
        return list(setup.test_prompts)
    languages = {p.get("language") for p in setup.test_prompts}
    return [p for p in OPEN_PROMPTS if p["language"] in languages] or list(OPEN_PROMPTS)


def audit_sampled(setup: Setup, factories: dict) -> dict:
    config = setup.config
    spec = next(
        (
            n
            for n in ("learned", "static_tree", "static_chain", "analytic", "heuristic", "confidence")
            if factories.get(n) is not None
        ),
        None,
    )
    out: dict = {"law_checks": law_checks(config.law_trials, config.seed)}
    if spec is not None:
        temperature = config.temperature or config.audit_temperature
        out["sampled"] = {
            "controller_name": spec,
            **sampled_test(
                setup.pair,
                factories[spec],
                exactness_prompts(setup)[: config.exactness_prompts],
                temperature=temperature,
                samples=config.samples,
                k=config.exactness_tokens,
                budget=config.exactness_budget,
                seed=config.seed,
                progress=config.progress,
            ),
        }
    return out


def evaluate(config: EvalConfig, checkpoint=None, setup: Setup | None = None) -> dict:
    """The whole evaluation; returns the results dict (raw runs included). ``checkpoint``: the partial
    evaluation (``evaluation.checkpoint.Checkpoint``, or its file's path): the grid search's result and every
    measured prompt are saved to it as they complete, and an earlier partial run with the same config is
    resumed from it. ``setup``: the evaluation's ``Setup`` if the caller built it already (to check every
    input before it writes anything)."""
    started = time.perf_counter()
    state = checkpoint
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        state = Checkpoint.open(Path(checkpoint), config)
    if state is not None and state.resumed:
        print(
            f"resuming the partial evaluation in {state.path} (sitting {len(state.sittings)}: "
            f"{len(state.runs)} runs kept{', static grid kept' if state.tuning is not None else ''})",
            flush=True,
        )
    setup = setup or Setup(config)
    engines = Engines(setup.pair, config.temperature, setup.lookup)
    engine = engines.plain
    kinds = [k for k in STATIC if k in setup.names or k + LOOKUP_SUFFIX in setup.names]
    tuning = state.tuning if state is not None and state.tuning is not None else {}
    if kinds and not tuning:
        tuning = tune_static(
            setup.pair,
            engine,
            setup.profile,
            setup.tune_prompts,
            kinds=kinds,
            tree_width=setup.tree_width,
            max_depth=setup.max_depth,
            temperature=config.temperature,
            max_new_tokens=config.tune_tokens(),
            confirm_top=config.confirm_top,
            cache_dir=config.cache_dir,
            seed=config.seed,
            progress=config.progress,
        )
        if state is not None:
            state.tuning = tuning
            state.save()
    factories = setup.factories({k: v["best"] for k, v in tuning.items()})
    engine_names = [n for n in setup.names if n in factories]
    controllers = {n: factories[n]() if factories[n] else None for n in engine_names}
    if "learned" in controllers:
        controllers["learned"] = DecisionLoggingController(controllers["learned"])
    measured = engine_names + [n for n in setup.names if n in PEERS + LLAMA_PEERS]

    warm = setup.pair.encode(setup.tune_prompts[0]["prompt"])  # warm-up (allocator, kernels): not measured
    for name in list(measured):
        if name in PEERS:
            run_peer(setup.pair, warm, 8, name, config.temperature, config.seed)
        elif name in LLAMA_PEERS:
            try:
                setup.llama.run(name, setup.tune_prompts[0]["prompt"], 8, config.seed)
            except LlamaCppRunError as err:  # a peer that cannot run here leaves its row out
                measured.remove(name)
                setup.names.remove(name)
                setup.warnings.append(f"{name} left out: llama.cpp failed its warm-up request: {err}")
        else:
            run_engine(engines(name), warm, controllers[name], 8, config.seed)
    recorder = controllers.get("learned")
    if recorder is not None:
        recorder.depth_log[:] = [tuple(r) for r in state.depth_log] if state is not None else []
        recorder.size_log[:] = [tuple(r) for r in state.size_log] if state is not None else []

    def save_progress(runs: list[dict]) -> None:
        state.runs = runs
        if recorder is not None:
            state.depth_log, state.size_log = recorder.depth_log, recorder.size_log
        state.save()

    runs = live_runs(
        setup,
        engines,
        {n: controllers.get(n) for n in measured},
        setup.test_prompts,
        max_new_tokens=config.max_new_tokens,
        reps=config.reps,
        seed=config.seed,
        progress=config.progress,
        done=state.runs if state is not None else (),
        on_prompt=save_progress if state is not None else None,
    )
    replay, traces = None, None
    if config.replay and (
        {"oracle", "learned", "learned+lookup", "analytic", "static_tree"} & set(setup.names)
    ):
        plain = {
            n: (c.inner if isinstance(c, DecisionLoggingController) else c) for n, c in controllers.items()
        }
        traces = measured_traces(setup)
        replay = replay_section(setup, plain, traces)
    server = server_replay_section(setup, traces) if config.server_replay else None
    load = None
    if config.concurrency > 1:
        best_static = _best_static(tuning)
        modes = {n: factories[n] for n in ("autoregressive", "learned", best_static) if n in factories}
        encoded = [(p["id"], setup.pair.encode(p["prompt"])) for p in setup.test_prompts]
        load = run_load(
            setup.pair,
            engine.sampling,
            modes,
            encoded,
            config.concurrency,
            config.max_new_tokens,
            config.seed,
            reps=config.reps,
            progress=config.progress,
        )
    exactness = exactness_section(setup, runs, factories, engine_names)

    results = {
        "config": stored_config(config),
        "conditions": conditions(setup),
        "warnings": setup.warnings,
        "controllers": {
            n: repr(controllers[n])
            if n in controllers
            else setup.llama.describe(n)
            if n in LLAMA_PEERS
            else f"transformers assisted generation {SCHEDULES[n]}"
            for n in measured
        },
        "tuning": tuning,
        "best_static": _best_static(tuning),
        "headline": headline_name(setup.policy_meta, measured),
        "runs": runs,
        "replay": replay,
        "server_replay": server,
        "sittings": state.sittings if state is not None else None,
        "concurrency": load,
        "exactness": exactness,
        "learned_actions": (
            {
                "depth_fields": ["context_len", "depth", "top_step_prob", "max_frontier_prob", "continue"],
                "depth": recorder.depth_log,
                "size_fields": ["context_len", "depth", "nodes", "top_node_prob", "size"],
                "size": recorder.size_log,
            }
            if recorder is not None
            else None
        ),
    }
    results["summary"] = summarize(results, resamples=config.bootstrap, seed=config.seed)
    results["wall_s"] = time.perf_counter() - started
    return results


def headline_name(policy_meta: dict | None, names: Sequence[str]) -> str:
    """The learned row the report's targets are read from: learned+lookup for a policy trained with context
    lookup (``train.py --lookup``) when that row is measured, else learned."""
    trained = trained_lookup(policy_meta)
    with_lookup = "learned" + LOOKUP_SUFFIX
    return with_lookup if trained is not None and with_lookup in names else "learned"


def _best_static(tuning: dict) -> str | None:
    """The static kind whose chosen configuration was faster live on the tune prompts."""
    if not tuning:
        return None

    def live(kind: str) -> float:
        best = tuning[kind]["best"]
        return next(
            r["live_tokens_per_s"]
            for r in tuning[kind]["confirmed"]
            if (r["depth"], r["verify"]) == (best["depth"], best["verify"])
        )

    return max(tuning, key=live)


def exactness_only(config: EvalConfig, setup: Setup | None = None) -> dict:
    """``python evaluate.py exactness``: greedy token audit of every engine controller on the measured
    prompts (fixed static settings instead of a grid search: chain (4, 4), tree (4, 8, W)), then the sampled
    two-sample test and the law checks."""
    started = time.perf_counter()
    setup = setup or Setup(config)
    fixed = {
        "static_chain": {"depth": 4, "verify": 4, "tree_width": 1},
        "static_tree": {"depth": 4, "verify": 8, "tree_width": setup.tree_width},
    }
    factories = setup.factories(fixed)
    engine_names = [n for n in setup.names if n in factories]
    greedy = Engines(setup.pair, 0.0, setup.lookup)
    controllers = {n: factories[n]() if factories[n] else None for n in engine_names}
    runs = live_runs(
        setup,
        greedy,
        controllers,
        setup.test_prompts,
        max_new_tokens=config.max_new_tokens,
        reps=1,
        seed=config.seed,
        progress=config.progress,
    )
    tokens = {n: {r["prompt_id"]: r["tokens"] for r in runs if r["controller"] == n} for n in engine_names}
    exactness = {"greedy": True, "token_audit": greedy_audit(tokens)}
    if config.exactness:
        exactness.update(audit_sampled(setup, factories))
    return {
        "config": stored_config(config),
        "conditions": conditions(setup),
        "warnings": setup.warnings,
        "controllers": {n: repr(c) for n, c in controllers.items()},
        "exactness": exactness,
        "runs": runs,
        "wall_s": time.perf_counter() - started,
    }
