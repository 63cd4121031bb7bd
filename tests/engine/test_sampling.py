"""The exact sampler as pure functions: the article's mass accounting, Monte Carlo laws of ``verify_chain``
and ``verify_tree`` against exact enumeration (with wrong rules as negative controls), logits processing
and ``SamplingConfig`` validation."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from engine.sampling import (
    MIN_TEMPERATURE,
    SamplingConfig,
    logits_to_probs,
    make_target_drawer,
    verify_chain,
    verify_tree,
)

pytestmark = pytest.mark.usefixtures("single_thread")

# The article's example (section 2) in its own letters: p is the target, q the draft, symbols A, B, C.
ARTICLE_TARGET = (0.5, 0.3, 0.2)  # p
ARTICLE_DRAFT = (0.2, 0.5, 0.3)  # q
ARTICLE_WRONG_LAW = (0.35, 0.39, 0.26)
NUM_CHAIN_TRIALS = 100_000


# ------------------------------------------------------------------------ reference laws (plain numpy)
def one_token_law(target_probs: np.ndarray, draft_probs: np.ndarray, wrong: bool = False) -> np.ndarray:
    """Exact law of the token emitted by one-draft-token chain verification (Leviathan's rule); ``wrong``:
    the article's counterexample, which draws from the target instead of the residual on rejection."""
    accepted = np.minimum(target_probs, draft_probs)  # mass emitted by accepting the draft
    rejection = 1.0 - accepted.sum()
    if wrong:
        return accepted + rejection * target_probs
    if rejection <= 0.0:  # draft == target: nothing is ever rejected, the residual is never formed
        return accepted
    residual = np.maximum(target_probs - draft_probs, 0.0)
    return accepted + rejection * residual / residual.sum()


def verify_chain_resample_from_target(target_probs, draft_probs, draft_tokens, generator):
    """Negative control: ``verify_chain`` with the WRONG recovery rule (resample from the target)."""
    num_draft_tokens = draft_tokens.shape[0]
    idx = torch.arange(num_draft_tokens)
    target_tok = target_probs[idx, draft_tokens].double()
    draft_tok = draft_probs[idx, draft_tokens].double()
    u = torch.rand(num_draft_tokens, generator=generator, dtype=torch.float64)
    for i, rejected in enumerate((u * draft_tok >= target_tok).tolist()):
        if rejected:
            return i, int(torch.multinomial(target_probs[i], 1, generator=generator))
    return num_draft_tokens, int(torch.multinomial(target_probs[num_draft_tokens], 1, generator=generator))


# ------------------------------------------------------------------------------------ article example
def test_article_example_exact_mass_accounting():
    target_probs, draft_probs = np.array(ARTICLE_TARGET), np.array(ARTICLE_DRAFT)
    np.testing.assert_allclose(one_token_law(target_probs, draft_probs), ARTICLE_TARGET, rtol=0, atol=1e-12)
    wrong = one_token_law(target_probs, draft_probs, wrong=True)
    np.testing.assert_allclose(wrong, ARTICLE_WRONG_LAW, rtol=0, atol=1e-12)
    np.testing.assert_allclose(one_token_law(target_probs, target_probs), target_probs, rtol=0, atol=1e-12)


def sample_one_token_chain(verify, target_row, draft_row, num_trials, seed) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    target_probs = torch.stack([target_row, target_row])  # [K+1, V], K = 1
    draft_probs = draft_row[None]  # [K, V]
    draft_tokens = torch.multinomial(draft_row, num_trials, replacement=True, generator=generator)
    emitted = []
    for draft_token in draft_tokens.view(-1, 1):  # one K=1 verification per trial
        num_accepted, next_token = verify(target_probs, draft_probs, draft_token, generator)
        emitted.append(int(draft_token) if num_accepted else next_token)
    return emitted


@pytest.mark.parametrize(
    "verify, law, agrees",
    [(verify_chain, ARTICLE_TARGET, True), (verify_chain_resample_from_target, ARTICLE_WRONG_LAW, False)],
    ids=["verify_chain", "wrong_rule"],
)
def test_article_example_monte_carlo(law_check, verify, law, agrees):
    target_row = torch.tensor(ARTICLE_TARGET, dtype=torch.float64)
    draft_row = torch.tensor(ARTICLE_DRAFT, dtype=torch.float64)
    emitted = sample_one_token_chain(verify, target_row, draft_row, NUM_CHAIN_TRIALS, seed=20260923)
    result = law_check(emitted, dict(enumerate(ARTICLE_TARGET)))
    assert result.tv_bound < 0.011  # 0.0105 at N = 100k: the article's bias (TV 0.15) is 14x that
    if agrees:
        assert result.agrees, result
    else:
        assert result.pvalue < 1e-6 and result.tv > result.tv_bound, result
        # and the wrong rule converges to the article's wrong law, not to the target
        assert law_check(emitted, dict(enumerate(law))).agrees


# ---------------------------------------------------------------- multi-token chains (Markov "models")
VOCAB = 5
START = 0


def random_rows(rng: np.random.Generator, shape, zeros_per_row: int = 0) -> torch.Tensor:
    """Random distributions over VOCAB with ``zeros_per_row`` entries forced to zero in every row."""
    probs = rng.dirichlet(np.full(VOCAB, 0.8), size=shape)
    for idx in np.ndindex(*shape):
        probs[idx][rng.choice(VOCAB, zeros_per_row, replace=False)] = 0.0
        probs[idx] /= probs[idx].sum()
    return torch.from_numpy(probs)


def chain_tables(case: str, num_positions: int):
    """target_table[pos, prev] and draft_table[pos, prev]: next-token laws given the previous token."""
    rng = np.random.default_rng(["generic", "draft_is_target", "draft_zeros"].index(case))
    target_table = random_rows(rng, (num_positions, VOCAB), zeros_per_row=1)  # like top-k truncation
    if case == "draft_is_target":
        return target_table, target_table.clone()
    draft_zeros = 3 if case == "draft_zeros" else 1  # draft misses tokens the target allows
    return target_table, random_rows(rng, (num_positions, VOCAB), zeros_per_row=draft_zeros)


def decode_two_tokens(verify, target_table, draft_table, num_draft_tokens, generator, accepted_counts):
    """Chain speculative decoding with a context-dependent target until two tokens are emitted."""
    emitted, prev = [], START
    while len(emitted) < 2:
        pos, ctx = len(emitted), prev
        target_rows, draft_rows, draft_tokens = [target_table[pos, ctx]], [], []
        for i in range(num_draft_tokens):
            draft_rows.append(draft_table[pos + i, ctx])
            ctx = int(torch.multinomial(draft_rows[-1], 1, generator=generator))
            draft_tokens.append(ctx)
            target_rows.append(target_table[pos + i + 1, ctx])  # the target row after this draft
        num_accepted, next_token = verify(
            torch.stack(target_rows), torch.stack(draft_rows), torch.tensor(draft_tokens), generator
        )
        assert 0 <= next_token < VOCAB  # a NaN residual would break multinomial or give garbage
        accepted_counts.append(num_accepted)
        emitted += draft_tokens[:num_accepted] + [next_token]
        prev = emitted[-1]
    return tuple(emitted[:2])


def two_token_law(target_table) -> dict:
    first = target_table[0, START].numpy()
    return {(a, b): first[a] * target_table[1, a, b].item() for a in range(VOCAB) for b in range(VOCAB)}


WRONG = verify_chain_resample_from_target
CHAIN_RUNS = [
    (verify_chain, "generic", 3),
    (verify_chain, "draft_zeros", 3),
    (verify_chain, "draft_is_target", 3),
    (verify_chain, "draft_is_target", 1),
    (verify_chain, "generic", 1),
    (WRONG, "generic", 3),
    (WRONG, "generic", 1),
]


@pytest.mark.parametrize(
    "verify, case, num_draft_tokens",
    CHAIN_RUNS,
    ids=[f"{'ok' if v is verify_chain else 'wrong'}-{c}-K{k}" for v, c, k in CHAIN_RUNS],
)
def test_chain_two_token_law(law_check, verify, case, num_draft_tokens):
    target_table, draft_table = chain_tables(case, num_positions=num_draft_tokens + 2)
    if case != "draft_is_target":  # the edge cases this table must contain
        assert ((target_table == 0) & (draft_table > 0)).any()  # drafts the target forbids
        assert ((draft_table == 0) & (target_table > 0)).any()  # tokens only the residual can give
    generator = torch.Generator().manual_seed(7)
    accepted: list[int] = []
    samples = [
        decode_two_tokens(verify, target_table, draft_table, num_draft_tokens, generator, accepted)
        for _ in range(8_000)
    ]
    result = law_check(samples, two_token_law(target_table))
    if verify is not verify_chain:
        assert result.pvalue < 1e-6, result
        return
    assert result.agrees, result
    if (
        case == "draft_is_target"
    ):  # draft == target: every draft accepted (the residual is never formed), bonus taken
        assert set(accepted) == {num_draft_tokens}
    else:
        assert 0 < np.mean(accepted) < num_draft_tokens


def test_chain_edge_cases():
    generator = torch.Generator().manual_seed(0)
    # no drafts: a plain target draw from row 0 (target_probs is [K+1, V] with K = 0)
    no_drafts = verify_chain(
        torch.tensor([[0.0, 1.0, 0.0]]), torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), generator
    )
    assert no_drafts == (0, 1)
    # a draft the target gives no mass is always rejected, and recovered from the target's own tokens
    target_probs = torch.tensor([[0.0, 0.6, 0.4], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    draft_probs = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    for _ in range(200):
        num_accepted, next_token = verify_chain(target_probs, draft_probs, torch.tensor([0]), generator)
        assert num_accepted == 0 and next_token in (1, 2)


# ------------------------------------------------------------------------ tree verification (one-hot)
# A hand-built tree over VOCAB: node i has token TREE_TOKENS[i] and parent TREE_PARENTS[i] (-1 = root).
TREE_TOKENS = [0, 1, 2, 1, 3, 0, 4]
TREE_PARENTS = [-1, -1, -1, 0, 0, 1, 3]


@functools.cache
def context_law(context: tuple[int, ...]) -> torch.Tensor:
    """A toy target: the next-token law is a fixed random function of the whole context."""
    rng = np.random.default_rng([11, len(context), *context])
    return random_rows(rng, (1,), zeros_per_row=1)[0]


def tree_rows(context: tuple[int, ...]) -> list[torch.Tensor]:
    """Row 0: the target law at the root; row i+1: the law after node i's path (what a verify pass sees)."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(TREE_TOKENS, TREE_PARENTS):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return [context_law(context)] + [context_law(context + path) for path in paths]


def engine_tree_walk(rows, generator):
    def draw_target(row: int) -> int:
        return int(torch.multinomial(rows[row], 1, generator=generator))

    return verify_tree(TREE_TOKENS, TREE_PARENTS, draw_target)


def wrong_tree_walk(rows, generator):
    """Negative control: try the children in order, accepting each with its UNMODIFIED target probability,
    and when all are rejected draw from the unmodified target (children not excluded). Over-emits children."""
    path, node = [], -1
    while True:
        target_probs = rows[node + 1]
        children = [i for i, parent in enumerate(TREE_PARENTS) if parent == node]
        accepted = next(
            (
                c
                for c in children
                if float(torch.rand(1, generator=generator)) < float(target_probs[TREE_TOKENS[c]])
            ),
            None,
        )
        if accepted is None:
            return path, int(torch.multinomial(target_probs, 1, generator=generator))
        path.append(accepted)
        node = accepted


def decode_two_tokens_tree(walk, generator) -> tuple[int, int]:
    emitted: list[int] = []
    while len(emitted) < 2:
        path, next_token = walk(tree_rows(tuple(emitted)), generator)
        emitted += [TREE_TOKENS[i] for i in path] + [next_token]
    return tuple(emitted[:2])


@pytest.mark.parametrize(
    "walk, agrees", [(engine_tree_walk, True), (wrong_tree_walk, False)], ids=["verify_tree", "wrong_walk"]
)
def test_tree_two_token_law(law_check, walk, agrees):
    first = context_law(())
    exact = {(a, b): float(first[a] * context_law((a,))[b]) for a in range(VOCAB) for b in range(VOCAB)}
    generator = torch.Generator().manual_seed(3)
    result = law_check([decode_two_tokens_tree(walk, generator) for _ in range(12_000)], exact)
    if agrees:
        assert result.agrees, result
    else:
        assert result.pvalue < 1e-6, result


def test_tree_greedy_walk_is_the_longest_matching_path():
    # node tokens/parents: 0:[5] 1:[6] <- root; 2:[7] <- 0; 3:[8] <- 2; 4:[9] <- 1
    tokens, parents = [5, 6, 7, 8, 9], [-1, -1, 0, 2, 1]
    argmax_rows = [5, 7, 1, 8, 4, 3]  # row 0 = root, row i+1 = node i
    assert verify_tree(tokens, parents, argmax_rows.__getitem__) == ([0, 2, 3], 4)  # ends on a leaf: bonus
    argmax_rows[0] = 6
    assert verify_tree(tokens, parents, argmax_rows.__getitem__) == ([1], 1)  # leaves the tree at node 1
    assert verify_tree([], [], [42].__getitem__) == ([], 42)


# ------------------------------------------------------------------------------------ logits processing
def reference_probs(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Plain float64 reference: temperature, then top-k, then the smallest top-p prefix, then softmax."""
    scaled = logits / cfg.temperature
    order = np.argsort(-scaled, kind="stable")
    kept = order[: cfg.top_k] if cfg.top_k else order
    sorted_probs = np.exp(scaled[kept] - scaled[kept].max())
    sorted_probs /= sorted_probs.sum()
    mass_before = np.cumsum(sorted_probs) - sorted_probs
    kept = kept[mass_before < cfg.top_p]  # keep until the prefix mass reaches top_p
    out = np.zeros_like(scaled)
    out[kept] = np.exp(scaled[kept] - scaled[kept].max())
    return out / out.sum()


def test_greedy_is_one_hot_with_first_index_tie_break():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("top_k", [1, 3, 7, 50])
def test_top_k_keeps_exactly_k(top_k):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(top_k), dtype=torch.float64)
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=top_k))
    assert ((probs > 0).sum(-1) == top_k).all()
    expected = set(torch.topk(logits[0], top_k).indices.tolist())
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == expected


