"""The packages depend one way (docs/architecture.md "Modules"): the engine imports none of the others, the
environments do not import the controllers or the evaluation, the controllers do not import the
evaluation, of the controllers only the training modules (PPO, imitation) import the environments, and the server
(serving/) imports only the engine and the controllers' inference code. Every import is checked, function-level ones
included (they hide cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "envs", "policies", "evaluation", "serving")
FORBIDDEN = {
    "engine": {"envs", "policies", "evaluation", "serving"},
    "envs": {"policies", "evaluation", "serving"},
    "policies": {"envs", "evaluation", "serving"},
    "evaluation": {"serving"},
    # the server is on the inference path: no training code
    "serving": {"envs", "evaluation", "stable_baselines3", "gymnasium"},
}
ALLOWED = {
    ("policies/ppo.py", "envs"),  # training code: PPO on the environments (never on the inference path)
    ("policies/imitation.py", "envs"),  # training code: the imitation start, on the same environments
}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (relative imports resolved to its package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(path.parent.name if node.level else (node.module or "").split(".")[0])
    return names


def upward_imports() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for name in sorted(imported_packages(path) & FORBIDDEN[package]):
                if (rel, name) not in ALLOWED:
                    found.append(f"{rel} imports {name}")
    return found


def test_no_package_imports_upward():
    assert upward_imports() == []


def test_the_scan_sees_function_level_imports(tmp_path):
    """Negative control: an import hidden inside a function is found."""
    module = tmp_path / "engine" / "x.py"
    module.parent.mkdir()
    module.write_text("def f():\n    from policies import StaticController\n    return StaticController\n")
    assert "policies" in imported_packages(module)


@pytest.mark.parametrize("rel, name", sorted(ALLOWED))
def test_allowed_exceptions_are_still_needed(rel, name):
    """An exception that no longer applies must be removed from the list."""
    assert name in imported_packages(ROOT / rel)
