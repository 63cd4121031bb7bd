"""The cost profile: measurement plumbing on the tiny pair, interpolation and composition on hand-built
profiles, persistence, and the random-weights architecture builder. No wall-clock thresholds: timing on a
shared machine is noise."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.backends.models import load_pair
from engine.backends.random_pair import build_random_pair, parameter_count, random_pair_configs
from engine.control import StaticController
from engine.costs.cost_profile import CostProfile, spread_to_sigma
from engine.costs.measure_costs import build_parser, main, measure_profile
from engine.costs.profile_config import ProfileConfig
from engine.costs.profile_io import PROFILE_VERSION, ProfileError
from engine.costs.speedup_model import cycle_time, empirical_c, empirical_g
from engine.engine import SpeculativeEngine
from engine.errors import InputError

SMALL = ProfileConfig(
    contexts=(32, 96),
    widths=(1, 2),
    chunks=(1, 3),
    sizes=(0, 2, 5),
    reps=2,
    warmup=0,
    prefill_reps=2,
    overhead_cycles=2,
    overhead_prompt_len=8,
)


def hand_profile(**overrides) -> CostProfile:
    """Times linear in everything: draft 1 + W + ctx/100 ms, verify 10 + V + ctx/10 ms (exact to test)."""
    contexts, widths, sizes, chunks = [100, 300], [1, 2, 4], [0, 1, 4, 8], [1, 2]
    args = dict(
        contexts=contexts,
        widths=widths,
        sizes=sizes,
        chunks=chunks,
        draft_step_table=[[1e-3 * (1 + w + c / 100) for c in contexts] for w in widths],
        verify_table=[[1e-3 * (10 + v + c / 10) for c in contexts] for v in sizes],
        draft_chunk_table=[[1e-3 * (2 + p + c / 100) for c in contexts] for p in chunks],
        prefill_lengths=[100, 300],
        prefill_target_s=[0.1, 0.3],
        prefill_draft_s=[0.05, 0.15],
        overhead_base_s=1e-4,
        overhead_per_node_s=1e-5,
        overhead_per_draft_row_s=2e-5,
        ar_overhead_s=5e-5,
        policy_call_s=3e-6,
        meta={"pair": "hand"},
    )
    args.update(overrides)
    return CostProfile(**args)


@pytest.fixture(scope="module")
def measured(tiny_pair_f32) -> CostProfile:
    return measure_profile(tiny_pair_f32, SMALL, progress=False)


# ---------------------------------------------------------------------------------------- measurement
def test_measured_profile_has_every_field_positive(measured):
    p = measured
    assert (p.contexts, p.widths, p.sizes, p.chunks) == ([32, 96], [1, 2], [0, 2, 5], [1, 3])
    for table, rows in (
        (p.draft_step_table, 2),
        (p.verify_table, 3),
        (p.draft_chunk_table, 2),
        (p.verify_chain_table, 3),
    ):
        arr = np.asarray(table)
        assert arr.shape == (rows, 2) and np.all(arr > 0) and np.all(np.isfinite(arr))
    for spread in (p.draft_step_spread, p.verify_spread, p.draft_chunk_spread):
        assert np.all(np.asarray(spread) >= 0)
    assert all(t > 0 for t in p.prefill_target_s + p.prefill_draft_s)
    assert p.overhead_base_s >= 0 and p.overhead_per_node_s >= 0 and p.overhead_per_draft_row_s >= 0
    assert p.overhead_s(4, depth=2, tree_width=2) > 0 and p.ar_overhead_s > 0 and p.policy_call_s > 0
    assert len(p.details["overhead_configs"]) >= 4
    assert all(c["cycles"] > 0 for c in p.details["overhead_configs"])
    meta = p.meta
    for key in ("device_name", "dtype", "pair", "torch", "transformers", "num_threads", "date", "config"):
        assert meta[key] not in (None, "")
    assert meta["pair"] == "tiny" and meta["dtype"] == "float32" and meta["random_weights"] is False


def test_measurement_leaves_the_global_rng_alone(tiny_pair_f32):
    state = torch.get_rng_state()
    measure_profile(
        tiny_pair_f32,
        ProfileConfig(
            contexts=(16,),
            widths=(1,),
            chunks=(1,),
            sizes=(0,),
            reps=1,
            warmup=0,
            prefill_reps=1,
            overhead_cycles=1,
            overhead_prompt_len=4,
        ),
        progress=False,
    )
    assert torch.equal(state, torch.get_rng_state())


def test_contexts_outside_the_pair_are_refused(tiny_pair_f32):
    with pytest.raises(ValueError, match="contexts"):
        measure_profile(tiny_pair_f32, ProfileConfig(contexts=(1000,), sizes=(0, 64)), progress=False)
    with pytest.raises(ValueError, match="contexts"):
        measure_profile(tiny_pair_f32, ProfileConfig(contexts=(2,), chunks=(1, 3)), progress=False)


def test_cli_quick_on_tiny_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "p.json"
    main(
        [
            "--pair",
            "tiny",
            "--quick",
            "--contexts",
            "16,48",
            "--sizes",
            "0,3",
            "--reps",
            "1",
            "--out",
            str(out),
        ]
    )
    loaded = CostProfile.load(out)
    assert loaded.contexts == [16, 48] and loaded.sizes == [0, 3] and loaded.widths == [1, 2]
    assert "verify vs verified nodes" in capsys.readouterr().out


def test_the_batch_axis_is_measured_on_request_and_round_trips(tiny_pair_f32, measured, tmp_path):
    assert measured.batched == {}  # off by default (training's profiles)
    with pytest.raises(ProfileError, match="--batch-axis"):
        measured.batched_forward_s("target", 2, 2)
    grid = replace(SMALL, batch_axis=True, batch_sequences=(1, 2, 4), batch_rows=(1, 3))
    profile = measure_profile(tiny_pair_f32, grid, progress=False)
    table = profile.batched
    assert table["context"] == 32  # the median context of (32, 96)
    for key in ("target", "draft"):
        entries = table[key]
        assert [(s, r) for s, r, _ in entries] == [(s, s * r) for s in (1, 2, 4) for r in (1, 3)]
        times = np.array([t for *_, t in entries])
        assert np.all(np.isfinite(times)) and np.all(times > 0)
        assert len(table[key + "_spread"]) == len(entries) and min(table[key + "_spread"]) >= 0
        for s, rows, t in entries:  # the grid points themselves
            assert profile.batched_forward_s(key, s, rows) == pytest.approx(t, rel=1e-12)
    assert "batched forwards at context 32" in profile.format_table()

    path = profile.save(tmp_path / "batched.json")
    loaded = CostProfile.load(path)
    assert loaded.batched == json.loads(json.dumps(profile.batched))
    assert loaded.batched_forward_s("draft", 2, 4) == profile.batched_forward_s("draft", 2, 4)
    data = json.loads(path.read_text())
    older = tmp_path / "older.json"  # a profile from before the batch axis loads as one without it
    older.write_text(json.dumps({k: v for k, v in data.items() if k != "batched"}))
    assert CostProfile.load(older).batched == {}
    for bad in (
        {"context": 0, "target": table["target"], "draft": table["draft"]},
        {**table, "target": table["target"][:-1]},  # not a full grid
        {**table, "draft": [[1, 1, -1.0]]},
        {**table, "draft": [[2, 3, 1e-3]]},  # rows not a multiple of the sequences
        {**table, "target_spread": [0.1]},
    ):
        older.write_text(json.dumps({**data, "batched": bad}))
        with pytest.raises(ProfileError, match="batched"):
            CostProfile.load(older)


def test_the_batch_axis_flags():
    args = build_parser().parse_args(
        ["--out", "x", "--batch-axis", "--batch-rows", "1,16", "--batch-context", "512"]
    )
    assert (args.batch_axis, args.batch_rows, args.batch_context) == (True, (1, 16), 512)
    assert ProfileConfig().batch_axis is False and ProfileConfig().batch_ctx == 512
    assert ProfileConfig(contexts=(64, 256), batch_context=256).batch_ctx == 256
    for bad, flag in (
        (dict(batch_context=100), "--batch-context"),
        (dict(batch_rows=(1, 66)), "--batch-rows"),
        (dict(batch_sequences=(2, 1)), "--batch-sequences"),
    ):
        with pytest.raises(InputError, match=flag):
            ProfileConfig(**bad)
    ProfileConfig(contexts=(1000,), sizes=(0, 4), batch_rows=(1, 64)).check_fits(1024, 272)  # axis off: fits
    with pytest.raises(InputError, match="contexts"):  # the rows must fit the pair's context
        ProfileConfig(contexts=(1000,), sizes=(0, 4), batch_axis=True, batch_rows=(1, 64)).check_fits(
            1024, 272
        )


# -------------------------------------------------------------------------------------- interpolation
def test_interpolation_is_exact_at_grid_points():
    p = hand_profile()
    for i, w in enumerate(p.widths):
        for j, c in enumerate(p.contexts):
            assert p.draft_step_s(w, c) == pytest.approx(p.draft_step_table[i][j], rel=1e-12)
    for i, v in enumerate(p.sizes):
        for j, c in enumerate(p.contexts):
            assert p.verify_s(v, c) == pytest.approx(p.verify_table[i][j], rel=1e-12)
    for i, n in enumerate(p.chunks):
        assert p.draft_chunk_s(n, 300) == pytest.approx(p.draft_chunk_table[i][1], rel=1e-12)


def test_interpolation_is_bilinear_between_points():
    p = hand_profile()  # the tables are linear, so bilinear interpolation reproduces the formula
    assert p.verify_s(6, 200) == pytest.approx(1e-3 * (10 + 6 + 20), rel=1e-12)
    assert p.verify_s(2.5, 150) == pytest.approx(1e-3 * (10 + 2.5 + 15), rel=1e-12)
    assert p.draft_step_s(3, 250) == pytest.approx(1e-3 * (1 + 3 + 2.5), rel=1e-12)
    assert p.prefill_s(200) == pytest.approx(0.2 + 0.1) and p.prefill_s(
        200, with_draft=False
    ) == pytest.approx(0.2)


def test_extrapolation_linear_above_clamped_below():
    p = hand_profile()
    assert p.verify_s(4, 500) == pytest.approx(1e-3 * (10 + 4 + 50), rel=1e-12)  # context: linear
    assert p.verify_s(16, 100) == pytest.approx(1e-3 * (10 + 16 + 10), rel=1e-12)  # nodes: linear above
    assert p.verify_s(-3, 100) == p.verify_s(0, 100)  # clamped below
    assert p.verify_s(4, 10) == p.verify_s(4, 100)
    assert p.draft_step_s(8, 100) == pytest.approx(1e-3 * (1 + 8 + 1), rel=1e-12)
    assert p.draft_chunk_s(9, 100) == pytest.approx(1e-3 * (2 + 9 + 1), rel=1e-12)
    # a noisy last segment that falls is not extrapolated downwards
    falling = hand_profile(verify_table=[[1e-3, 2e-3], [2e-3, 3e-3], [3e-3, 4e-3], [2.5e-3, 3.5e-3]])
    assert falling.verify_s(100, 100) == pytest.approx(2.5e-3)


def test_chunk_falls_back_to_width_table():
    p = hand_profile(chunks=[], draft_chunk_table=[])
    assert p.draft_chunk_s(2, 100) == p.draft_step_s(2, 100)


@pytest.mark.parametrize("chunked", [True, False])
def test_chunk_curve_is_every_chunk_time_bitwise(chunked):
    """The oracle's vectorised curve equals draft_chunk_s at every count (inside, between, above the grid),
    at contexts inside, between and outside the grid, with and without a chunk table."""
    p = hand_profile(
        draft_chunk_table=[[1e-3 * (2 + q + c / 100) + 1e-7 * q * q for c in [100, 300]] for q in [1, 2]]
    )
    if not chunked:
        p = hand_profile(chunks=[], draft_chunk_table=[])
    for ctx in (50, 100, 171, 300, 777):
        curve = p.draft_chunk_curve(40, ctx)
        assert curve.shape == (40,)
        assert [float(v) for v in curve] == [p.draft_chunk_s(q, ctx) for q in range(1, 41)]


# ---------------------------------------------------------------------------------------- composition
def test_cycle_is_the_sum_of_its_parts():
    p = hand_profile()
    depth, verified, ctx, width, pending = 4, 6, 200, 2, 2
    expected = (
        p.draft_chunk_s(pending, ctx)
        + (depth - 1) * p.draft_step_s(width, ctx)
        + p.verify_s(verified, ctx)
        + p.overhead_base_s
        + verified * p.overhead_per_node_s
        + (depth - 1) * width * p.overhead_per_draft_row_s
    )
    assert p.cycle_s(depth, verified, ctx, width, num_pending=pending) == pytest.approx(expected, rel=1e-12)
    assert sum(p.cycle_parts(depth, verified, ctx, width, pending).values()) == pytest.approx(
        expected, rel=1e-12
    )
    assert p.cycle_s(depth, verified, ctx, width, pending, controller_calls=5) == pytest.approx(
        expected + 5 * 3e-6
    )
    assert p.cycle_s(0, 0, ctx) == pytest.approx(p.verify_s(0, ctx) + p.ar_overhead_s)
    assert p.overhead_s(3) == pytest.approx(1e-4 + 3e-5) and p.overhead_s(3, depth=0) == p.ar_overhead_s
    assert cycle_time(p, depth, verified, ctx, width) == pytest.approx(
        p.cycle_s(depth, verified, ctx, width, 1)
    )


def test_article_ratios():
    p = hand_profile()
    assert empirical_c(p, 100) == pytest.approx(p.draft_step_s(1, 100) / p.verify_s(0, 100))
    assert empirical_g(p, 4, 100) == pytest.approx((10 + 4 + 10) / (10 + 0 + 10))


def test_sampled_cycles_follow_the_measured_spread():
    quiet = hand_profile()
    rng = np.random.default_rng(0)
    assert quiet.sample_cycle_s(3, 4, 200, 2, rng=rng) == pytest.approx(
        quiet.cycle_s(3, 4, 200, 2), rel=1e-12
    )
    spread = 0.2
    noisy = hand_profile(
        verify_spread=[[spread] * 2] * 4,
        draft_step_spread=[[spread] * 2] * 3,
        draft_chunk_spread=[[spread] * 2] * 2,
        overhead_spread=spread,
    )
    draws = np.array([noisy.sample_cycle_s(1, 0, 100, rng=rng) for _ in range(4000)])
    assert np.median(draws) == pytest.approx(noisy.cycle_s(1, 0, 100), rel=0.02)
    assert 0.05 < (np.percentile(draws, 75) - np.percentile(draws, 25)) / np.median(draws) < 0.2
    one = np.log([noisy.sample_cycle_s(0, 0, 100, rng=rng) / noisy.cycle_s(0, 0, 100) for _ in range(4000)])
    assert np.std(one) < spread_to_sigma(spread) * 1.1
    assert math.isclose(2 * math.sinh(0.6744897501960817 * spread_to_sigma(spread)), spread, rel_tol=1e-12)
    with pytest.raises(ValueError, match="Generator"):
        noisy.sample_cycle_s(1, 0, 100)


# ---------------------------------------------------------------------------------------- persistence
def test_save_load_round_trip(tmp_path, measured):
    for profile in (hand_profile(verify_spread=[[0.1, 0.2]] * 4), measured):
        path = profile.save(tmp_path / "sub" / "profile.json")
        loaded = CostProfile.load(path)
        assert loaded.to_dict() == json.loads(json.dumps(profile.to_dict()))
        assert loaded.cycle_s(3, 2, 50, 2) == profile.cycle_s(3, 2, 50, 2)


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m engine.costs.measure_costs"):
        CostProfile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="invalid JSON"):
        CostProfile.load(bad)
    data = hand_profile().to_dict()
    for change, message in (
        ({"version": PROFILE_VERSION + 1}, "version"),
        ({"verify_table": [[1.0]]}, "verify_table"),
        ({"contexts": [300, 100]}, "ascending"),
    ):
        bad.write_text(json.dumps({**data, **change}))
        with pytest.raises(ProfileError, match=message):
            CostProfile.load(bad)
    bad.write_text(json.dumps({k: v for k, v in data.items() if k != "sizes"}))
    with pytest.raises(ProfileError, match="missing"):
        CostProfile.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="not a cost profile"):
        CostProfile.load(bad)


# --------------------------------------------------------------------------------- random-weights pair
def test_qwen_configs_mirror_the_published_shapes():
    target, draft = random_pair_configs("qwen2.5-coder")
    assert (target.hidden_size, target.intermediate_size, target.num_hidden_layers) == (1536, 8960, 28)
    assert (target.num_attention_heads, target.num_key_value_heads, target.vocab_size) == (12, 2, 151936)
    assert (draft.hidden_size, draft.intermediate_size, draft.num_hidden_layers) == (896, 4864, 24)
    assert (draft.num_attention_heads, draft.num_key_value_heads, draft.vocab_size) == (14, 2, 151936)
    for cfg in (target, draft):
        assert cfg.max_position_embeddings == 32768 and not cfg.tie_word_embeddings
        assert cfg.rope_parameters["rope_theta"] == 1e6 and cfg.rms_norm_eps == pytest.approx(1e-6)
    # the converted checkpoints' parameter counts (draftpilot-converted.json)
    assert (parameter_count(target), parameter_count(draft)) == (1_777_088_000, 630_167_424)


def test_random_qwen_pair_on_meta_has_the_right_shapes():
    pair = load_pair("qwen2.5-coder", random_weights=True, device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in pair.target.parameters()) == 1_777_088_000
    assert sum(p.numel() for p in pair.draft.parameters()) == 630_167_424
    assert pair.dtype == torch.bfloat16 and pair.vocab_size == 151936 and 151645 in pair.eos_token_ids
    assert pair.max_context == 32768


def test_random_pair_small_override_runs_the_engine():
    small = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=511,
    )
    state = torch.get_rng_state()
    pair = build_random_pair("qwen2.5-coder", dtype=torch.float32, overrides=small, seed=1)
    again = build_random_pair("qwen2.5-coder", dtype=torch.float32, overrides=small, seed=1)
    assert torch.equal(state, torch.get_rng_state())  # seeded through its own generator
    assert torch.equal(pair.target.lm_head.weight, again.target.lm_head.weight)
    assert pair.target.lm_head.weight.shape == (512, 32) and pair.draft.lm_head.weight.shape == (512, 32)
    assert pair.target.model.rotary_emb.inv_freq.dtype == torch.float32
    res = SpeculativeEngine(pair).generate(
        [1, 2, 3], max_new_tokens=6, controller=StaticController(2, 2, tree_width=2)
    )
    assert len(res.tokens) == 6 or res.finish_reason == "eos"


def test_random_weights_needs_a_known_name():
    with pytest.raises(ValueError, match="pair name"):
        load_pair(target="a", draft="b", random_weights=True)
    with pytest.raises(ValueError, match="random-weights"):
        build_random_pair("nope", device="meta")


def test_chains_are_charged_from_the_chain_table_when_there_is_one():
    """The engine verifies chains causally (no tree mask): a separate, measured table; trees and profiles
    without that table use the tree table."""
    plain = hand_profile()
    chain_table = [[1e-3 * (5 + v + c / 10) for c in plain.contexts] for v in plain.sizes]
    with_chain = hand_profile(verify_chain_table=chain_table)
    assert with_chain.verify_s(4, 100, chain=True) == pytest.approx(1e-3 * (5 + 4 + 10))
    assert (
        with_chain.verify_s(4, 100)
        == pytest.approx(1e-3 * (10 + 4 + 10))
        == plain.verify_s(4, 100, chain=True)
    )
    # a chain cycle (width 1) uses the chain table; a tree cycle the tree table
    assert with_chain.cycle_s(3, 4, 100, tree_width=1) < with_chain.cycle_s(3, 4, 100, tree_width=2) - 4e-3
    with pytest.raises(ProfileError):
        hand_profile(verify_chain_table=chain_table[:2])


def test_published_types_match_the_published_files():
    """The block types of the published GGUF files (tensor counts as the files hold them: target 29 Q6_K and
    168 Q4_K linears; draft 13 Q8_0, 12 Q6_K, 12 Q4_K, 132 Q5_0 linears)."""
    from collections import Counter

    from engine.backends.random_pair import published_source_types

    target = Counter(published_source_types("qwen2.5-coder", "target", 28).values())
    draft = Counter(published_source_types("qwen2.5-coder", "draft", 24).values())
    assert target == {"Q6_K": 29, "Q4_K": 168}
    assert draft == {"Q8_0": 13, "Q6_K": 12, "Q4_K": 12, "Q5_0": 132}
    assert published_source_types("qwen2.5-coder", "target", 28)["lm_head"] == "Q6_K"
    assert published_source_types("elsewhere", "target", 28) is None


@pytest.mark.parametrize("role", ["target", "draft"])
def test_published_types_match_the_cached_files_module_by_module(role):
    """Against the GGUF files themselves where they are cached (a real-model run fetched them)."""
    from engine.backends.files import cache_dir
    from engine.backends.gguf import gguf_linears
    from engine.backends.random_pair import published_source_types
    from engine.backends.weights import DEFAULT_PAIRS

    spec = DEFAULT_PAIRS["qwen2.5-coder"][("target", "draft").index(role)]
    path = cache_dir() / "gguf" / spec.gguf_file
    if not path.is_file():
        pytest.skip(f"{path} is not cached")
    in_file = {lin.module: lin.qtype for lin in gguf_linears(path)}
    layers = 28 if role == "target" else 24
    assert published_source_types("qwen2.5-coder", role, layers) == in_file


def test_random_integer_weights_take_the_published_layout():
    """kquant from random floats: k6 exactly where the published target has Q6_K blocks, k4 elsewhere;
    kquant-strict k4 everywhere; without published types every linear is k6 (a float source)."""
    from engine.backends.models import _convert
    from engine.backends.random_pair import published_source_types

    small = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=2)
    small.update(num_key_value_heads=1, vocab_size=512, pad_token_id=0, bos_token_id=0, eos_token_id=511)
    types = published_source_types("qwen2.5-coder", "target", 3)
    kinds = {}
    for fmt, source in (("kquant", types), ("kquant-strict", types), ("kquant", None), ("int4", types)):
        pair = build_random_pair("qwen2.5-coder", dtype=torch.float32, overrides=small, seed=2)
        info = _convert(pair.target, fmt, source_types=source)
        kinds[fmt, source is None] = {module: entry["kind"] for module, entry in info.items()}
    mixed = kinds["kquant", False]
    wide = {"lm_head"} | {
        f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.v_proj", "mlp.down_proj")
    }
    assert {m for m, k in mixed.items() if k == "k6"} == wide  # layer 2 is not one of the Q6_K layers
    assert set(kinds["kquant-strict", False].values()) == {"k4"}
    assert set(kinds["kquant", True].values()) == {"k6"}
    # int4 as the published file converts: int4 where it has Q4_K blocks, int8 where Q6_K
    assert {m for m, k in kinds["int4", False].items() if k == "int8"} == wide
    assert {k for m, k in kinds["int4", False].items() if m not in wide} == {"int4"}


def test_the_step_overhead_is_the_batched_step_beyond_the_profile(tiny_pair_f32):
    """``measure_step_overhead``: a batched step of one autoregressive request outside its forward, less the
    profile's per-cycle overhead of such a step: positive and below the whole step, and 0 for a profile that
    charges more overhead than the step takes."""
    import dataclasses

    from engine.costs.measure_batch import measure_step_overhead
    from tests_helpers import batched_profile

    free = dataclasses.replace(batched_profile(), ar_overhead_s=0.0)
    step = measure_step_overhead(tiny_pair_f32, free, context=32, steps=6, reps=1)
    assert 0 < step < 0.5
    dear = dataclasses.replace(batched_profile(), ar_overhead_s=10.0)
    assert measure_step_overhead(tiny_pair_f32, dear, context=32, steps=6, reps=1) == 0.0


def test_profile_queries_equal_the_numpy_interpolation_bit_for_bit():
    """The queries read their tables through ``_Grid2`` (Python floats, for speed): every value, inside the
    grid, below it, above it (extrapolated and floored) and on its points, is the numpy ``_lerp2``'s exactly;
    a perturbed table (negative control) is not."""
    from engine.costs.cost_profile import _Grid2, _lerp2

    rng = np.random.default_rng(3)
    for shape in ((1, 1), (1, 4), (5, 1), (6, 4), (9, 3)):
        xs = np.cumsum(rng.uniform(0.5, 3.0, shape[0])).round(1)
        contexts = np.cumsum(rng.uniform(50, 900, shape[1])).round()
        table = rng.uniform(0.001, 0.5, shape)
        grid = _Grid2(xs, contexts, table)
        queries = [(x, c) for x in (*xs, xs[0] - 1, xs[-1] + 2.5, *rng.uniform(0, xs[-1] * 1.5, 12))
                   for c in (*contexts, 1, contexts[-1] * 3, *rng.uniform(1, contexts[-1] * 1.4, 6))]  # fmt: skip
        for extrapolate in (True, False):
            for x, c in queries:
                assert grid.at(x, c, extrapolate) == _lerp2(xs, contexts, table, x, c, extrapolate)
    bent = _Grid2(xs, contexts, table * (1 + 1e-12))
    assert any(bent.at(x, c) != _lerp2(xs, contexts, table, x, c) for x, c in queries)
