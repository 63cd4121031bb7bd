"""Exactness audit: does speculative decoding keep the target's output law?

* Greedy: speculative tokens == autoregressive tokens, prompt by prompt (first divergence reported).
* Sampled, end to end: a two-sample test between speculative and autoregressive outputs. Each arm draws
  many requests with *different* seeds; the outcome is the joint value of the first k emitted tokens; a
  chi-square test of homogeneity on the 2 x C table (categories with expected count < 5 pooled into one
  "other" bin) per prompt, combined over prompts with Fisher's method.
* Sampler laws: a Monte Carlo of ``engine.sampling.verify_chain`` against the exact target law on small
  random distributions, with a chi-square goodness of fit and an absolute total-variation bound (the
  engine's law tests), plus the article's wrong rule (resample from the target) as a negative control.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np
import torch
from scipy import stats
from tqdm.auto import tqdm

from engine.engine import SpeculativeEngine
from engine.sampling import SamplingConfig, verify_chain

P_FLOOR = 1e-3
"""A law check (or a homogeneity test) below this p-value counts as a disagreement."""


# ------------------------------------------------------------------------------------------------ greedy
def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_audit(tokens: Mapping[str, Mapping[str, Sequence[int]]], baseline: str = "autoregressive") -> dict:
    """controller -> prompt id -> tokens in; per controller: prompts, identical, match_rate, divergences."""
    ref = tokens[baseline]
    out = {}
    for name, by_prompt in tokens.items():
        if name == baseline:
            continue
        divergences = []
        for pid, toks in by_prompt.items():
            pos = first_divergence(toks, ref[pid])
            if pos is not None:
                divergences.append(
                    {"prompt_id": pid, "position": pos, "tokens": len(toks), "reference": len(ref[pid])}
                )
        n = len(by_prompt)
        out[name] = {
            "prompts": n,
            "identical": n - len(divergences),
            "match_rate": (n - len(divergences)) / n if n else float("nan"),
            "divergences": divergences,
        }
    return out


# ----------------------------------------------------------------------------------------- two-sample test
def homogeneity_test(sample_a: Sequence[Hashable], sample_b: Sequence[Hashable]) -> dict:
    """Chi-square test of homogeneity of two samples of categorical outcomes (2 x C contingency table;
    categories whose smallest expected cell count is < 5 are pooled into one "other" bin, which is merged
    into the smallest kept category if it is still too small)."""
    count_a, count_b = Counter(sample_a), Counter(sample_b)
    n_a, n_b = len(sample_a), len(sample_b)
    if not n_a or not n_b:
        raise ValueError("both samples need at least one outcome")
    smaller, n = min(n_a, n_b), n_a + n_b
    cats = sorted(set(count_a) | set(count_b), key=lambda c: (-(count_a[c] + count_b[c]), repr(c)))
    keep = [c for c in cats if smaller * (count_a[c] + count_b[c]) / n >= 5]
    pooled = [c for c in cats if c not in keep]
    columns = [[count_a[c], count_b[c]] for c in keep]
    if pooled:
        other = [sum(count_a[c] for c in pooled), sum(count_b[c] for c in pooled)]
        if smaller * sum(other) / n >= 5 or not columns:
            columns.append(other)
        else:
            columns[-1] = [columns[-1][0] + other[0], columns[-1][1] + other[1]]
    result = {
        "test": "chi-square test of homogeneity (2 x C, expected < 5 pooled)",
        "n_a": n_a,
        "n_b": n_b,
        "categories": len(cats),
        "cells": len(columns),
        "pooled_categories": len(pooled),
    }
    if len(columns) < 2:  # one outcome only: nothing to compare
        return {**result, "statistic": 0.0, "dof": 0, "pvalue": 1.0}
    table = np.asarray(columns, dtype=np.float64).T  # [2, C]
    statistic, pvalue, dof, _ = stats.chi2_contingency(table, correction=False)
    return {**result, "statistic": float(statistic), "dof": int(dof), "pvalue": float(pvalue)}


def fisher_combined(pvalues: Sequence[float]) -> float:
    """Fisher's combined p-value of independent tests."""
    if len(pvalues) == 1:
        return float(pvalues[0])
    return float(stats.combine_pvalues(np.clip(pvalues, 1e-300, 1.0), method="fisher").pvalue)


