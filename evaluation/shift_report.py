"""The shift evaluation's report (``evaluation.shift``): the summary targets of a run's results, ``shift.md``,
``shift.json`` and the heat maps of ``shift.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.backends.files import atomic_path, atomic_write_json


def summarize(results: dict) -> dict:
    """The issue's replay targets: learned over the static setting tuned on another slice (mean over the
    off-diagonal cells of every axis), over the in-slice static on every diagonal cell, over the oracle."""
    off, diag, oracle = [], {}, {}
    for axis, res in results["axes"].items():
        for a in res["slices"]:
            for b in res["slices"]:
                r = res["cells"][a][b]["learned_over_static"]["ratio"]
                if a == b:
                    diag[f"{axis}:{b}"] = r
                else:
                    off.append(r)
        for b in res["slices"]:
            lo = res["test"][b]["learned_over"].get("oracle")
            if lo:
                oracle[f"{axis}:{b}"] = lo["ratio"]
    return {
        "off_diagonal_mean": float(np.mean(off)) if off else float("nan"),
        "off_diagonal_cells": len(off),
        "diagonal": diag,
        "diagonal_min": min(diag.values()) if diag else float("nan"),
        "learned_over_oracle": oracle,
        "learned_over_oracle_min": min(oracle.values()) if oracle else float("nan"),
    }


def summarize_live(live: dict) -> dict:
    temp = live.get("temperature", {})
    names = list(temp)
    out = {}
    if names:
        first = names[0]
        for b in names[1:]:
            entry = temp[b]["learned_over"]
            out[f"live {b}: learned / static tuned at {first}"] = entry.get(f"static@{first}", {}).get(
                "ratio"
            )
            out[f"live {b}: learned / static tuned at {b}"] = entry.get(f"static@{b}", {}).get("ratio")
    return {"live_temperature": out}


# ------------------------------------------------------------------------------------------- report
def _fmt(ci: dict | None) -> str:
    if not ci:
        return "n/a"
    return f"{ci['ratio']:.3f} [{ci['low']:.2f}, {ci['high']:.2f}]"


def _mean_int(values) -> str:
    return f"{np.mean(values):.0f}" if values else "?"


def write_shift_report(results: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "shift.json", results, default=str)
    heatmap(results, out / "shift.png")
    s, cond = results["summary"], results.get("conditions", {})
    lines = [
        "# Shift evaluation",
        "",
        f"Policy `{results['policy']}`; {cond.get('cpu')}, {cond.get('threads')} threads, load "
        f"{cond.get('load_avg')}; profile {cond.get('profile')}; {cond.get('date')}.",
        f"Context lookup on every controller's engine: {cond.get('lookup', 'off')} (with lookup, "
        "autoregressive is lookup alone; the oracle plans around the lookup's cycles).",
        "Replay: exact cycles from recorded traces, times from the cost profile. Cells: learned / static "
        "tuned on the row's slice, measured on the column's slice (95% paired bootstrap over prompts).",
        "",
        "## Targets (replay)",
        "",
        f"- learned over the static setting tuned on another slice, mean over {s['off_diagonal_cells']} "
        f"off-diagonal cells: **{s['off_diagonal_mean']:.3f}x** (target >= 1.15x)",
        f"- learned over the in-slice static on the diagonal, lowest cell: **{s['diagonal_min']:.3f}x** "
        f"(target >= 1.0x on every cell): " + ", ".join(f"{k} {v:.3f}" for k, v in s["diagonal"].items()),
        f"- learned over the hindsight oracle, lowest slice: **{s['learned_over_oracle_min']:.3f}x** (target "
        ">= 0.95x): " + ", ".join(f"{k} {v:.3f}" for k, v in s["learned_over_oracle"].items()),
    ]
    for key, value in (s.get("live_temperature") or {}).items():
        lines.append(f"- {key}: {value:.3f}x" if value is not None else f"- {key}: n/a")
    for axis, res in results["axes"].items():
        names = res["slices"]
        lines += [
            "",
            f"## Axis: {axis}",
            "",
            "Static setting tuned on each slice's tune prompts (replay):",
            "",
        ]
        lines += [
            f"- {a}: (depth {res['tuned'][a]['depth']}, verify {res['tuned'][a]['verify']}) on "
            f"{len(res['tuned'][a]['tune_prompts'])} tune traces"
            for a in names
        ]
        lines += ["", "Learned / static tuned on row, measured on column:", ""]
        lines += ["| tuned on \\ measured on | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for a in names:
            lines.append(
                f"| {a} | "
                + " | ".join(_fmt(res["cells"][a][b]["learned_over_static"]) for b in names)
                + " |"
            )
        lines += ["", "Tokens/s (replay) on each measured slice:", ""]
        cols = (
            ["autoregressive", "learned", "analytic", "confidence"]
            + [f"static@{a}" for a in names]
            + [
                "static_hindsight",
                "oracle",
            ]
        )
        lines += [
            "| measured on | traces | prompt / new tokens | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 3) + "|",
        ]
        for b in names:
            t = res["test"][b]
            lines.append(
                f"| {b} | {len(t['prompts'])} | {t.get('mean_prompt_tokens', float('nan')):.0f} / "
                f"{t.get('mean_decode_tokens', float('nan')):.0f} | "
                + " | ".join(f"{t['tokens_per_s'].get(c, float('nan')):.2f}" for c in cols)
                + " |"
            )
        lines += ["", "Learned over, on each measured slice:", ""]
        keys = ["autoregressive", "analytic", "confidence", "static_hindsight", "oracle"]
        lines += ["| measured on | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for b in names:
            lo = res["test"][b]["learned_over"]
            lines.append(f"| {b} | " + " | ".join(_fmt(lo.get(k)) for k in keys) + " |")
    live = results.get("live")
    if live:
        lines += [
            "",
            "## Live confirmation",
            "",
            "Interleaved prompt by prompt, decode tokens/s; learned over "
            "each controller with 95% paired bootstrap intervals.",
            "",
        ]
        for axis, slices in live.items():
            for b, e in slices.items():
                lines.append(
                    f"- {axis} {b} (T {e['temperature']:g}, {len(e['prompts'])} prompts of "
                    f"{_mean_int(e.get('prompt_tokens'))} tokens, {e.get('max_new_tokens')} new, identical to "
                    f"autoregressive {e['identical_to_autoregressive']}): "
                    + ", ".join(f"{n} {v:.2f}" for n, v in e["tokens_per_s"].items())
                    + "; learned over "
                    + ", ".join(f"{n} {_fmt(ci)}" for n, ci in e["learned_over"].items())
                )
    path = out / "shift.md"
    with atomic_path(path) as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n")
    return path


def heatmap(results: dict, path: Path) -> Path:
    from evaluation.plots import plt, save_figure

    axes = list(results["axes"].items())
    fig, grid = plt.subplots(1, len(axes), figsize=(4.2 * len(axes), 3.8), squeeze=False)
    for ax, (axis, res) in zip(grid[0], axes):
        names = res["slices"]
        m = np.asarray([[res["cells"][a][b]["learned_over_static"]["ratio"] for b in names] for a in names])
        im = ax.imshow(m, cmap="RdYlGn", vmin=0.8, vmax=1.2)
        ax.set_xticks(range(len(names)), names)
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("measured on")
        ax.set_ylabel("static tuned on")
        ax.set_title(f"{axis}: learned / static")
        for i in range(len(names)):
            for j in range(len(names)):
                ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return save_figure(fig, path)
