"""No module touches another module's underscore names.

The rule, checked with ``ast`` on every module of the project outside ``tests/`` (the packages, the root
scripts, ``benchmarks/``):

* an attribute ``X._name`` (not a dunder) may be read or written only on ``self`` or ``cls`` (the object's own
  class, or a subclass of it, reaching its own state), never on another object, ``super()`` included: what a
  module offers to others is public, and a name that starts with ``_`` is its own;
* ``from M import _name`` is never written (a module's underscore names are its own).

Third-party internals are outside the rule where that is decidable: an access whose leftmost name is bound by
an ``import`` of a module outside the project (``torch.ops.aten._weight_int8pack_mm``: torch names these
operators so, and they are called on purpose). Where it is not (a local variable holding a third-party object),
the access is listed in ``THIRD_PARTY`` with its reason. ``ALLOWED``, the project's own exceptions, is empty.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[tuple[str, str], str] = {}
"""(module path, expression) -> why a project module may touch that underscore name: none may."""

THIRD_PARTY: dict[tuple[str, str], str] = {
    ("engine/config_flags.py", "parser._actions"): (
        "argparse offers no public list of a parser's actions; given_flags reads which options argv wrote"
    ),
}
"""(module path, expression) -> why: underscore names of third-party objects the rule cannot tell apart from
the project's (a local variable's), used on purpose."""


def project_modules(root: Path) -> set[str]:
    """Top-level names importable from the project: its packages and its root modules."""
    names = {d.name for d in root.iterdir() if d.is_dir() and (d / "__init__.py").exists()}
    return names | {p.stem for p in root.glob("*.py")} | {"benchmarks"}


def scanned_files(root: Path) -> list[Path]:
    """Every module of the project but its tests (and hidden or virtual-environment folders)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] == "tests" or any(p.startswith(".") or p in ("venv", "build") for p in parts[:-1]):
            continue
        out.append(path)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def hits(path: Path, root: Path, project: set[str]) -> list[tuple[str, str, int]]:
    """(module path, expression, line) of every access of ``path`` that breaks the rule (module docstring)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root).as_posix()
    third_party = set()  # names bound by an import of a module outside the project
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in project:
                    third_party.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in project:
                third_party.update(alias.asname or alias.name for alias in node.names)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if _root_name(value) in third_party:
                continue
            out.append((rel, ast.unparse(node), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    out.append((rel, f"from {node.module} import {alias.name}", node.lineno))
    return out


def scan(root: Path) -> list[tuple[str, str, int]]:
    project = project_modules(root)
    found = []
    for path in scanned_files(root):
        found += hits(path, root, project)
    return found


def test_no_module_touches_another_module_s_underscore_names():
    assert not ALLOWED  # the project's own exceptions: none
    found = scan(ROOT)
    exempt = set(ALLOWED) | set(THIRD_PARTY)
    bad = [f"{rel}:{line}: {expr}" for rel, expr, line in found if (rel, expr) not in exempt]
    assert not bad, "underscore names touched from outside their object or module:\n" + "\n".join(bad)
    stale = exempt - {(rel, expr) for rel, expr, _ in found}
    assert not stale, f"exceptions that match nothing any more (remove them): {sorted(stale)}"


def test_the_scan_finds_what_it_must_and_nothing_else(tmp_path):
    """A negative control on a small tree: each kind of reach-in is found, the allowed forms are not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "inner.py").write_text("_hidden = 1\n\n\nclass Box:\n    _size = 2\n")
    (tmp_path / "pkg" / "user.py").write_text(
        "import torch\n"
        "from torch import ops\n"
        "from pkg import inner\n"
        "from pkg.inner import _hidden\n"
        "\n\n"
        "class Child(inner.Box):\n"
        "    def size(self):\n"
        "        return self._size + super()._size + type(self).__name__.count('x')\n"
        "\n"
        "    @classmethod\n"
        "    def make(cls):\n"
        "        return cls._size\n"
        "\n\n"
        "def peek(box):\n"
        "    box.__dict__.clear()\n"
        "    torch.ops.aten._weight_int8pack_mm\n"
        "    ops.aten._convert_weight_to_int4pack_for_cpu\n"
        "    inner.Box()._size = 3\n"
        "    return box._size, inner._hidden, _hidden\n"
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from pkg import inner\n\ninner._hidden\n")
    found = sorted((rel, expr) for rel, expr, _ in scan(tmp_path))
    assert found == sorted(
        [
            ("pkg/user.py", "from pkg.inner import _hidden"),
            ("pkg/user.py", "super()._size"),
            ("pkg/user.py", "inner.Box()._size"),
            ("pkg/user.py", "box._size"),
            ("pkg/user.py", "inner._hidden"),
        ]
    )
