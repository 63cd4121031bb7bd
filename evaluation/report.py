"""results.json (every raw measurement and the config), report.md (tables, targets, conditions) and plots,
every file written atomically (a kill leaves the previous file or the new one, never part of one); the exactness
section and report. The other sections of report.md are ``evaluation.report_tables``."""

from __future__ import annotations

import json
from pathlib import Path

from engine.backends.files import atomic_write
from evaluation import plots
from evaluation.measurements import per_prompt
from evaluation.report_tables import (
    clean,
    concurrency_md,
    conditions_md,
    fmt,
    md_table,
    ratios_md,
    replay_md,
    results_md,
    server_replay_md,
    targets_md,
    tuning_md,
)


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
    out += md_table(
        ["controller", "identical prompts", "match rate", "first divergence (prompt@token)"], rows
    )
    if ex.get("peer_token_audit"):
        out += [
            "transformers' assisted generation vs our autoregressive (informational: another implementation's "
            "kernels and rounding):",
            "",
        ]
        out += md_table(
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
        out += md_table(
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
                    fmt(p["statistic"], 2),
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
        out += md_table(
            ["case", "rule", "trials", "p-value", "TV", "TV bound", "expected", "result"],
            [
                [
                    c["case"],
                    c["rule"],
                    c["trials"],
                    f"{c['pvalue']:.3g}",
                    fmt(c["tv"], 4),
                    fmt(c["tv_bound"], 4),
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
    return atomic_write(path, json.dumps(clean(results), indent=1, ensure_ascii=False) + "\n")


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
        f"- Evaluation wall time: {fmt(results.get('wall_s'), 0)} s.",
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
            f"{name:24s}{fmt(by['all']['tokens_per_s']):>10s}{fmt(by['all']['speedup'], 2) + 'x':>9s}"
            f"{(fmt(r['ratio']) if r else '–'):>11s}"
        )
    server = results.get("server_replay") or {}
    if server.get("rows"):
        levels = ",".join(str(n) for n in server["concurrencies"])
        scores = ", ".join(f"{name} {fmt(row['score'], 2)}" for name, row in server["rows"].items())
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
