"""One import path per public name: a name is imported from the module that defines it.

* No module of the packages re-exports a name it imports from another project module: by listing it in
  ``__all__``, or by importing it as itself (``from a import X as X``, ``import a.b as b``).
* Nothing (the packages, the root commands, tests, benchmarks) imports a name from a project module or root
  command that only imported it (``from engine import SpeculativeEngine`` when ``engine.engine`` defines it),
  or reads it as that module's attribute (``workspace.load_profile_arg``, ``train.TrainConfig``), except a
  test's monkeypatch seam: the test reads and replaces the binding in the module that uses it
  (``monkeypatch.setattr(module, "name", ...)``).
* A package's ``__init__`` binds no name but its docstring (the environments' one registers the gymnasium
  ids, with what registration needs).

Negative controls: a temporary tree with each kind of re-export and of indirect import is reported, and the
same tree importing from the defining modules is not."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import PACKAGES, ROOT, _call_name

ROOT_COMMANDS = ("train.py", "evaluate.py", "generate.py", "serve.py")
IMPORTERS = ("tests", "benchmarks")
"""Folders of scripts that import from the packages (checked as importers, never imported from)."""
INIT_NAMES = {"envs/__init__.py": {"_register"}}
"""What a package ``__init__`` may bind besides its docstring: the gymnasium registration."""


def project_modules(root: Path = ROOT, packages=PACKAGES) -> dict[str, Path]:
    """{dotted module name: its file} of every module of ``packages`` (a package: its ``__init__.py``)."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _source(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` names, relative levels resolved against ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _top_level(tree: ast.Module):
    """The statements run at import time: the module's own and those inside its ``if`` / ``try`` blocks."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        yield node
        if isinstance(node, ast.If):
            pending[:0] = [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            pending[:0] = [
                *node.body,
                *[s for h in node.handlers for s in h.body],
                *node.orelse,
                *node.finalbody,
            ]


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AnnAssign | ast.AugAssign | ast.For):
        return [node.target]
    if isinstance(node, ast.With):
        return [item.optional_vars for item in node.items if item.optional_vars is not None]
    return []


def module_names(path: Path, package: str, modules: dict[str, Path]) -> tuple[set[str], dict[str, str]]:
    """(the names ``path`` defines at top level, {name: the project module it imports it from}); a name both
    imported and defined counts as defined, a submodule imported by name as neither."""
    tree = ast.parse(path.read_text(), filename=str(path))
    defined, imported = set(), {}
    for node in _top_level(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        for target in _targets(node):
            defined |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        if isinstance(node, ast.ImportFrom) and _source(node, package) in modules:
            source = _source(node, package)
            for alias in node.names:
                if f"{source}.{alias.name}" not in modules:
                    imported[alias.asname or alias.name] = source
    return defined, {name: source for name, source in imported.items() if name not in defined}


def re_exports(root: Path = ROOT, packages=PACKAGES) -> list[str]:
    """Names a module of ``packages`` imports from another project module and hands on (``__all__``, or
    imported as themselves), and what a package ``__init__`` binds beyond ``INIT_NAMES``."""
    modules = project_modules(root, packages)
    found = []
    for module, path in modules.items():
        rel = path.relative_to(root).as_posix()
        defined, imported = module_names(path, _package_of(module, path), modules)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _top_level(tree):
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in _targets(node)):
                listed = [e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)]
                found += [f"{rel} lists {n} in __all__ (from {imported[n]})" for n in listed if n in imported]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    if alias.asname is not None and alias.asname == alias.name.rpartition(".")[2]:
                        found.append(f"{rel}:{node.lineno} imports {alias.name} as {alias.asname}")
        if path.name == "__init__.py":
            bound = (defined | set(imported)) - {"__all__"} - INIT_NAMES.get(rel, set())
            found += [f"{rel} binds {name}" for name in sorted(bound)]
    return found


def _module_aliases(tree: ast.Module, package: str, modules: dict[str, Path]) -> dict[str, str]:
    """{local name: the project module it is bound to} (``import a.b as c``, ``from a import b``, ``import a``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source(node, package)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    aliases[alias.asname] = alias.name
                elif not alias.asname and alias.name.split(".")[0] in modules:
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
    return aliases


def _seams(tree: ast.Module, aliases: dict[str, str]) -> set[tuple[str, str]]:
    """(module, name) of every ``monkeypatch.setattr(module, "name", ...)`` on a project module."""
    return {
        (aliases[node.args[0].id], node.args[1].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and _call_name(node) == "setattr"
        and len(node.args) >= 2
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id in aliases
        and isinstance(node.args[1], ast.Constant)
    }


def indirect_imports(
    root: Path = ROOT, packages=PACKAGES, importers=IMPORTERS, commands=ROOT_COMMANDS
) -> list[str]:
    """``from M import x`` and ``M.x`` where the project module ``M`` does not define ``x`` but imports it
    from another project module (a test's monkeypatch seam aside): ``x``'s one path is its defining module."""
    modules = project_modules(root, packages)
    modules.update({Path(name).stem: root / name for name in commands if (root / name).is_file()})
    names = {m: module_names(path, _package_of(m, path), modules)[1] for m, path in modules.items()}
    files = {path: _package_of(m, path) for m, path in modules.items()}
    for folder in importers:
        files.update({path: folder for path in sorted((root / folder).rglob("*.py"))})
    found = set()
    for path, package in files.items():
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = _module_aliases(tree, package, modules)
        seams = _seams(tree, aliases)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _source(node, package)
                for alias in node.names:
                    if alias.name in names.get(source, {}):
                        origin = names[source][alias.name]
                        found.add(
                            f"{rel}:{node.lineno} imports {alias.name} from {source}, not from {origin}"
                        )
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                source = aliases[node.value.id]
                if node.attr in names.get(source, {}) and (source, node.attr) not in seams:
                    origin = names[source][node.attr]
                    found.add(f"{rel}:{node.lineno} reads {source}.{node.attr}, not {origin}.{node.attr}")
    return sorted(found)


def test_no_module_re_exports_a_name():
    assert re_exports() == []


def test_every_name_is_imported_from_its_defining_module():
    assert len(project_modules()) > 100  # the scan sees the real tree
    assert indirect_imports() == []


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_re_exports_and_indirect_imports_are_reported(tmp_path):
    """Negative controls: ``__all__`` handing on an imported name, ``X as X``, a package ``__init__``
    importing a name, an import and an attribute read through a module (or a root command) that only
    imported the name are reported; a monkeypatch seam, a name defined where it is imported from, and a
    submodule are not."""
    _tree(
        tmp_path,
        {
            "pkg/__init__.py": '"""Docstring."""\n\nfrom pkg.core import Thing\n',
            "pkg/core.py": "class Thing:\n    pass\n\n\ndef helper():\n    return 1\n",
            "pkg/shim.py": "from pkg.core import Thing, helper\nfrom pkg.core import helper as helper\n\n"
            '__all__ = ["Thing", "local"]\n\n\ndef local():\n    return helper()\n',
            "tool.py": "from pkg.core import Thing\n\n\ndef run():\n    return Thing()\n",
            "tests/test_x.py": "import tool\nfrom pkg import Thing, core\nfrom pkg import shim\nfrom pkg.shim import local\n\n"
            "def test_a(monkeypatch):\n    monkeypatch.setattr(shim, 'helper', lambda: 2)\n"
            "    return shim.Thing, shim.local, core.helper, shim.helper, Thing, local, tool.Thing, tool.run\n",
        },
    )
    kwargs = {"packages": ("pkg",), "commands": ("tool.py",)}
    assert re_exports(tmp_path, ("pkg",)) == [
        "pkg/__init__.py binds Thing",
        "pkg/shim.py lists Thing in __all__ (from pkg.core)",
        "pkg/shim.py:2 imports helper as helper",
    ]
    assert indirect_imports(tmp_path, **kwargs) == [
        "tests/test_x.py:2 imports Thing from pkg, not from pkg.core",
        "tests/test_x.py:8 reads pkg.shim.Thing, not pkg.core.Thing",
        "tests/test_x.py:8 reads tool.Thing, not pkg.core.Thing",
    ]
    _tree(
        tmp_path,
        {
            "pkg/__init__.py": '"""Docstring."""\n',
            "pkg/shim.py": "from pkg.core import helper\n\n\ndef local():\n    return helper()\n",
            "tests/test_x.py": "import tool\nfrom pkg import core, shim\nfrom pkg.core import Thing\nfrom pkg.shim import local\n\n"
            "def test_a(monkeypatch):\n    monkeypatch.setattr(shim, 'helper', lambda: 2)\n"
            "    return core.Thing, shim.local, core.helper, shim.helper, Thing, local, tool.run\n",
        },
    )
    assert re_exports(tmp_path, ("pkg",)) == []
    assert indirect_imports(tmp_path, **kwargs) == []
