"""results.json (every raw measurement and the config), report.md (tables, targets, conditions) and plots,
every file written atomically (a kill leaves the previous file or the new one, never part of one)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from engine.backends.files import atomic_write
from evaluation import plots
from evaluation.measurements import per_prompt

NAN = float("nan")


def _clean(obj):
    """JSON-safe: NaN/inf -> null, tuples -> lists, numpy scalars -> Python numbers."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _f(value, digits: int = 3, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value * scale:.{digits}f}"


def _table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _ci(ci: dict | None) -> str:
    return f"{_f(ci['ratio'])} [{_f(ci['low'])}, {_f(ci['high'])}]" if ci else "–"


# ------------------------------------------------------------------------------------------------ sections
def conditions_md(cond: dict, config: dict) -> list[str]:
    rows = [
        [k, ", ".join(f"{a}: {b}" for a, b in v.items()) if isinstance(v, dict) else v]
        for k, v in cond.items()
        if k not in ("policy_metrics", "profile")
    ]
    rows.append(["seed / bootstrap resamples", f"{config['seed']} / {config['bootstrap']}"])
    out = ["## Conditions", ""] + _table(["", "value"], rows)
    if cond.get("policy_metrics"):
        out += ["Policy training metrics (replay, validation split, from the policy file):", ""]
        out += _table(
            ["metric", "value"],
            [[k, _f(v) if isinstance(v, float) else v] for k, v in cond["policy_metrics"].items()],
        )
    if cond.get("profile"):
        prof = cond["profile"]
        out += [
            f"Cost profile: {', '.join(f'{k}={prof[k]}' for k in ('device', 'dtype', 'threads', 'date') if k in prof)}",
            "",
        ]
    return out


def results_md(summary: dict) -> list[str]:
    table, cis = summary["table"], summary["speedup_ci"]
    rows = []
    for name, by_lang in table.items():
        a = by_lang["all"]
        rows.append(
            [
                name,
                _f(a["tokens_per_s"]),
                _ci(cis[name]["all"]),
                _f(a["mean_accepted"], 2),
                _f(a["ttft_s"]),
                _f(a["itl_p50_s"], 1, 1e3),
                _f(a["itl_p90_s"], 1, 1e3),
                _f(a["itl_p99_s"], 1, 1e3),
                _f(a["total_s"], 1),
                _f(a["peak_memory_mb"], 0),
                int(a["prompts"]),
            ]
        )
    out = ["## Results (all measured prompts)", ""]
    out += _table(
        [
            "controller",
            "tokens/s",
            "speedup [95% CI]",
            "mean accepted",
            "TTFT s",
            "ITL p50 ms",
            "ITL p90 ms",
            "ITL p99 ms",
            "total s",
            "peak MB",
            "prompts",
        ],
        rows,
    )
    langs = [lang for lang in table["autoregressive"] if lang != "all"]
    out += ["### Per language: tokens/s (speedup over autoregressive)", ""]
    out += _table(
        ["controller"] + langs + ["all"],
        [
            [name]
            + [
                f"{_f(by[lang]['tokens_per_s'])} ({_f(by[lang]['speedup'], 2)}x)" if lang in by else "–"
                for lang in langs + ["all"]
            ]
            for name, by in table.items()
        ],
    )
    out += ["### Per language: mean accepted length / TTFT s / ITL p50 ms", ""]
    out += _table(
        ["controller"] + langs,
        [
            [name]
            + [
                f"{_f(by[lang]['mean_accepted'], 2)} / {_f(by[lang]['ttft_s'], 2)} / "
                f"{_f(by[lang]['itl_p50_s'], 1, 1e3)}"
                if lang in by
                else "–"
                for lang in langs
            ]
            for name, by in table.items()
        ],
    )
    return out


def ratios_md(summary: dict) -> list[str]:
    ratios = summary["learned_ratios"]
    lookup = summary.get("learned_lookup_ratios") or {}
    if not ratios and not lookup:
        return []
    rows = [
        [
            f"{who} / {k}" + (f" ({r['against']})" if r["against"] != k else ""),
            _f(r["ratio"]),
            f"[{_f(r['low'])}, {_f(r['high'])}]",
            r["prompts"],
        ]
        for who, table in (("learned", ratios), ("learned+lookup", lookup))
        for k, r in table.items()
    ]
    return [
        "## Learned policy ratios",
        "",
        "Throughput ratio (all tokens / all time of the learned policy over the other controller, same "
        "prompts); 95% paired bootstrap interval: prompts resampled with replacement, both controllers' "
        "numbers of a prompt kept together. learned+lookup: the same policy on the engine with context lookup "
        "drafting (engine.lookup).",
        "",
    ] + _table(["ratio", "point", "95% CI", "prompts"], rows)


