"""Helpers shared by tests in several folders (importable as ``tests_helpers``: pytest puts tests/ on the
path for its conftest)."""

from __future__ import annotations

import gguf
import numpy as np

from engine import SpeculativeEngine


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


def assert_greedy_identity(pair, prompts, controllers, max_new_tokens: int = 24) -> None:
    """Every controller's greedy output equals autoregressive decoding of the same pair, token for token."""
    engine = SpeculativeEngine(pair)
    for prompt in prompts:
        ids = pair.encode(prompt)
        ar = engine.generate(ids, max_new_tokens=max_new_tokens)
        for controller in controllers:
            got = engine.generate(ids, max_new_tokens=max_new_tokens, controller=controller)
            assert got.tokens == ar.tokens, controller
