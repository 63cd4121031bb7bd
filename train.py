"""Train the depth and size policies with PPO (co-adaptive, as LTD) and export them to one policy file.

    python train.py                                  # main job: default pair, the mixed workload, load-aware (~26 min cold, 14 with the data cached, on a 2-core Zen 3)
    python train.py --pair tiny --quick              # plumbing check in seconds
    python train.py --rounds 4 --depth-steps 400000  # a bigger budget (default: 3 rounds, 50k size + 200k depth steps)
    python train.py --backend live --pair tiny       # train on the real engine with wall-clock reward
    python train.py --resume runs/<run>              # continue an interrupted run (phase granularity)
    python train.py --run-name main --retrain        # train again in a run directory that holds a policy

Pipeline: cost profile (measured once per pair/device/dtype, cached) -> traces of the train and validation
prompts (recorded once, cached, resumable) -> replay environments -> PPO: size policy (depth from the best
static setting), then depth (size from the size policy), alternating -> the joint controller with the best
validation throughput is exported to ``<run>/policy.pt`` (load it with ``policies.learned.load_policy``, or
``python generate.py --policy <run>/policy.pt``). TensorBoard: ``tensorboard --logdir runs``.

Run directories: a run holds an exclusive lock on its directory while it works (a second run with the same
name fails at once). A run directory whose ``policy.pt`` was trained with this config (the config stored
inside the policy file, not ``config.json``) is reused; one trained with another config is refused unless
``--retrain``, which first removes the earlier run's outputs (policy, metrics, checkpoint, TensorBoard logs).
An interrupted run (a checkpoint, no policy) is continued with ``--resume RUN``, which takes every setting
from the run's ``config.json``: a flag given with it must agree with that config (``--progress`` excepted),
else it is refused naming the flag; start a new run to change settings. Checkpoints are trusted-only (see
``training.ppo``): resume only runs you wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from engine.backends.files import DirectoryLock, atomic_write_json
from engine.cli import CLI_ERRORS, ArgumentParser, report_error
from engine.config_flags import (
    add_dataclass_args,
    apply_preset,
    from_args,
    given_flags,
    load_config,
    save_config,
)
from engine.control import StaticController
from engine.costs.observation import DeviceAtLoad, device_features
from engine.engine import SpeculativeEngine
from engine.lookup import describe_lookup, parse_lookup
from engine.sampling import SamplingConfig
from envs import workspace
from envs.backends import LiveBackend, ReplayBackend
from envs.environments import EnvConfig
from policies.analytic import AnalyticController
from policies.learned import save_policy
from training import load_training
from training.export import EXPORTS, write_exports
from training.ppo import CoTrainer
from training.ppo_checkpoint import verify_checkpoint
from training.ppo_config import PPOConfig
from training.train_config import (
    QUICK,
    QUICK_PPO,
    RunDirectoryError,
    TrainConfig,
    config_differences,
    config_flag,
    effective_config,
    reuse_run,
    run_directory,
)
from training.train_data import (
    baselines,
    ensure_long_traces,
    ensure_profile,
    ensure_traces,
    load_models,
    profile_mix,
    replay_eval,
    select_long_prompts,
    select_prompts,
    starting_rho,
    summary_text,
    validation,
    verdict,
)


def train(config: TrainConfig, resume: Path | None = None, retrain: bool = False) -> dict:
    """Train (or reuse, or resume) one run; returns its metrics and ``policy`` (the policy file's path). The
    run directory is locked for the whole call (``DirectoryBusyError`` if another process holds it)."""
    config = effective_config(config)
    run = Path(resume) if resume is not None else run_directory(config)
    config.check()
    select_prompts(config)  # a bad prompt file fails before the run directory is touched
    with DirectoryLock(
        run, "run directory (--resume)" if resume is not None else "run directory (--run-dir/--run-name)"
    ):
        if resume is None:
            reused = reuse_run(run, config, retrain)
            if reused is not None:
                return reused
            checkpoint = None
        else:  # checked now, before minutes of loading, and again when it is loaded
            checkpoint = run / "checkpoint" if verify_checkpoint(run / "checkpoint") is not None else None
        return _train(config, run, checkpoint, fresh=resume is None)


def clear_outputs(run: Path) -> None:
    """Remove every output of an earlier run, so that a kill can never leave an old policy looking like this
    run's."""
    for name in ("policy.pt", "metrics.json", *EXPORTS):
        (run / name).unlink(missing_ok=True)
    for name in ("checkpoint", "tb"):
        if (run / name).is_dir():
            shutil.rmtree(run / name)


def _train(config: TrainConfig, run: Path, checkpoint: Path | None, fresh: bool = True) -> dict:
    """Load the inputs (prompts, models, cost profile: every refusal happens here, before the run directory
    changes), then (a fresh run) clear an earlier run's outputs, write ``config.json`` and train."""
    from torch.utils.tensorboard import SummaryWriter

    started = time.perf_counter()
    train_prompts, val_prompts = select_prompts(config)  # a bad prompt file fails before any model loads
    long_train, long_val = select_long_prompts(config)
    pair = load_models(config)
    profile = ensure_profile(config, pair)
    mix = profile_mix(config, profile)
    if fresh:
        clear_outputs(run)
    save_config(config, run / "config.json")
    train_traces = ensure_traces(config, pair, train_prompts, "train")
    val_traces = ensure_traces(config, pair, val_prompts, "validation")
    train_traces += ensure_long_traces(config, pair, long_train, "train (long)")
    val_traces += ensure_long_traces(config, pair, long_val, "validation (long)")
    data_s = time.perf_counter() - started

    lookup = parse_lookup(config.lookup)
    base = baselines(train_traces, val_traces, profile, config)
    depth_d, depth_v = base["best_static_train"]
    print(
        f"baselines on validation (replay, tokens/s): best static {tuple(base['best_static_val'])} "
        f"{base['static_best_on_val']:.3f}, static tuned on train {(depth_d, depth_v)} {base['static_train_on_val']:.3f}, "
        f"analytic {base['analytic_on_val']:.3f}, autoregressive {base['autoregressive_on_val']:.3f}, "
        f"oracle {base['oracle_on_val']:.3f}",
        flush=True,
    )

    def baseline():
        return StaticController(depth_d, depth_v, tree_width=config.tree_width)

    feats = device_features(profile, config.tree_width)
    setup, loads, evaluate = None, None, validation(val_traces, profile, mix, lookup)
    if config.load_aware:
        if config.step_overhead_ms is not None:
            step_overhead_s = config.step_overhead_ms / 1e3
        else:
            step_overhead_s = workspace.ensure_step_overhead(pair, profile, config.cache_dir, config.progress)
        print(
            f"a server step's own cost (replayed with every step): {step_overhead_s * 1e3:.1f} ms", flush=True
        )
        if lookup is not None and not lookup.max_requests:  # no limit given: tuned on the train traces
            lookup, ratios = load_training.tuned_lookup(
                train_traces, profile, lookup, config.concurrencies, config.max_requests, step_overhead_s
            )
            print(
                "context lookup under load (server replay, train traces; lookup-only over autoregressive): "
                + ", ".join(f"N={n} {r:.3f}" for n, r in ratios.items())
                + f" -> {describe_lookup(lookup)}"
                + (
                    f" (lookup only while at most {lookup.max_requests} requests decode)"
                    if lookup.max_requests
                    else ""
                ),
                flush=True,
            )
        setup = load_training.load_setup(
            train_traces, val_traces, profile, lookup, config.concurrencies, config.max_requests,
            step_overhead_s=step_overhead_s,
        )  # fmt: skip
        print(
            "static chain tuned per load level (server replay, train traces; depth: system tokens/s): "
            + ", ".join(f"N={n} {d}: {tps:.1f}" for n, (d, tps) in setup.table.items()),
            flush=True,
        )
        loads = DeviceAtLoad(profile, config.tree_width, alone=feats)
        evaluate = lambda controller: setup.score(lambda: controller)  # noqa: E731 - one shared controller
    if config.backend == "live":
        engine = SpeculativeEngine(pair, SamplingConfig(temperature=config.temperature))
        prompts = [pair.encode(p["prompt"]) for p in train_prompts]
        backend = LiveBackend(engine, prompts, config.tree_width, config.max_new_tokens, profile)
    elif setup is not None:
        backend = setup.backend(profile, mix, lookup, config.max_requests)
    else:
        backend = ReplayBackend(
            train_traces,
            profile,
            profiles=mix,
            lookup=lookup,
        )
    pair_name = pair.name
    if config.backend != "live":  # replay training needs no model: free the pair's ~2 GB before PPO
        del pair
        gc.collect()
    torch.set_num_threads(1)  # the policy networks are tiny; threads only add overhead
    policy_device = "cuda" if config.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    writer = SummaryWriter(str(run / "tb" / "validation"))
    writer.add_text("config", "```\n" + json.dumps(asdict(config), indent=1) + "\n```")
    env_config = EnvConfig(
        reward=config.reward,
        rho=starting_rho(base, config),
        depth_zero=config.depth_zero,
        lookup_gate=config.lookup_gate and lookup is not None,
    )
    trainer = CoTrainer(
        backend,
        config.ppo,
        env_config,
        baseline,
        evaluate,
        max_depth=config.max_depth,
        device_feats=feats,
        loads=loads,
        seed=config.seed,
        device=policy_device,
        tensorboard_dir=str(run / "tb"),
        eval_every=config.eval_every,
        writer=writer,
        progress=config.progress,
        score_name="load_score" if setup is not None else "tokens_per_s",
    )
    if checkpoint is not None:
        trainer.load(checkpoint)
        print(f"resumed {run} after {len(trainer.history)} phases", flush=True)
    if setup is not None:  # what the validation figure is, said where it is printed
        levels = ",".join(str(n) for n in setup.concurrencies)
        unit = f"x autoregressive (mean over N={levels}, server replay)"
    else:
        unit = "tokens/s (replay)"
    phases = [("imitation", 0)] if config.ppo.imitation_steps else []
    phases += [(name, r) for r in range(config.rounds) for name in ("size", "depth")]
    try:
        for name, r in phases[len(trainer.history) :]:
            if name == "imitation":
                log = trainer.imitate(lambda p: AnalyticController(p, config.tree_width, config.max_depth))
                fits = ", ".join(f"{n} {v['agreement']:.1%}" for n, v in trainer.imitation.items())
                print(
                    f"imitation of the analytic controller: {log.steps} decisions in {log.seconds:.0f} s "
                    f"(agreement {fits}), validation {log.validation[-1][1]:.3f} {unit}",
                    flush=True,
                )
            elif name == "size" and config.skip_idle_size and trainer.size_phases_idle():
                trainer.skip_phase(name, r)
                print(
                    f"round {r + 1}/{config.rounds} size: skipped (the last size phase left the best validation "
                    "score where it was; --no-skip-idle-size trains it)",
                    flush=True,
                )
            else:
                log = trainer.run_phase(name, config.size_steps if name == "size" else config.depth_steps, r)
                last = log.validation[-1][1] if log.validation else float("nan")
                print(
                    f"round {r + 1}/{config.rounds} {name}: {log.steps} steps in {log.seconds:.0f} s, "
                    f"validation {last:.3f} {unit} (best so far {trainer.best[0]:.3f})",
                    flush=True,
                )
            trainer.save(run / "checkpoint")
    finally:
        trainer.close()  # the environment workers
    writer.close()

    best_tps, depth_actor, size_actor = trainer.best
    if depth_actor is None:  # validation never ran on a complete controller
        depth_actor, size_actor = trainer.actor("depth"), trainer.actor("size")
        best_tps = evaluate(trainer.joint())
    validated = {}
    if setup is not None:  # the score across load levels chose the policy; report batch one's figure too
        validated["learned_load_score"] = best_tps
        if mix is not None:  # batch one over the mix, as a run without the load reports it
            validated["learned_on_val_mix"] = validation(val_traces, profile, mix, lookup)(
                trainer.controller(depth_actor, size_actor)
            )
        best_tps = replay_eval(val_traces, profile, lookup)(trainer.controller(depth_actor, size_actor))
    elif mix is not None:  # validation averaged over the mix: report the deployment profile's figure too
        validated["learned_on_val_mix"] = best_tps
        best_tps = replay_eval(val_traces, profile, lookup)(trainer.controller(depth_actor, size_actor))
    metrics = {
        **base,
        **validated,
        "learned_on_val": best_tps,
        "learned_over_static": best_tps / base["static_best_on_val"],
        "learned_over_analytic": best_tps / base["analytic_on_val"],
        "learned_over_oracle": best_tps / base["oracle_on_val"],
        "learned_over_autoregressive": best_tps / base["autoregressive_on_val"],
        "imitation": trainer.imitation,
        "data_s": data_s,
        "train_s": sum(h.seconds for h in trainer.history),
        "total_s": time.perf_counter() - started,
        "val_prompts": [p["id"] for p in val_prompts],
        "train_prompts": [p["id"] for p in train_prompts],
        "phases": [asdict(h) for h in trainer.history],
    }
    if lookup is not None:
        metrics["lookup"] = describe_lookup(
            lookup
        )  # with the load limit tuned above (trained_lookup reads it)
    if setup is not None:
        metrics["step_overhead_ms"] = setup.train.step_overhead_s * 1e3
        learned = trainer.controller(depth_actor, size_actor)
        metrics["load"] = load_training.load_report(
            setup, profile, config.tree_width, config.max_depth, learned, "learned (exported)"
        )
    judged = verdict(metrics)
    metrics.update(winner=judged["winner"], verdict=judged["verdict"])
    if judged["winner"] != "learned":
        print(f"warning: {judged['verdict']}", flush=True)
    path = save_policy(
        run / "policy.pt",
        depth_actor,
        size_actor,
        size_ladder=trainer.env_config.size_ladder,
        tree_width=config.tree_width,
        max_depth=config.max_depth,
        device_feats=feats,
        pair=pair_name,
        profile=profile.to_dict(),
        train_config=asdict(config),
        metrics=metrics,
        depth_zero=config.depth_zero,
        lookup_gate=env_config.lookup_gate,
    )
    if setup is not None:
        ranges = {(a, b): k for a, b, k in metrics["load"]["table_ranges"]}
        tuned = load_training.table_ranges({n: d for n, (d, _) in setup.table.items()})
        metrics["load"]["exports"] = write_exports(ranges, run, tuned=tuned)
    atomic_write_json(run / "metrics.json", metrics)
    metrics["policy"] = str(path)
    return metrics


# ----------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python train.py", description=__doc__)
    add_dataclass_args(ap, TrainConfig)
    add_dataclass_args(ap, PPOConfig, group="PPO")
    ap.add_argument("--quick", action="store_true", help="tiny budget (plumbing check; explicit flags win)")
    ap.add_argument(
        "--resume",
        help="run directory to continue (its config.json is used: flags given with it must "
        "agree with it, --progress excepted)",
    )
    ap.add_argument(
        "--retrain",
        action="store_true",
        help="train again even if --run-name already holds a policy trained with this config",
    )
    return ap


def config_from_argv(argv: list[str] | None) -> tuple[TrainConfig, Path | None, bool]:
    """(config, run directory to resume or None, retrain). With ``--resume RUN`` the config is the run's
    ``config.json``; flags given with it must agree with it (``--progress`` is honoured), else
    ``RunDirectoryError`` names the ones that differ."""
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    preset = {**QUICK, **QUICK_PPO} if args.quick else {}
    if args.quick:
        apply_preset(ap, args, argv, preset)
    if args.resume:
        if args.retrain:
            raise RunDirectoryError(
                "--resume continues a run and --retrain starts one over: give one of them"
            )
        run = Path(args.resume)
        if not (run / "config.json").is_file():
            raise RunDirectoryError(f"--resume {run}: not a train.py run directory (no config.json)")
        stored = load_config(TrainConfig, run / "config.json")
        given = (given_flags(ap, argv) | set(preset)) - {"resume", "retrain", "quick", "progress"}
        if given:
            requested = from_args(TrainConfig, args, ppo=from_args(PPOConfig, args))
            ppo_names = {f.name for f in dataclasses.fields(PPOConfig)}
            keys = {f"ppo.{k}" if k in ppo_names else k for k in given}
            changed = config_differences(
                asdict(effective_config(stored)), asdict(effective_config(requested)), keys
            )
            changed += [
                f"{config_flag(k)} (the run is the --resume directory)"
                for k in sorted(given)
                if k in ("run_dir", "run_name")
            ]
            if changed:
                raise RunDirectoryError(
                    f"--resume {run} continues the run with the settings of its config.json; "
                    f"these flags differ from it: {'; '.join(changed)}. Drop them, or start a new "
                    "run (another --run-name) to change them"
                )
        if "progress" in given_flags(ap, argv):
            stored = replace(stored, progress=args.progress)
        return stored, run, False
    ppo = from_args(PPOConfig, args)
    return from_args(TrainConfig, args, ppo=ppo), None, args.retrain


def main(argv: list[str] | None = None) -> int:
    try:
        config, resume, retrain = config_from_argv(argv)
        metrics = train(config, resume, retrain)
    except (*CLI_ERRORS, ValueError) as err:  # a config dataclass refuses a value with ValueError
        return report_error(err)
    print(f"\nexported policy: {metrics['policy']}")
    print(summary_text(metrics))
    print(
        f"time: data {metrics['data_s']:.0f} s, training {metrics['train_s']:.0f} s, total {metrics['total_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