def targets_md(summary: dict) -> list[str]:
    out = ["## Targets", ""]
    if summary.get("winner"):
        out += [f"**Winner** (all tokens / all time on the test prompts): {summary['winner']['line']}.", ""]
    for t in summary["targets"]:
        verdict = {True: "**PASS**", False: "**FAIL**", None: "NOT MEASURED"}[t["pass"]]
        extra = ""
        if t.get("ci") is not None:
            extra = (
                " — interval clears the threshold"
                if t["ci_clears"]
                else " — interval does not clear the threshold"
            )
        out.append(f"- {verdict}: {t['target']}: {t['detail']}{extra}")
    return out + [""]


def tuning_md(tuning: dict, best_static: str | None) -> list[str]:
    if not tuning:
        return []
    out = [
        "## Static grid search (tune split)",
        "",
        f"Replay grid on the tune prompts' traces, then the best configurations confirmed live on the same tune "
        f"prompts; the winner has the best median, over the prompts, of its tokens/s over the replay-best's on "
        f"the same prompt. Best static overall (faster live on tune): **{best_static}**.",
        "",
    ]
    for kind, t in tuning.items():
        best = t["best"]
        out.append(
            f"**{kind}** (width {t['width']}, {len(t['tune_prompts'])} tune prompts, "
            f"{t['max_new_tokens']} tokens): chosen depth {best['depth']}, verify {best['verify']}"
        )
        out.append("")
        out += _table(
            ["depth", "verify", "replay tokens/s", "live tokens/s", "live median x replay-best"],
            [
                [
                    c["depth"],
                    c["verify"],
                    _f(c["replay_tokens_per_s"]),
                    _f(c["live_tokens_per_s"]),
                    _f(c.get("live_median_ratio")),
                ]
                for c in t["confirmed"]
            ],
        )
        top = ", ".join(
            f"({g['depth']},{g['verify']}) {_f(g['replay_tokens_per_s'])}" for g in t["replay_grid"][:8]
        )
        out += [f"Replay grid top 8 of {len(t['replay_grid'])}: {top}", ""]
    return out


ORACLE_ROWS = {
    "oracle": "hindsight oracle (upper bound, replay only)",
    "oracle+lookup": "hindsight oracle + lookup (upper bound of the lookup rows, replay only)",
}


def replay_md(replay: dict | None, summary: dict) -> list[str]:
    if not replay:
        return []
    fid = summary["replay_vs_live"]
    out = [
        "## Replay: hindsight oracle and replay vs live (REPLAY numbers, cost-profile times)",
        "",
        f"Traces of the measured prompts (width {replay['width']}, depth {replay['max_depth']}, "
        f"{replay['traces']} traces); decode tokens/s (the prefill token excluded).",
        "",
    ]
    rows = [
        [
            name,
            _f(v["replay_tokens_per_s"]),
            _f(v.get("live_tokens_per_s")),
            _f(v.get("replay_over_live")),
            _f(v.get("relative_to_autoregressive")),
        ]
        for name, v in fid.items()
        if name not in ORACLE_ROWS
    ]
    for name, label in ORACLE_ROWS.items():
        if name in fid:
            rows.append([label, _f(fid[name]["replay_tokens_per_s"]), "–", "–", "–"])
    note = [
        "Relative to autoregressive: a controller's replay / live divided by autoregressive decoding's. A "
        "change of the machine's speed since the cost profile was measured moves every row's replay / live alike "
        "and cancels here; what remains is how well replay predicts the controller's decisions and their costs."
    ]
    return (
        out
        + _table(
            ["controller", "replay tokens/s", "live tokens/s", "replay / live", "relative to autoregressive"],
            rows,
        )
        + note
        + [""]
    )


