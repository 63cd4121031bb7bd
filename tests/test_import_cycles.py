"""No import circle between the project's modules: the graph of every module of the packages and the root
commands, with an edge for every import the layering scan sees (function-level and ``importlib`` ones
included: ``test_layering.imported_modules``), has no cycle. A package's ``__init__`` counts as the module
its own imports make it, not as an import of every submodule. Negative control: a tree with a circle
through a function-level import is caught, and the same tree without it is not."""

from __future__ import annotations

from pathlib import Path

from test_layering import PACKAGES, ROOT, imported_modules

ROOT_COMMANDS = ("train.py", "evaluate.py", "generate.py", "serve.py")


def module_graph(root: Path = ROOT, packages=PACKAGES, commands=ROOT_COMMANDS) -> dict[str, set[str]]:
    """{module: the project modules it imports} over ``packages`` and the root ``commands``."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for name in commands:
        if (root / name).is_file():
            files[Path(name).stem] = root / name
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        graph[module] = {name for name in imported_modules(path, package) if name in files and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    graph = module_graph()
    assert len(graph) > 60 and sum(map(len, graph.values())) > 250  # the scan sees the real tree
    assert cycles(graph) == []


def test_a_circle_through_a_function_level_import_is_caught(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("import importlib\nmod = importlib.import_module('pkg.a')\n")
    assert cycles(module_graph(tmp_path, packages=("pkg",), commands=())) == [["pkg.a", "pkg.b", "pkg.c"]]
    (pkg / "c.py").write_text("X = 1\n")
    assert cycles(module_graph(tmp_path, packages=("pkg",), commands=())) == []