def test_top_p_keeps_the_smallest_prefix_reaching_top_p():
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()  # softmax at temperature 1 gives these back

    def support(top_p: float) -> list[int]:
        return torch.nonzero(logits_to_probs(logits, SamplingConfig(1.0, 0, top_p))).flatten().tolist()

    assert support(0.01) == [0]  # the top token always stays
    assert support(0.45) == [0]
    assert support(0.55) == [0, 1]
    assert support(0.85) == [0, 1, 2]
    assert support(0.95) == [0, 1, 2, 3]
    probs = logits_to_probs(logits, SamplingConfig(1.0, 0, 0.55))
    np.testing.assert_allclose(probs.numpy(), [2 / 3, 1 / 3, 0, 0], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (0.7, 8, 0.9), (1.3, 0, 0.6), (1.0, 20, 0.3)],
)
def test_matches_reference(temperature, top_k, top_p):
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = 3 * torch.randn(6, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    probs = logits_to_probs(logits, cfg)
    assert probs.shape == logits.shape
    np.testing.assert_allclose(probs.sum(-1).numpy(), 1.0, rtol=0, atol=1e-6)
    for row, got in zip(logits.numpy(), probs.numpy()):
        np.testing.assert_allclose(got, reference_probs(row, cfg), rtol=0, atol=1e-6)
    if top_k == 0 and top_p == 1.0:  # pure temperature: a manual softmax
        manual = torch.softmax(logits / temperature, dim=-1)
        np.testing.assert_allclose(probs.numpy(), manual.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"temperature": "1"},
        {"top_k": -1},
        {"top_k": 1.5},
        {"top_k": True},
        {"top_k": "3"},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.01},
        {"top_p": math.nan},
    ],
)
def test_sampling_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_sampling_config_accepts_edges():
    assert SamplingConfig().greedy
    assert not SamplingConfig(temperature=1e-3, top_k=1, top_p=1.0).greedy
    SamplingConfig(temperature=5, top_k=0, top_p=1e-9)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-12, MIN_TEMPERATURE / 2])
def test_a_temperature_below_the_threshold_is_greedy(temperature):
    """The config stores 0, so every sampler sees greedy (dividing float32 logits by 1e-40 overflows: the
    negative control shows the raw division would give NaN probabilities)."""
    cfg = SamplingConfig(temperature=temperature, top_k=5, top_p=0.9)
    assert cfg.greedy and cfg.temperature == 0.0
    logits = torch.tensor([[1.0, 3.0, 2.0, -4.0]])
    assert logits_to_probs(logits, cfg).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert make_target_drawer(logits, cfg, None)(0) == 1
    if temperature == 1e-40:  # the raw division overflows to inf, and softmax gives NaN
        assert torch.isnan((logits / temperature).softmax(-1)).any()


def test_the_threshold_itself_samples_a_finite_law():
    cfg = SamplingConfig(temperature=MIN_TEMPERATURE)
    assert not cfg.greedy and cfg.temperature == MIN_TEMPERATURE
    logits = 30 * torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, cfg)
    assert torch.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(-1).numpy(), 1.0, rtol=0, atol=1e-6)
