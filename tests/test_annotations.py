"""Type hints where a reader needs them most: every private method of the engine's classes (the decoding
loop's internals: what a tree, a cache, a request is), and every ``profile`` / ``backend`` parameter of the
environments and controllers (a ``CostProfile``, a replay or live backend, which a bare name does not say)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_OURS = {"kquant.py", "native.py", "lean.py", "attention.py", "kvcache.py"}
"""Engine modules maintained separately (the compiled-kernel and attention path), checked on their own."""
TYPED_NAMES = {"profile", "backend", "recharge_profile"}


def _functions(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield node.name, item
        elif isinstance(node, ast.Module):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield None, item


def _unannotated(fn: ast.FunctionDef) -> list[str]:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return [a.arg for a in args if a.annotation is None and a.arg not in ("self", "cls")]


def test_private_engine_methods_are_annotated():
    missing = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if path.name in NOT_OURS:
            continue
        for cls, fn in _functions(path):
            if cls is None or not fn.name.startswith("_") or fn.name.startswith("__"):
                continue
            bare = _unannotated(fn) + (["return"] if fn.returns is None else [])
            if bare:
                missing.append(f"{path.relative_to(ROOT)}:{fn.lineno} {cls}.{fn.name}: {bare}")
    assert not missing, "\n".join(missing)


def test_profile_and_backend_parameters_are_annotated():
    missing = []
    for package in ("engine", "envs", "policies", "training", "evaluation"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name in NOT_OURS:
                continue
            for cls, fn in _functions(path):
                bare = [name for name in _unannotated(fn) if name in TYPED_NAMES]
                if bare:
                    where = f"{cls}.{fn.name}" if cls else fn.name
                    missing.append(f"{path.relative_to(ROOT)}:{fn.lineno} {where}: {bare}")
    assert not missing, "\n".join(missing)
