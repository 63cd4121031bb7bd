"""From raw runs to the reported numbers: per controller and language figures, speedups and learned-policy
ratios with paired bootstrap intervals, replay vs live, and the targets with an honest pass/fail each."""

from __future__ import annotations

import datetime
import platform
from collections import Counter

import numpy as np

from engine.costs.measure_costs import device_name
from evaluation.measurements import aggregate, group_by_language, per_prompt
from evaluation.stats import paired_ratio_from_rows

LEARNED_VS = (
    "best_static",
    "static_chain",
    "static_tree",
    "analytic",
    "goodput",
    "heuristic",
    "confidence",
    "hf_assisted_default",
    "hf_assisted_heuristic",
    "llama_cpp",
    "llama_cpp_spec",
    "llama_cpp_lookup",
    "autoregressive",
)
"""Controllers the learned policy is compared with (paired bootstrap over prompts)."""
TARGETS = (
    ("{head} >= 1.05x best grid-searched static", "best_static", 1.05),
    ("{head} >= 1.2x transformers assisted generation (default schedule)", "hf_assisted_default", 1.2),
    ("{head} >= analytic", "analytic", 1.0),
    ("{head} >= 1.25x llama.cpp autoregressive (same GGUF files)", "llama_cpp", 1.25),
    (
        "{head} >= 1.5x llama.cpp's best speculative (draft model or n-gram lookup, same GGUF files)",
        "llama_cpp_best_spec",
        1.5,
    ),
)
"""Each target as (text, key of the headline row's ratios, threshold); ``{head}``: the headline row."""
LLAMA_SPECULATIVE = ("llama_cpp_spec", "llama_cpp_lookup")
LOOKUP_STATICS = ("static_chain+lookup", "autoregressive+lookup")
"""What "best static" means for learned+lookup: the faster of the static chain and of no drafting, both on the
engine with context lookup, measured on the same prompts (a choice in hindsight: it can only favour them)."""
FIDELITY_TOLERANCE = 0.10
"""Replay-predicted vs live decode tokens/s of the learned policy must agree within this fraction."""


def conditions(setup) -> dict:
    """Everything a number needs next to it (docs/design.md section 7)."""
    import torch
    import transformers

    pair, config = setup.pair, setup.config
    meta = setup.policy_meta or {}
    metrics = meta.get("metrics", {})
    profile = setup.loaded_profile
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "pair": pair.name,
        "target": str(getattr(pair.target, "name_or_path", "") or type(pair.target).__name__),
        "draft": str(getattr(pair.draft, "name_or_path", "") or type(pair.draft).__name__),
        "target_params_m": sum(p.numel() for p in pair.target.parameters()) / 1e6,
        "draft_params_m": sum(p.numel() for p in pair.draft.parameters()) / 1e6,
        "dtype": pair.precision,
        "device": str(pair.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": device_name(torch.device("cpu")),
        "gpu": torch.cuda.get_device_name(pair.device) if pair.device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "sampling": "greedy"
        if config.temperature == 0
        else f"temperature {config.temperature:g} (no top-k/top-p)",
        "prompt_file": config.prompts or "built-in suite (prompts/suite.jsonl)",
        "split": config.split,
        "tune_split": config.tune_split,
        "prompts": dict(Counter(p.get("language", "unknown") for p in setup.test_prompts)),
        "tune_prompts": dict(Counter(p.get("language", "unknown") for p in setup.tune_prompts)),
        "max_new_tokens": config.max_new_tokens,
        "tune_max_new_tokens": config.tune_tokens(),
        "reps": config.reps,
        "tree_width": setup.width,
        "static_tree_width": setup.tree_width,
        "max_depth": setup.max_depth,
        "policy": str(setup.policy_path) if setup.policy_path else None,
        "policy_pair": meta.get("pair"),
        "policy_metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))},
        "profile": (profile.meta if profile is not None else None),
    }


