"""The sections of ``report.md`` (``evaluation.report`` writes it): the conditions, the throughput and speedup
tables, the paired ratios and targets, the static tuning, replay, concurrency and server replay sections, and the
formatting they share (``fmt``, ``fmt_ci``, ``md_table``; ``clean``: JSON-safe values)."""

from __future__ import annotations

import math

NAN = float("nan")


def clean(obj):
    """JSON-safe: NaN/inf -> null, tuples -> lists, numpy scalars -> Python numbers."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def fmt(value, digits: int = 3, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value * scale:.{digits}f}"


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def fmt_ci(ci: dict | None) -> str:
    return f"{fmt(ci['ratio'])} [{fmt(ci['low'])}, {fmt(ci['high'])}]" if ci else "–"


def conditions_md(cond: dict, config: dict) -> list[str]:
    rows = [
        [k, ", ".join(f"{a}: {b}" for a, b in v.items()) if isinstance(v, dict) else v]
        for k, v in cond.items()
        if k not in ("policy_metrics", "profile")
    ]
    rows.append(["seed / bootstrap resamples", f"{config['seed']} / {config['bootstrap']}"])
    out = ["## Conditions", ""] + md_table(["", "value"], rows)
    if cond.get("policy_metrics"):
        out += ["Policy training metrics (replay, validation split, from the policy file):", ""]
        out += md_table(
            ["metric", "value"],
            [[k, fmt(v) if isinstance(v, float) else v] for k, v in cond["policy_metrics"].items()],
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
                fmt(a["tokens_per_s"]),
                fmt_ci(cis[name]["all"]),
                fmt(a["mean_accepted"], 2),
                fmt(a["ttft_s"]),
                fmt(a["itl_p50_s"], 1, 1e3),
                fmt(a["itl_p90_s"], 1, 1e3),
                fmt(a["itl_p99_s"], 1, 1e3),
                fmt(a["total_s"], 1),
                fmt(a["peak_memory_mb"], 0),
                int(a["prompts"]),
            ]
        )
    out = ["## Results (all measured prompts)", ""]
    out += md_table(
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
    out += md_table(
        ["controller"] + langs + ["all"],
        [
            [name]
            + [
                f"{fmt(by[lang]['tokens_per_s'])} ({fmt(by[lang]['speedup'], 2)}x)" if lang in by else "–"
                for lang in langs + ["all"]
            ]
            for name, by in table.items()
        ],
    )
    out += ["### Per language: mean accepted length / TTFT s / ITL p50 ms", ""]
    out += md_table(
        ["controller"] + langs,
        [
            [name]
            + [
                f"{fmt(by[lang]['mean_accepted'], 2)} / {fmt(by[lang]['ttft_s'], 2)} / "
                f"{fmt(by[lang]['itl_p50_s'], 1, 1e3)}"
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
            fmt(r["ratio"]),
            f"[{fmt(r['low'])}, {fmt(r['high'])}]",
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
    ] + md_table(["ratio", "point", "95% CI", "prompts"], rows)


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
        out += md_table(
            ["depth", "verify", "replay tokens/s", "live tokens/s", "live median x replay-best"],
            [
                [
                    c["depth"],
                    c["verify"],
                    fmt(c["replay_tokens_per_s"]),
                    fmt(c["live_tokens_per_s"]),
                    fmt(c.get("live_median_ratio")),
                ]
                for c in t["confirmed"]
            ],
        )
        top = ", ".join(
            f"({g['depth']},{g['verify']}) {fmt(g['replay_tokens_per_s'])}" for g in t["replay_grid"][:8]
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
            fmt(v["replay_tokens_per_s"]),
            fmt(v.get("live_tokens_per_s")),
            fmt(v.get("replay_over_live")),
            fmt(v.get("relative_to_autoregressive")),
        ]
        for name, v in fid.items()
        if name not in ORACLE_ROWS
    ]
    for name, label in ORACLE_ROWS.items():
        if name in fid:
            rows.append([label, fmt(fid[name]["replay_tokens_per_s"]), "–", "–", "–"])
    note = [
        "Relative to autoregressive: a controller's replay / live divided by autoregressive decoding's. A "
        "change of the machine's speed since the cost profile was measured moves every row's replay / live alike "
        "and cancels here; what remains is how well replay predicts the controller's decisions and their costs."
    ]
    return (
        out
        + md_table(
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
                fmt(s["aggregate_tokens_per_s"]),
                fmt(s["speedup"], 2),
                fmt(batch_one, 2),
                fmt(s["latency_p50_s"], 2),
                fmt(s["latency_p90_s"], 2),
                fmt(s["latency_p99_s"], 2),
                fmt(s["ttft_p50_s"], 2),
                fmt(s["itl_p50_s"], 1, 1e3),
                fmt(s["itl_p99_s"], 1, 1e3),
                int(s["requests"]),
                fmt(s["wall_s"], 1),
            ]
        )
    return [
        f"## Load: {load['workers']} concurrent requests",
        "",
        f"{load['workers']} worker threads, each with its own engine and controller, sharing the model weights "
        "and pulling prompts from one queue (closed loop, no cross-request batching). Aggregate = all tokens / "
        "wall time; latency = each request's start to last token.",
        "",
    ] + md_table(
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
        + [fmt(row[c], 1) for c in levels]
        + [fmt(row["poisson"], 2), fmt(row["poisson_itl_p99_ms"], 1), fmt(row["score"])]
        for name, row in server["rows"].items()
    ]
    out += md_table(["controller", *levels, "Poisson tokens/s", "Poisson ITL p99 ms", "score"], rows)
    table = ", ".join(f"N={n} depth {depth}" for n, (depth, _) in server["table"].items())
    out.append(f"Per-load static table (tuned on the tune traces): {table}.")
    if server.get("learned_depths"):
        depths = ", ".join(f"N={n} {d}" for n, d in server["learned_depths"].items())
        out.append(f"Learned draft length per load level (its mean drafted depth there, rounded): {depths}.")
    out += [f"Note: {note}." for note in server.get("notes", [])]
    return out + [""]