def concurrency_md(load: dict | None, summary: dict) -> list[str]:
    if not load:
        return []
    rows = []
    for name, mode in load["modes"].items():
        s = mode["summary"]
        batch_one = summary["table"].get(name, {}).get("all", {}).get("speedup")
        rows.append(
            [
                name,
                _f(s["aggregate_tokens_per_s"]),
                _f(s["speedup"], 2),
                _f(batch_one, 2),
                _f(s["latency_p50_s"], 2),
                _f(s["latency_p90_s"], 2),
                _f(s["latency_p99_s"], 2),
                _f(s["ttft_p50_s"], 2),
                _f(s["itl_p50_s"], 1, 1e3),
                _f(s["itl_p99_s"], 1, 1e3),
                int(s["requests"]),
                _f(s["wall_s"], 1),
            ]
        )
    return [
        f"## Load: {load['workers']} concurrent requests",
        "",
        f"{load['workers']} worker threads, each with its own engine and controller, sharing the model weights "
        "and pulling prompts from one queue (closed loop, no cross-request batching). Aggregate = all tokens / "
        "wall time; latency = each request's start to last token.",
        "",
    ] + _table(
        [
            "mode",
            "aggregate tokens/s",
            "speedup under load",
            "speedup batch one",
            "latency p50 s",
            "p90 s",
            "p99 s",
            "TTFT p50 s",
            "ITL p50 ms",
            "ITL p99 ms",
            "requests",
            "wall s",
        ],
        rows,
    )


def server_replay_md(server: dict | None) -> list[str]:
    """The "Under load (server replay)" section (``evaluation.under_load``)."""
    if not server:
        return []
    out = ["## Under load (server replay)", ""]
    if server.get("skipped"):
        return out + [f"Not measured: {server['skipped']}.", ""]
    traces, poisson = server["traces"], server["poisson"]
    levels = [f"N={n}" for n in server["concurrencies"]]
    rates = ", ".join(f"{rate:g}/s from {start:g} s" for start, rate in poisson["rates"])
    lookup = f"context lookup {server['lookup']}"
    if server["lookup"] == "off":
        lookup += f" (the lookup-only row: {server['lookup_row']})"
    source = "recorded for this section" if traces["recorded_here"] else "those of the replay section"
    out += [
        "REPLAY numbers (cost-profile times; envs.server: the batched engine's steps over recorded requests, "
        "each step timed from the profile's batch axis). Every request runs the row's controller, on "
        f"{traces['measured']} traces of the {traces['split']} split ({source}: the measured prompts, "
        f"width {traces['width']}, depth {traces['max_depth']}, {traces['max_new_tokens']} tokens); the "
        f"per-load static table is tuned on {traces['tune']} traces of the {traces['tune_split']} split "
        f"({traces['tune_max_new_tokens']} tokens). Server: at most {server['max_requests']} requests at "
        f"once, a step's own cost {server['step_overhead_ms']:g} ms, {lookup}.",
        "",
        f"System tokens/s (every token over first arrival to last finish) with N clients in a closed loop; "
        f"Poisson: {poisson['requests']} requests arriving at {rates}, its system tokens/s and p99 "
        "inter-token latency; score: the mean over N of tokens/s over autoregressive decoding's (the "
        "lookup-only row when the server runs with lookup).",
        "",
    ]
    rows = [
        [name]
        + [_f(row[c], 1) for c in levels]
        + [_f(row["poisson"], 2), _f(row["poisson_itl_p99_ms"], 1), _f(row["score"])]
        for name, row in server["rows"].items()
    ]
    out += _table(["controller", *levels, "Poisson tokens/s", "Poisson ITL p99 ms", "score"], rows)
    table = ", ".join(f"N={n} depth {depth}" for n, (depth, _) in server["table"].items())
    out.append(f"Per-load static table (tuned on the tune traces): {table}.")
    if server.get("learned_depths"):
        depths = ", ".join(f"N={n} {d}" for n, d in server["learned_depths"].items())
        out.append(f"Learned draft length per load level (its mean drafted depth there, rounded): {depths}.")
    out += [f"Note: {note}." for note in server.get("notes", [])]
    return out + [""]