def summarize(results: dict, resamples: int = 2000, seed: int = 0) -> dict:
    """Tables (controller -> language -> figures), speedup and learned-ratio intervals, replay vs live,
    targets."""
    rng = np.random.default_rng(seed)
    rows = per_prompt(results["runs"])
    ar = rows["autoregressive"]
    table, speedup_ci = {}, {}
    for name, by_pid in rows.items():
        groups = group_by_language(by_pid)
        table[name] = {lang: aggregate(rs) for lang, rs in groups.items()}
        speedup_ci[name] = {}
        for lang in groups:
            base = table["autoregressive"][lang]["tokens_per_s"]
            table[name][lang]["speedup"] = table[name][lang]["tokens_per_s"] / base
            speedup_ci[name][lang] = paired_ratio_from_rows(
                by_pid, ar, resamples=resamples, rng=rng, language=None if lang == "all" else lang
            )

    def versus(name: str, against: dict[str, str | None]) -> dict:
        """key -> the paired ratio of row ``name`` over row ``against[key]``, for every such row that ran."""
        out = {}
        for key, other in against.items():
            if other in rows:
                r = paired_ratio_from_rows(rows[name], rows[other], resamples=resamples, rng=rng)
                if r is not None:
                    out[key] = {"against": other, **r}
        return out

    named = {o: results.get("best_static") if o == "best_static" else o for o in LEARNED_VS}
    ratios = versus("learned", named) if "learned" in rows else {}
    # the learned policy on the engine with context lookup
    lookup_ratios = (
        versus("learned+lookup", {"learned": "learned", **named}) if "learned+lookup" in rows else {}
    )
    fidelity = replay_vs_live(results.get("replay"), table)
    head = headline_row(results, rows)
    head_ratios = dict(lookup_ratios if head == "learned+lookup" else ratios)
    if head is not None:  # against the fastest row of a kind
        kinds = {"best_static": LOOKUP_STATICS} if head == "learned+lookup" else {}
        kinds["llama_cpp_best_spec"] = LLAMA_SPECULATIVE
        fastest = {
            key: max(present, key=lambda n: table[n]["all"]["tokens_per_s"])
            for key, names in kinds.items()
            if (present := [n for n in names if n in rows])
        }
        head_ratios.update(versus(head, fastest))
    return {
        "table": table,
        "speedup_ci": speedup_ci,
        "learned_ratios": ratios,
        "learned_lookup_ratios": lookup_ratios,
        "headline": head,
        "replay_vs_live": fidelity,
        "targets": targets(head_ratios, fidelity, head),
        "winner": winner(table, head),
        "per_prompt": {
            name: {pid: {k: v for k, v in row.items() if k != "cycles"} for pid, row in by_pid.items()}
            for name, by_pid in rows.items()
        },
    }


def winner(table: dict, head: str | None) -> dict:
    """The fastest row on the test prompts (all tokens / all time), and the headline learned row against it:
    ``{"name", "tokens_per_s", "learned", "learned_over_winner", "line"}``."""
    name = max(table, key=lambda n: table[n]["all"]["tokens_per_s"])
    tps = table[name]["all"]["tokens_per_s"]
    out = {"name": name, "tokens_per_s": tps, "learned": head, "learned_over_winner": None}
    if head is None:
        out["line"] = f"fastest: {name} ({tps:.2f} tokens/s); no learned policy was run"
    elif name == head:
        out["learned_over_winner"] = 1.0
        out["line"] = f"fastest: the learned policy ({head}, {tps:.2f} tokens/s)"
    else:
        ratio = table[head]["all"]["tokens_per_s"] / tps
        out["learned_over_winner"] = ratio
        out["line"] = (
            f"fastest: {name} ({tps:.2f} tokens/s), not the learned policy: {head} runs {ratio:.3f}x it"
        )
    return out


