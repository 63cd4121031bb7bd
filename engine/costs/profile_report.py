"""The plain-text report of a ``CostProfile`` (``CostProfile.format_table``: what
``python -m engine.costs.measure_costs`` prints): every table in ms with its spread, c, the prefills, the batch
axis and the overhead."""

from __future__ import annotations

from typing import Any


def format_profile(profile: Any) -> str:
    """A compact plain-text report of ``profile`` (a ``CostProfile``): times in ms with the spread in percent."""
    ctx_head = "".join(f"{'ctx ' + str(c):>16}" for c in profile.contexts)

    def block(title: str, label: str, grid: list[int], table, spread) -> list[str]:
        rows = [f"{title}", f"{label:>8}{ctx_head}"]
        for i, g in enumerate(grid):
            cells = "".join(
                f"{1e3 * table[i][j]:>9.2f} ±{100 * spread[i][j]:>3.0f}%"
                for j in range(len(profile.contexts))
            )
            rows.append(f"{g:>8}{cells}")
        return rows

    zeros = lambda grid: [[0.0] * len(profile.contexts) for _ in grid]  # noqa: E731
    lines = [
        f"cost profile: {profile.meta.get('pair', '?')} {profile.meta.get('dtype', '?')} on "
        f"{profile.meta.get('device_name', '?')} ({profile.meta.get('num_threads', '?')} threads"
        f"{', RANDOM WEIGHTS' if profile.meta.get('random_weights') else ''}) -- ms, ±IQR/median"
    ]
    lines += block(
        "draft step vs frontier width W",
        "W",
        profile.widths,
        profile.draft_step_table,
        profile.draft_step_spread or zeros(profile.widths),
    )
    if profile.chunks:
        lines += block(
            "first draft step vs pending tokens P",
            "P",
            profile.chunks,
            profile.draft_chunk_table,
            profile.draft_chunk_spread or zeros(profile.chunks),
        )
    lines += block(
        "verify vs verified nodes V (1 + V rows)",
        "V",
        profile.sizes,
        profile.verify_table,
        profile.verify_spread or zeros(profile.sizes),
    )
    lines.append(
        "c = draft step(W=1) / verify(V=0): "
        + ", ".join(f"ctx {c}: {profile.c_ratio(c):.3f}" for c in profile.contexts)
    )
    if profile.prefill_lengths:
        lines.append(
            "prefill target / draft (ms): "
            + ", ".join(
                f"{n}: {1e3 * t:.1f} / {1e3 * d:.1f}"
                for n, t, d in zip(
                    profile.prefill_lengths,
                    profile.prefill_target_s,
                    profile.prefill_draft_s or [0.0] * len(profile.prefill_lengths),
                )
            )
        )
    if profile.batched:
        lines += _format_batched(profile)
    lines.append(
        f"overhead (ms): {1e3 * profile.overhead_base_s:.2f} + {1e3 * profile.overhead_per_node_s:.3f}/verified node"
        f" + {1e3 * profile.overhead_per_draft_row_s:.3f}/draft row (±{100 * profile.overhead_spread:.0f}%);"
        f" autoregressive step {1e3 * profile.ar_overhead_s:.2f}; controller call {1e3 * profile.policy_call_s:.3f}"
    )
    return "\n".join(lines)


def _format_batched(profile: Any) -> list[str]:
    """The batch axis: ms per forward by rows per sequence (r) and sequences (S), and in brackets the time
    over S forwards of one sequence (below 1: batching pays)."""
    lines = [f"batched forwards at context {profile.batched['context']} -- ms (/ S single-sequence forwards)"]
    for model in ("target", "draft"):
        r_grid, s_grid, table = profile.batched_grid(model)
        lines.append(f"{model:>8} r" + "".join(f"{'S ' + str(int(x)):>18}" for x in s_grid))
        for i, r in enumerate(r_grid):
            cells = ""
            for j, sequences in enumerate(s_grid):
                alone = sequences * table[i, 0] if s_grid[0] == 1 else 0.0
                ratio = f"({table[i, j] / alone:.2f})" if alone > 0 else ""
                cells += f"{1e3 * table[i, j]:>11.2f} {ratio:>6}"
            lines.append(f"{int(r):>10}{cells}")
    return lines