def exactness_md(ex: dict) -> list[str]:
    out = ["## Exactness audit", ""]
    kind = (
        "greedy: speculative tokens must equal autoregressive tokens"
        if ex.get("greedy", True)
        else "sampled runs with the same seed as autoregressive (deterministic drafts draw one target sample per "
        "emitted token, so equal up to float rounding; the two-sample test below is the law check)"
    )
    out += [f"Token audit ({kind}):", ""]
    rows = [
        [
            name,
            f"{a['identical']}/{a['prompts']}",
            f"{a['match_rate']:.1%}",
            ", ".join(f"{d['prompt_id']}@{d['position']}" for d in a["divergences"][:6]) or "–",
        ]
        for name, a in ex["token_audit"].items()
    ]
    out += _table(["controller", "identical prompts", "match rate", "first divergence (prompt@token)"], rows)
    if ex.get("peer_token_audit"):
        out += [
            "transformers' assisted generation vs our autoregressive (informational: another implementation's "
            "kernels and rounding):",
            "",
        ]
        out += _table(
            ["peer", "identical prompts", "match rate"],
            [
                [n, f"{a['identical']}/{a['prompts']}", f"{a['match_rate']:.1%}"]
                for n, a in ex["peer_token_audit"].items()
            ],
        )
    sampled = ex.get("sampled")
    if sampled:
        out += [
            f"Sampled two-sample test: {sampled['controller_name']} ({sampled['controller']}) vs autoregressive, "
            f"temperature {sampled['temperature']:g}, joint law of the first k = {sampled['k']} tokens, "
            f"{sampled['samples_per_arm']} requests per arm and prompt, every request its own seed (speculative "
            f"requests generate {sampled['speculative_budget']} tokens).",
            "",
        ]
        out += _table(
            [
                "prompt",
                "test",
                "n (AR / spec)",
                "categories (cells)",
                "statistic",
                "dof",
                "p-value",
                "drafting cycles",
            ],
            [
                [
                    p["prompt_id"],
                    p["test"],
                    f"{p['n_a']} / {p['n_b']}",
                    f"{p['categories']} ({p['cells']})",
                    _f(p["statistic"], 2),
                    p["dof"],
                    f"{p['pvalue']:.3g}",
                    f"{p['drafting_cycles']} / {p['speculative_cycles']}" if "drafting_cycles" in p else "–",
                ]
                for p in sampled["prompts"]
            ],
        )
        verdict = "REJECTS equality of laws" if sampled["rejects"] else "does not reject equality of laws"
        out += [
            f"Combined (Fisher) p-value: {sampled['fisher_pvalue']:.3g} — {verdict} at 1e-3. Drafting cycles: "
            "cycles of the speculative arm that drafted at least one token, of all its cycles (a controller "
            "that never drafts tests nothing but the autoregressive step).",
            "",
        ]
        blind = [p["prompt_id"] for p in sampled["prompts"] if p["cells"] < 2]
        if blind:
            out += [
                f"Note: on {', '.join(blind)} every outcome was rarer than the pooling threshold, so the table "
                "has one cell and the test has no power there (raise --samples or lower the temperature).",
                "",
            ]
    if ex.get("law_checks"):
        out += [
            "Sampler law checks (Monte Carlo of `engine.sampling.verify_chain`, two emitted tokens of a toy "
            "target, vs the exact law; chi-square p and total variation against its bound; the wrong rule is a "
            "negative control that must be flagged):",
            "",
        ]
        out += _table(
            ["case", "rule", "trials", "p-value", "TV", "TV bound", "expected", "result"],
            [
                [
                    c["case"],
                    c["rule"],
                    c["trials"],
                    f"{c['pvalue']:.3g}",
                    _f(c["tv"], 4),
                    _f(c["tv_bound"], 4),
                    c["expected"],
                    "ok" if c["ok"] else "**UNEXPECTED**",
                ]
                for c in ex["law_checks"]
            ],
        )
    return out


# ----------------------------------------------------------------------------------------------- writers
def write_json(results: dict, path: Path) -> Path:
    """``results`` made JSON-safe (``_clean``) and written atomically."""
    return atomic_write(path, json.dumps(_clean(results), indent=1, ensure_ascii=False) + "\n")