def replay_vs_live(replay: dict | None, table: dict) -> dict:
    """Replay-predicted vs live decode tokens/s (decode: the first token, from prefill, excluded in both)."""
    if not replay:
        return {}
    out = {}
    for name, pred in replay["predicted"].items():
        if name in table:
            live = table[name]["all"]["decode_tokens_per_s"]
            out[name] = {
                "replay_tokens_per_s": pred["tokens_per_s"],
                "live_tokens_per_s": live,
                "replay_over_live": pred["tokens_per_s"] / live,
            }
    base = out.get("autoregressive")
    if base is not None:  # a drift of the machine since the profile was measured moves every row alike
        for row in out.values():
            row["relative_to_autoregressive"] = row["replay_over_live"] / base["replay_over_live"]
    if "oracle_tokens_per_s" in replay:
        out["oracle"] = {"replay_tokens_per_s": replay["oracle_tokens_per_s"]}
    if "oracle_lookup_tokens_per_s" in replay:
        out["oracle+lookup"] = {"replay_tokens_per_s": replay["oracle_lookup_tokens_per_s"]}
    return out


def headline_row(results: dict, rows: dict) -> str | None:
    """The learned row the targets are read from: ``results["headline"]`` (the runner names learned+lookup
    for a policy trained with context lookup) when it ran, else ``learned``; None without a learned row."""
    for name in (results.get("headline"), "learned", "learned+lookup"):
        if name in rows:
            return name
    return None


def targets(ratios: dict, fidelity: dict, head: str | None) -> list[dict]:
    """Each target of the headline row ``head`` with its measured value, interval and pass/fail (None: not
    measured in this run)."""
    out = []
    for template, key, threshold in TARGETS:
        text = template.format(head=head or "learned")
        r = ratios.get(key)
        if head is None or r is None:
            out.append(
                {
                    "target": text,
                    "value": None,
                    "threshold": threshold,
                    "pass": None,
                    "detail": "not measured (controller not run)",
                }
            )
            continue
        out.append(
            {
                "target": text,
                "value": r["ratio"],
                "threshold": threshold,
                "pass": bool(r["ratio"] >= threshold),
                "ci": [r["low"], r["high"]],
                "ci_clears": bool(r["low"] >= threshold),
                "detail": f"{head} / {r['against']} = {r['ratio']:.3f} (95% CI {r['low']:.3f}-{r['high']:.3f}, "
                f"{r['prompts']} prompts)",
            }
        )
    text = f"replay-predicted vs live tokens/s within {FIDELITY_TOLERANCE:.0%} for {head or 'learned'}"
    fid = fidelity.get(head or "learned")
    if fid is None:
        out.append(
            {
                "target": text,
                "value": None,
                "threshold": FIDELITY_TOLERANCE,
                "pass": None,
                "detail": f"not measured (no replay prediction of {head or 'learned'} in this run)",
            }
        )
    else:
        ratio = fid["replay_over_live"]
        out.append(
            {
                "target": text,
                "value": ratio,
                "threshold": FIDELITY_TOLERANCE,
                "pass": bool(abs(ratio - 1) <= FIDELITY_TOLERANCE),
                "detail": f"replay {fid['replay_tokens_per_s']:.3f} vs live {fid['live_tokens_per_s']:.3f} decode "
                f"tokens/s (replay / live = {ratio:.3f})" + _drift_note(fid, fidelity),
            }
        )
    return out


def _drift_note(fid: dict, fidelity: dict) -> str:
    """When autoregressive decoding shows the same replay / live ratio, the gap is the machine's speed since
    the profile was measured, not the policy's decisions: say so."""
    rel = fid.get("relative_to_autoregressive")
    if rel is None:
        return ""
    return (
        f"; autoregressive decoding's replay / live is {fidelity['autoregressive']['replay_over_live']:.3f}, so "
        f"relative to it the learned policy's prediction is off by {rel - 1:+.1%}"
    )