def sampled_test(
    pair,
    controller_factory: Callable[[], object],
    prompts: Sequence[dict],
    *,
    temperature: float,
    samples: int,
    k: int,
    budget: int | None = None,
    seed: int = 0,
    progress: bool = False,
    engine_config=None,
) -> dict:
    """Two-sample test of the first ``k`` emitted tokens: autoregressive vs ``controller_factory()`` on our
    engine at ``temperature``, ``samples`` requests per arm and prompt, every request with its own seed.
    The speculative arm generates ``budget`` tokens (default k; more lets it draft deeper)."""
    engine = SpeculativeEngine(pair, SamplingConfig(temperature=temperature), engine_config)
    controller = controller_factory()
    per_prompt = []
    bar = tqdm(total=2 * samples * len(prompts), desc="sampled exactness", disable=not progress, leave=False)
    for index, item in enumerate(prompts):
        ids = pair.encode(item["prompt"])
        base = 10_000_000 * (seed + 1) + 100_000 * index  # distinct seeds: AR even, speculative odd offsets
        arms: dict[str, list[tuple]] = {"autoregressive": [], "speculative": []}
        spec_cycles = drafting_cycles = 0
        for i in range(samples):
            for arm, ctrl, offset, n in (
                ("autoregressive", None, 0, k),
                ("speculative", controller, 1, budget or k),
            ):
                res = engine.generate(ids, max_new_tokens=n, controller=ctrl, seed=base + 2 * i + offset)
                arms[arm].append(tuple(res.tokens[:k]))
                if ctrl is not None:  # how much speculation the test exercised on this prompt
                    spec_cycles += len(res.cycles)
                    drafting_cycles += sum(c.num_drafted > 0 for c in res.cycles)
                bar.update()
        test = homogeneity_test(arms["autoregressive"], arms["speculative"])
        top = Counter(arms["autoregressive"]).most_common(1)[0]
        per_prompt.append(
            {
                "prompt_id": item["id"],
                "language": item.get("language", "unknown"),
                **test,
                "drafting_cycles": drafting_cycles,
                "speculative_cycles": spec_cycles,
                "most_common": {
                    "outcome": list(top[0]),
                    "count_autoregressive": top[1],
                    "count_speculative": arms["speculative"].count(top[0]),
                },
            }
        )
    bar.close()
    pvalues = [r["pvalue"] for r in per_prompt]
    combined = fisher_combined(pvalues)
    return {
        "controller": repr(controller),
        "temperature": temperature,
        "k": k,
        "samples_per_arm": samples,
        "speculative_budget": budget or k,
        "prompts": per_prompt,
        "fisher_pvalue": combined,
        "rejects": combined < P_FLOOR,
    }


# ---------------------------------------------------------------------------------------- sampler laws
def tv_bound(exact: Mapping[Hashable, float], num_samples: int, failure_prob: float = 1e-6) -> float:
    """TV a correct sampler stays below with probability >= 1 - failure_prob: E[TV] <= sum_i sd_i / 2
    (Jensen) plus McDiarmid's deviation (TV moves by at most 1/N per sample)."""
    mean_bound = 0.5 * sum(math.sqrt(p * (1 - p) / num_samples) for p in exact.values())
    return mean_bound + math.sqrt(math.log(1 / failure_prob) / (2 * num_samples))


def check_law(samples: Sequence[Hashable], exact: Mapping[Hashable, float]) -> dict:
    """Goodness of fit of samples to an exact law: chi-square (cells with expected < 5 pooled) and TV."""
    exact = {key: float(p) for key, p in exact.items() if p > 0}
    counts, num = Counter(samples), len(samples)
    impossible = tuple(sorted((key for key in counts if key not in exact), key=repr))
    tv = 0.5 * sum(abs(counts.get(key, 0) / num - exact.get(key, 0.0)) for key in set(exact) | set(counts))
    # chi-square needs expected counts >= 5: keep those cells, pool the rest into one bin (merged into the
    # smallest kept cell if the pool itself is still too small)
    big = sorted((key for key in exact if exact[key] * num >= 5), key=lambda key: exact[key])
    small = [key for key in exact if exact[key] * num < 5]
    observed = [counts.get(key, 0) for key in big]
    expected = [exact[key] * num for key in big]
    if small:
        observed.append(sum(counts.get(key, 0) for key in small))
        expected.append(sum(exact[key] for key in small) * num)
        if expected[-1] < 5 and len(expected) > 1:
            observed[0] += observed.pop()
            expected[0] += expected.pop()
    if impossible or len(expected) < 2:
        pvalue = 0.0 if impossible else 1.0
    else:
        pvalue = float(stats.chisquare(observed, np.asarray(expected) * sum(observed) / sum(expected)).pvalue)
    bound = tv_bound(exact, num)
    return {
        "trials": num,
        "pvalue": pvalue,
        "tv": float(tv),
        "tv_bound": float(bound),
        "impossible": len(impossible),
        "impossible_outcomes": impossible,
        "agrees": pvalue > P_FLOOR and tv < bound and not impossible,
    }