def write_report(results: dict, out_dir: str | Path) -> Path:
    """report.md, results.json and the PNG figures in ``out_dir``; returns the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = results["summary"]
    write_json(results, out / "results.json")  # first: the raw measurements survive a failing figure
    speedup, hist, actions = plots.FIGURES
    figures = [("Speedup per controller and language", plots.speedup_plot(summary, out / speedup))]
    rows = per_prompt(results["runs"])
    cycles = {name: [c for row in by.values() for c in row["cycles"]] for name, by in rows.items()}
    figures.append(("Accepted length per cycle", plots.accepted_hist(cycles, out / hist)))
    if results.get("learned_actions"):
        figures.append(
            ("Learned policy actions", plots.learned_actions_plot(results["learned_actions"], out / actions))
        )
    cond = results["conditions"]
    lines = [
        "# draftpilot evaluation",
        "",
        f"{cond['pair']} ({cond['dtype']}, {cond['device']}), {cond['sampling']}, split {cond['split']}, "
        f"{sum(cond['prompts'].values())} prompts, {cond['max_new_tokens']} new tokens, {cond['reps']} rep(s); "
        f"{cond['date']}. Controllers are interleaved prompt by prompt (order rotated per prompt), so machine "
        "drift affects all alike; per prompt the median over repetitions is used.",
        "",
    ]
    sittings = results.get("sittings") or []
    if len(sittings) > 1:
        lines += [
            f"Measured in {len(sittings)} sittings (interrupted and resumed with the same config; started "
            f"{', '.join(s['started'] for s in sittings)}). All controllers of a prompt were measured in the "
            "same sitting, so per-prompt ratios stay paired.",
            "",
        ]
    lines += [f"> **WARNING**: {w}" for w in results.get("warnings", [])] + (
        [""] if results.get("warnings") else []
    )
    lines += (
        targets_md(summary)
        + results_md(summary)
        + ratios_md(summary)
        + conditions_md(cond, results["config"])
    )
    lines += tuning_md(results.get("tuning"), results.get("best_static"))
    lines += replay_md(results.get("replay"), summary) + concurrency_md(results.get("concurrency"), summary)
    lines += server_replay_md(results.get("server_replay"))
    lines += exactness_md(results["exactness"]) + ["## Figures", ""]
    lines += [f"![{title}]({p.name})" for title, p in figures] + [""]
    lines += [
        "## Method notes",
        "",
        "- tokens/s = all generated tokens / all request time (prefill + decode) over the prompts; speedup is "
        "relative to our autoregressive decoding in the same run.",
        "- ITL is amortised: a cycle of T seconds committing n tokens counts n latencies of T/n. TTFT = prefill "
        "+ first token (transformers: time to the first streamed chunk).",
        "- Peak memory: CUDA max allocated per request; on CPU the process's peak RSS (monotone over the run).",
        "- transformers' accepted length = streamed chunk size - 1 per assisted step.",
        "- The learned policy is loaded with this run's cost profile, so its device features describe the "
        "device it runs on (the same features as in training when the profile is the cached one).",
        "- Every measured request uses the same seed (the traces' seed), so in sampled mode all controllers "
        "follow the same target-law trajectory (up to float rounding), the one the replay traces hold.",
        f"- Evaluation wall time: {_f(results.get('wall_s'), 0)} s.",
        "",
    ]
    path = out / "report.md"
    return atomic_write(path, "\n".join(lines))


def summary_lines(results: dict) -> list[str]:
    """The short table ``evaluate.py`` prints at the end."""
    summary = results["summary"]
    ratios = summary["learned_ratios"]
    lines = [f"{'controller':24s}{'tokens/s':>10s}{'speedup':>9s}{'learned/x':>11s}"]
    for name, by in summary["table"].items():
        r = next((v for v in ratios.values() if v["against"] == name), None)
        lines.append(
            f"{name:24s}{_f(by['all']['tokens_per_s']):>10s}{_f(by['all']['speedup'], 2) + 'x':>9s}"
            f"{(_f(r['ratio']) if r else '–'):>11s}"
        )
    server = results.get("server_replay") or {}
    if server.get("rows"):
        levels = ",".join(str(n) for n in server["concurrencies"])
        scores = ", ".join(f"{name} {_f(row['score'], 2)}" for name, row in server["rows"].items())
        lines.append(
            f"under load (server replay, mean over N={levels} of tokens/s / autoregressive): {scores}"
        )
    elif server.get("skipped"):
        lines.append("under load (server replay): not measured (see the report)")
    verdicts = {True: "PASS", False: "FAIL", None: "n/a "}
    lines += [f"{verdicts[t['pass']]}  {t['target']}" for t in summary["targets"]]
    if summary.get("winner"):
        lines.append(summary["winner"]["line"])
    return lines


def write_exactness_report(results: dict, out_dir: str | Path) -> Path:
    """``python evaluate.py exactness``: exactness.md and exactness.json in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cond = results["conditions"]
    lines = [
        "# draftpilot exactness audit",
        "",
        f"{cond['pair']} ({cond['dtype']}, {cond['device']}, {cond['threads']} threads), torch {cond['torch']}, "
        f"transformers {cond['transformers']}, split {cond['split']}, {sum(cond['prompts'].values())} prompts, "
        f"{cond['max_new_tokens']} greedy tokens per prompt; {cond['date']}. Static settings are fixed "
        "(chain depth 4; tree depth 4, verify 8), not grid-searched: the audit is about the law, not speed.",
        "",
    ]
    lines += [f"> **WARNING**: {w}" for w in results.get("warnings", [])] + [""]
    lines += exactness_md(results["exactness"]) + conditions_md(cond, results["config"])
    write_json(results, out / "exactness.json")
    path = out / "exactness.md"
    return atomic_write(path, "\n".join(lines))
