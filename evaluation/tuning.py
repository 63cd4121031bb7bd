"""The static baselines, grid-searched on the tune prompts (never on the measured ones).

1. Replay grid: traces of the tune prompts (width 1 for chains, W for trees) through every static
   (depth, size) with the cost profile (``envs.oracle.static_grid``); configurations the engine treats
   alike (size above the nodes drafted at that depth) are merged.
2. Live confirmation: the ``confirm_top`` best of each kind run on the real engine over the tune
   prompts, interleaved prompt by prompt. The winner is the candidate with the highest median, over the
   prompts, of its tokens/s over the replay-best candidate's on the same prompt (paired; ties keep the
   replay order). A sum over prompts (all tokens / all time) let one disturbed prompt decide: a 2-core
   machine busy for a few seconds once made a confirmation run the replay-best (2, 2) at 0.81x its speed
   of the run before and pick (1, 1) (docs/results/README.md, 2026-12-02). The sums are still reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from tqdm.auto import tqdm

from engine.backends.pair import ModelPair
from engine.control import StaticController
from engine.costs.cost_profile import CostProfile
from engine.engine import SpeculativeEngine
from envs import workspace
from envs.oracle import static_grid
from envs.replay import ReplayTrace
from evaluation.measurements import run_engine


def replay_ranking(traces: Sequence[ReplayTrace], profile: CostProfile) -> list[dict]:
    """Distinct static configurations, best replay throughput first (ties: smaller depth, then size)."""
    grid = static_grid(traces, profile)
    seen: dict[tuple[int, int], dict] = {}
    for (depth, size), tps in grid.items():
        verify = min(size, traces[0].num_drafted(0, depth))
        key = (depth, verify)
        if key not in seen or tps > seen[key]["replay_tokens_per_s"]:
            seen[key] = {"depth": depth, "verify": verify, "replay_tokens_per_s": float(tps)}
    return sorted(seen.values(), key=lambda r: (-r["replay_tokens_per_s"], r["depth"], r["verify"]))


def confirm_live(
    engine,
    candidates: list[dict],
    width: int,
    prompts: Sequence[tuple[str, list[int]]],
    max_new_tokens: int,
    seed: int,
    bar=None,
) -> list[dict]:
    """Run every candidate on every tune prompt (candidate order rotated per prompt); adds live figures:
    the sums over prompts, the per-prompt tokens/s and ``live_median_ratio`` (the median over prompts of the
    candidate's tokens/s over the first candidate's on the same prompt)."""
    runs: list[list[tuple[int, float]]] = [[] for _ in candidates]  # (tokens, seconds) per prompt
    for index, (_, ids) in enumerate(prompts):
        order = list(range(len(candidates)))
        order = order[index % len(order) :] + order[: index % len(order)]
        for i in order:
            cand = candidates[i]
            run = run_engine(
                engine,
                ids,
                StaticController(cand["depth"], cand["verify"], tree_width=width),
                max_new_tokens,
                seed,
            )
            runs[i].append((run["num_tokens"], run["total_s"]))
            if bar is not None:
                bar.update()

    def rate(tokens: float, seconds: float) -> float:
        return tokens / seconds if seconds > 0 else float("nan")

    rates = [[rate(*r) for r in by_prompt] for by_prompt in runs]
    out = []
    for cand, by_prompt, own in zip(candidates, runs, rates):
        tokens, seconds = sum(t for t, _ in by_prompt), sum(s for _, s in by_prompt)
        ratios = [r / ref for r, ref in zip(own, rates[0])]
        out.append(
            {
                **cand,
                "live_tokens": tokens,
                "live_s": seconds,
                "live_tokens_per_s": rate(tokens, seconds),
                "live_prompt_tokens_per_s": own,
                "live_median_ratio": statistics.median(ratios) if ratios else float("nan"),
            }
        )
    return out


def confirmed_best(confirmed: Sequence[dict]) -> dict:
    """The live-confirmed winner: highest paired median ratio to the replay-best candidate (the first);
    ties, and NaN ratios, keep the replay order."""

    def key(item):
        index, cand = item
        ratio = cand["live_median_ratio"]
        return (ratio if ratio == ratio else float("-inf"), -index)

    return max(enumerate(confirmed), key=key)[1]


def tune_static(
    pair: ModelPair,
    engine: SpeculativeEngine,
    profile: CostProfile,
    tune_prompts: list[dict],
    *,
    kinds: Sequence[str],
    tree_width: int,
    max_depth: int,
    temperature: float,
    max_new_tokens: int,
    confirm_top: int,
    cache_dir: str,
    seed: int,
    progress: bool,
) -> dict[str, dict]:
    """kind ("static_chain", "static_tree") -> {"width", "replay_grid", "confirmed", "best"}."""
    widths = {"static_chain": 1, "static_tree": tree_width}
    encoded = [(p["id"], pair.encode(p["prompt"])) for p in tune_prompts]
    out: dict[str, dict] = {}
    ranked: dict[str, list[dict]] = {}
    for kind in kinds:
        traces = workspace.ensure_traces(
            pair,
            tune_prompts,
            cache_dir,
            temperature=temperature,
            tree_width=widths[kind],
            max_depth=max_depth,
            max_new_tokens=max_new_tokens,
            seed=seed,
            progress=progress,
            tag=f"tune traces ({kind})",
        )
        ranked[kind] = replay_ranking(traces, profile)
    total = sum(min(confirm_top, len(r)) for r in ranked.values()) * len(encoded)
    with tqdm(total=total, desc="confirm static grid live", disable=not progress) as bar:
        for kind in kinds:
            confirmed = confirm_live(
                engine, ranked[kind][:confirm_top], widths[kind], encoded, max_new_tokens, seed, bar
            )
            best = confirmed_best(confirmed)
            out[kind] = {
                "width": widths[kind],
                "replay_grid": ranked[kind],
                "confirmed": confirmed,
                "best": {"depth": best["depth"], "verify": best["verify"], "tree_width": widths[kind]},
                "tune_prompts": [pid for pid, _ in encoded],
                "max_new_tokens": max_new_tokens,
            }
    return out