def verify_chain_resample_from_target(target_probs, draft_probs, draft_tokens, generator):
    """Negative control: the article's WRONG rule (on rejection, draw from the target, not the residual)."""
    idx = torch.arange(draft_tokens.shape[0])
    u = torch.rand(draft_tokens.shape[0], generator=generator, dtype=torch.float64)
    rejected = (
        u * draft_probs[idx, draft_tokens].double() >= target_probs[idx, draft_tokens].double()
    ).tolist()
    for i, rej in enumerate(rejected):
        if rej:
            return i, int(torch.multinomial(target_probs[i], 1, generator=generator))
    return len(rejected), int(torch.multinomial(target_probs[len(rejected)], 1, generator=generator))


def _random_rows(rng: np.random.Generator, shape: tuple, vocab: int, zeros: int) -> torch.Tensor:
    probs = rng.dirichlet(np.full(vocab, 0.8), size=shape)
    for idx in np.ndindex(*shape):
        probs[idx][rng.choice(vocab, zeros, replace=False)] = 0.0
        probs[idx] /= probs[idx].sum()
    return torch.from_numpy(probs)


def _two_tokens(verify, target_table, draft_table, num_draft, generator) -> tuple[int, int]:
    """Chain speculative decoding over a toy context-dependent "model" until two tokens are emitted."""
    emitted, prev = [], 0
    while len(emitted) < 2:
        pos, ctx = len(emitted), prev
        target_rows, draft_rows, drafts = [target_table[pos, ctx]], [], []
        for i in range(num_draft):
            draft_rows.append(draft_table[pos + i, ctx])
            ctx = int(torch.multinomial(draft_rows[-1], 1, generator=generator))
            drafts.append(ctx)
            target_rows.append(target_table[pos + i + 1, ctx])
        accepted, nxt = verify(
            torch.stack(target_rows), torch.stack(draft_rows), torch.tensor(drafts), generator
        )
        emitted += drafts[:accepted] + [nxt]
        prev = emitted[-1]
    return emitted[0], emitted[1]


LAW_CASES = (
    ("article example, 1 draft", 0, 1),
    ("random tables, 3 drafts", 1, 3),
    ("draft misses target tokens, 3 drafts", 2, 3),
    ("draft == target, 3 drafts", 3, 3),
)


def law_checks(trials: int, seed: int = 0, vocab: int = 5) -> list[dict]:
    """``verify_chain`` against exact laws (two emitted tokens of a toy Markov target), plus the wrong rule
    on the first two cases, which must be flagged."""
    out = []
    for name, case, num_draft in LAW_CASES:
        rng = np.random.default_rng([seed, case])
        positions = num_draft + 2
        if case == 0:  # the article's p = (0.5, 0.3, 0.2), q = (0.2, 0.5, 0.3) at every position
            target = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).expand(positions, 3, 3).clone()
            draft = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64).expand(positions, 3, 3).clone()
        else:
            target = _random_rows(rng, (positions, vocab), vocab, 1)
            draft = (
                target.clone()
                if case == 3
                else _random_rows(rng, (positions, vocab), vocab, 3 if case == 2 else 1)
            )
        size = target.shape[-1]
        exact = {(a, b): float(target[0, 0, a] * target[1, a, b]) for a in range(size) for b in range(size)}
        rules = [("verify_chain", verify_chain, True)]
        if case in (0, 1):
            rules.append(("wrong: resample from target", verify_chain_resample_from_target, False))
        for rule, verify, should_agree in rules:
            generator = torch.Generator().manual_seed(seed * 1000 + case)
            samples = [_two_tokens(verify, target, draft, num_draft, generator) for _ in range(trials)]
            check = check_law(samples, exact)
            out.append(
                {
                    "case": name,
                    "rule": rule,
                    "expected": "agree" if should_agree else "disagree",
                    **check,
                    "ok": check["agrees"] == should_agree,
                }
            )
    return out
