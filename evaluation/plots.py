"""The report's figures (matplotlib, Agg backend: no display needed), each written atomically."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from engine.backends.files import atomic_path  # noqa: E402
from evaluation.measurements import accepted_lengths  # noqa: E402

FIGURES = ("speedup.png", "accepted_hist.png", "learned_actions.png")
"""File names of the figures ``evaluation.report.write_report`` writes (``--restart`` removes them)."""


def save_figure(fig, path: Path) -> Path:
    """``fig`` as a PNG at ``path``, atomically (a kill never leaves a truncated image), then closed."""
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")  # the temporary name has no .png: say the format
    finally:
        plt.close(fig)
    return Path(path)


def speedup_plot(summary: dict, path: Path) -> Path:
    """Speedup over autoregressive per controller and language, 95% bootstrap intervals as error bars."""
    table, cis = summary["table"], summary["speedup_ci"]
    names = [n for n in table if n != "autoregressive"]
    langs = [lang for lang in table["autoregressive"] if lang != "all"] + ["all"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(langs) * max(1, len(names)) * 0.35 + 2), 4.2))
    width = 0.8 / max(1, len(names))
    x = np.arange(len(langs))
    for i, name in enumerate(names):
        vals = np.asarray([table[name].get(lang, {}).get("speedup", np.nan) for lang in langs])
        lows = np.asarray([(cis[name].get(lang) or {}).get("low", np.nan) for lang in langs])
        highs = np.asarray([(cis[name].get(lang) or {}).get("high", np.nan) for lang in langs])
        err = np.vstack([np.clip(vals - lows, 0, None), np.clip(highs - vals, 0, None)])
        ax.bar(
            x + (i - (len(names) - 1) / 2) * width,
            vals,
            width,
            yerr=np.nan_to_num(err),
            capsize=2,
            label=name,
        )
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, langs)
    ax.set_ylabel("speedup over autoregressive (tokens/s ratio)")
    ax.set_title("Speedup per controller and language (95% paired bootstrap CI over prompts)")
    if names:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save_figure(fig, path)


def accepted_hist(cycles_by_controller: dict[str, list], path: Path) -> Path:
    """Accepted drafted tokens per cycle, one panel per speculative controller."""
    data = {name: accepted_lengths(cycles) for name, cycles in cycles_by_controller.items()}
    data = {name: vals for name, vals in data.items() if vals}
    cols = 3
    rows = max(1, -(-len(data) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, (name, vals) in zip(axes.ravel(), data.items()):
        top = max(vals)
        ax.hist(vals, bins=np.arange(top + 2) - 0.5, color="tab:blue", alpha=0.8)
        ax.set_title(f"{name} (mean {np.mean(vals):.2f}, {len(vals)} cycles)", fontsize=9)
        ax.set_xlabel("accepted tokens per cycle")
    for ax in axes.ravel()[len(data) :]:
        ax.axis("off")
    fig.tight_layout()
    return save_figure(fig, path)


def verified_size_rows(rows) -> np.ndarray:
    """Size-log rows (ctx, depth, nodes drafted, top p, size asked) as an array whose last column is the
    number of nodes actually verified: the engine caps the ladder value the policy asks for at the nodes
    drafted (a chain of depth 2 asked to verify 32 verifies 2)."""
    size = np.asarray(rows, dtype=np.float64).reshape(-1, 5)
    size[:, 4] = np.minimum(size[:, 4], size[:, 2])
    return size


def learned_actions_plot(actions: dict, path: Path) -> Path:
    """The learned policy's decisions: chosen depth and size against context position and draft confidence."""
    depth = np.asarray(actions["depth"], dtype=np.float64).reshape(
        -1, 5
    )  # ctx, depth, step p, frontier p, go
    size = verified_size_rows(actions["size"])  # ctx, depth, nodes, top p, size verified
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    rng = np.random.default_rng(0)  # jitter only
    if len(size):
        ax = axes[0, 0]
        ax.scatter(size[:, 0], size[:, 1] + rng.uniform(-0.15, 0.15, len(size)), s=6, alpha=0.5)
        ax.set(xlabel="context length (tokens)", ylabel="chosen depth", title="depth vs context position")
        ax = axes[0, 1]
        ax.scatter(
            size[:, 0], size[:, 4] + rng.uniform(-0.2, 0.2, len(size)), s=6, alpha=0.5, color="tab:orange"
        )
        ax.set(xlabel="context length (tokens)", ylabel="nodes verified", title="size vs context position")
        ax = axes[1, 1]
        ax.scatter(
            size[:, 3], size[:, 4] + rng.uniform(-0.2, 0.2, len(size)), s=6, alpha=0.5, color="tab:orange"
        )
        ax.set(
            xlabel="best node path prob (draft)", ylabel="nodes verified", title="size vs draft confidence"
        )
    zero = depth[depth[:, 1] == 0]  # depth-0 questions (draft at all?): no draft probabilities yet
    depth = depth[depth[:, 1] > 0]
    if len(depth):
        ax = axes[1, 0]
        bins = np.linspace(0, 1, 11)
        which = np.clip(np.digitize(depth[:, 2], bins) - 1, 0, len(bins) - 2)
        rate = [depth[which == b, 4].mean() if np.any(which == b) else np.nan for b in range(len(bins) - 1)]
        counts = [int(np.sum(which == b)) for b in range(len(bins) - 1)]
        centers = (bins[:-1] + bins[1:]) / 2
        ax.bar(centers, rate, width=0.09, color="tab:green", alpha=0.8)
        for c, r, n in zip(centers, rate, counts):
            if n:
                ax.text(c, (r if np.isfinite(r) else 0) + 0.02, str(n), ha="center", fontsize=6)
        skipped = f"; drafted in {zero[:, 4].mean():.0%} of {len(zero)} cycles asked" if len(zero) else ""
        ax.set(
            xlabel="top draft step prob (last step)",
            ylabel="P(continue drafting)",
            ylim=(0, 1.1),
            title=f"depth decision vs draft confidence (n per bin){skipped}",
        )
    for ax in axes.ravel():
        if not ax.has_data():
            ax.text(0.5, 0.5, "no decisions recorded", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("Learned policy: actions")
    fig.tight_layout()
    return save_figure(fig, path)
