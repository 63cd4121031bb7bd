"""Helpers shared by tests in several folders (importable as ``tests_helpers``: pytest puts tests/ on the
path for its conftest)."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

from engine.engine import SpeculativeEngine


def one_error_line(capsys, *needles: str) -> str:
    """The captured stderr is exactly one ``error: ...`` line containing every needle."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def random_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K blocks with finite positive fp16 d / dmin (any other byte pattern is a valid block)."""
    rng = np.random.default_rng(seed)
    nb = rows * cols // 256
    blocks = rng.integers(0, 256, (nb, 144), dtype=np.uint8)
    blocks[:, 0:2] = (rng.random(nb) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(nb, 2)
    blocks[:, 2:4] = (rng.random(nb) * 0.01).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def random_q6_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K blocks (any bytes are a valid block once the fp16 d is finite)."""
    rng = np.random.default_rng(seed)
    nb = rows * cols // 256
    blocks = rng.integers(0, 256, (nb, 210), dtype=np.uint8)
    blocks[:, 208:210] = (rng.random(nb) * 0.001 + 1e-4).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def write_gguf(path, tensors) -> None:
    """A GGUF file holding ``tensors``: (name, data, GGMLQuantizationType) triples."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_greedy_identity(pair, prompts, controllers, max_new_tokens: int = 24, config=None) -> None:
    """Every controller's greedy output equals autoregressive decoding of the same pair, token for token
    (``config``: the controllers' ``EngineConfig``, e.g. with context lookup; the reference has none)."""
    engine = SpeculativeEngine(pair, config=config) if config is not None else SpeculativeEngine(pair)
    for prompt in prompts:
        ids = pair.encode(prompt)
        ar = SpeculativeEngine(pair).generate(ids, max_new_tokens=max_new_tokens)
        for controller in controllers:
            got = engine.generate(ids, max_new_tokens=max_new_tokens, controller=controller)
            assert got.tokens == ar.tokens, controller


def batched_profile(row_s: float = 0.006, draft_row_s: float = 0.002, batched: bool = True):
    """A ``CostProfile`` with a batch axis (``batched``; else without), linear everywhere: verification 30 ms +
    5 ms a node, a draft step 10 ms, prefills 1 ms a token (draft 0.3); batched forwards 25 ms + ``row_s`` a
    row (target) and 8 ms + ``draft_row_s`` a row (draft), whatever the sequences; context 512 for every
    table. Fixed numbers: what depends on it is the same at every run."""
    from engine.costs.cost_profile import CostProfile

    sizes = [0, 1, 2, 4, 8, 16, 64]
    table = {"context": 512, "target": [], "draft": [], "target_spread": [], "draft_spread": []}
    for s in (1, 2, 4, 8, 16):
        for r in (1, 2, 4, 8):
            table["target"].append([s, s * r, 0.025 + row_s * s * r])
            table["draft"].append([s, s * r, 0.008 + draft_row_s * s * r])
            table["target_spread"].append(0.0)
            table["draft_spread"].append(0.0)
    return CostProfile(
        contexts=[128, 512],
        widths=[1, 2],
        draft_step_table=[[0.010, 0.010], [0.012, 0.012]],
        sizes=sizes,
        verify_table=[[0.030 + 0.005 * v] * 2 for v in sizes],
        prefill_lengths=[16, 512],
        prefill_target_s=[0.016, 0.512],
        prefill_draft_s=[0.005, 0.154],
        overhead_base_s=0.001,
        ar_overhead_s=0.0005,
        batched=table if batched else {},
    )


def random_actor(obs_dim: int, actions: int, seed: int):
    """A policy actor (``policies.learned_controller.Actor``) of random weights."""
    import torch

    from policies.learned_controller import Actor

    gen = torch.Generator().manual_seed(seed)
    spec = {
        "weights": [torch.randn(16, obs_dim, generator=gen), torch.randn(actions, 16, generator=gen)],
        "biases": [torch.randn(16, generator=gen), torch.randn(actions, generator=gen)],
        "activation": "tanh",
        "obs_mean": torch.randn(obs_dim, generator=gen),
        "obs_var": torch.rand(obs_dim, generator=gen) + 0.5,
        "clip_obs": 10.0,
        "epsilon": 1e-8,
    }
    return Actor(spec, obs_dim, actions)


def make_policy(path, pair: str = "tiny", profile: dict | None = None, seed: int = 0, **kw):
    """A policy file written by ``save_policy`` (the current feature version) with random actors (depth: seeded
    ``seed``, size: ``seed + 1``): what ``load_policy`` reads from a trained run, in milliseconds. ``kw``:
    ``save_policy``'s other arguments."""
    from engine.costs.observation import DEPTH_OBS_DIM, NUM_DEVICE_FEATURES, SIZE_OBS_DIM
    from engine.costs.speedup_model import SIZE_LADDER
    from policies.learned import save_policy

    args = {
        "size_ladder": SIZE_LADDER,
        "tree_width": 2,
        "max_depth": 4,
        "device_feats": np.zeros(NUM_DEVICE_FEATURES),
        "pair": pair,
        "profile": profile,
    }
    args.update(kw)
    return save_policy(
        path,
        random_actor(DEPTH_OBS_DIM, 2, seed),
        random_actor(SIZE_OBS_DIM, len(SIZE_LADDER), seed + 1),
        **args,
    )


def late_starter(skip: int, depth: int):
    """A controller that decides depth 0 for its first ``skip`` cycles (a load-aware rule holding back while the
    batch is busy), then drafts like the static chain of ``depth`` it is: the draft falls behind by every token
    committed meanwhile."""
    from engine.control import StaticController

    class LateStarter(StaticController):
        def __init__(self):
            super().__init__(depth)
            self.skip = skip

        def reset(self):
            self.asked = 0

        def should_continue(self, state):
            if state.depth == 0:
                self.asked += 1
                return self.asked > self.skip
            return super().should_continue(state)

    return LateStarter()


def lookup_chooser(depth: int, take: Callable[[int], bool] | None = None):
    """A static chain of ``depth`` that decides context lookup itself (``decides_lookup``): it takes the
    lookup's proposal when ``take(len(history))`` (default: every other cycle), a deterministic rule of the
    request's history, so a live engine and its replay ask and answer alike. ``asked`` holds each question's
    (cycles so far, tokens proposed, taken)."""
    from engine.control import StaticController

    take = take or (lambda n: n % 2 == 0)

    class LookupChooser(StaticController):
        decides_lookup = True

        def __init__(self):
            super().__init__(depth)
            self.asked = []

        def use_lookup(self, state):
            assert state.depth == 0 and state.lookup_proposed > 0
            taken = bool(take(len(state.history)))
            self.asked.append((len(state.history), state.lookup_proposed, taken))
            return taken

    return LookupChooser()
