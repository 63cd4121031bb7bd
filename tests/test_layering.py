"""The packages depend one way (docs/architecture.md "Layers and dependencies"): the engine imports none of the others, the
environments do not import the controllers, the training or the evaluation, the controllers (the inference
path) import only the engine (no environment, no training code, no stable-baselines3 or gymnasium), the
training (``training/``) imports the engine, the environments and the controllers but not the evaluation or
the server, and the server (serving/) imports only the engine and the controllers, never the training. The
benchmark clients and peer launchers (peers/: load clients, server processes, llama.cpp and vLLM) import
neither the environments, the evaluation nor the training code, and no package below them (the server
included) imports them. Inside the engine the layers depend one
way too: the backends (``engine.backends``: models, weights, kernels, caches) import neither the loop nor the
costs; the loop (``engine``'s own modules: the cycle, sampler, trees, batching, command lines) imports no cost
module; the costs (``engine.costs``: measurement, profiles, features, the cost model) may use both.
``engine.errors`` is the base every layer may import (it imports nothing of the project).

Every import is checked, function-level ones included (they hide cycles), and so are modules loaded through
``importlib.import_module`` / ``__import__`` with a literal name. A file loaded by path
(``spec_from_file_location``, ``runpy.run_path``) is refused in the packages and in benchmarks/: the project is
installed, so everything imports by name. The benchmarks are scripts on top of every package: they import no
sibling script and never edit ``sys.path``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "envs", "policies", "training", "evaluation", "serving", "peers")
FORBIDDEN = {
    "engine": {
        "envs",
        "policies",
        "training",
        "evaluation",
        "serving",
        "peers",
        "stable_baselines3",
        "gymnasium",
    },
    "envs": {"policies", "training", "evaluation", "serving", "peers"},
    # the controllers are the inference path: the engine only
    "policies": {"envs", "training", "evaluation", "serving", "peers", "stable_baselines3", "gymnasium"},
    "training": {"evaluation", "serving", "peers"},
    "evaluation": {"serving"},
    # the server is on the inference path: no training code, no benchmark or peer tooling
    "serving": {"envs", "training", "evaluation", "peers", "stable_baselines3", "gymnasium"},
    # benchmark clients and peer launchers: the engine's tokenizers and cache directories, the controllers'
    # table file; never the environments, the evaluation or the training code
    "peers": {"envs", "evaluation", "training", "stable_baselines3", "gymnasium"},
}
ALLOWED: set[tuple[str, str]] = set()
"""(file, package) exceptions to ``FORBIDDEN``: none; an entry must say why, and is removed once not needed."""
ENGINE_LAYERS = ("engine.backends", "engine.costs", "engine.errors")  # else: the loop ("engine")
ENGINE_FORBIDDEN = {
    "engine.backends": {"engine", "engine.costs"},
    "engine": {"engine.costs"},
    "engine.costs": set(),
    "engine.errors": {"engine", "engine.backends", "engine.costs"},
}
PATH_LOADERS = {"spec_from_file_location", "run_path", "SourceFileLoader"}
NAME_LOADERS = {"import_module", "__import__"}


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Dotted names of every module ``path`` imports, as far as they can be told: ``from a import b`` gives
    ``a`` and ``a.b`` (``b`` may be a submodule); relative imports are resolved against ``package`` (the
    module's dotted package, default its directory's name); ``importlib.import_module("x.y")`` gives
    ``x.y``; a file loaded by path gives ``<path load>``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = package or path.parent.name
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call):
            call = _call_name(node)
            if call in NAME_LOADERS and node.args and isinstance(node.args[0], ast.Constant):
                if isinstance(node.args[0].value, str):
                    names.add(node.args[0].value)
            elif call in PATH_LOADERS:
                names.add("<path load>")
    return names


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (relative imports resolved to its package)."""
    return {name.split(".")[0] for name in imported_modules(path)}


def engine_layer(module: str) -> str | None:
    """The engine layer of a dotted module name (None: not the engine's)."""
    if module != "engine" and not module.startswith("engine."):
        return None
    return next(
        (layer for layer in ENGINE_LAYERS if module == layer or module.startswith(layer + ".")), "engine"
    )


def upward_imports(root: Path = ROOT) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            modules = imported_modules(path, ".".join(path.relative_to(root).parent.parts))
            tops = {name.split(".")[0] for name in modules}
            for name in sorted(tops & (FORBIDDEN[package] | {"benchmarks"})):
                if (rel, name) not in ALLOWED:
                    found.append(f"{rel} imports {name}")
            if "<path load>" in modules:
                found.append(f"{rel} loads a file by path")
            if package == "engine":
                own = engine_layer(".".join(path.relative_to(root).with_suffix("").parts))
                for name in sorted(modules):
                    if engine_layer(name) in ENGINE_FORBIDDEN[own]:
                        found.append(f"{rel} ({own}) imports {name}")
    return found


def benchmark_problems(root: Path = ROOT) -> list[str]:
    """What a benchmark script does that a script on top of the installed packages must not: import a
    sibling script, load a file by path, edit ``sys.path``."""
    found = []
    scripts = {path.stem for path in (root / "benchmarks").glob("*.py")}
    for path in sorted((root / "benchmarks").glob("*.py")):
        rel = path.relative_to(root).as_posix()
        modules = imported_modules(path, "benchmarks")
        for name in sorted(modules):
            top = name.split(".")[0]
            if top in scripts or top == "benchmarks":
                found.append(f"{rel} imports the script {name}")
        if "<path load>" in modules:
            found.append(f"{rel} loads a file by path")
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                found.append(f"{rel}:{node.lineno} uses sys.path")
                break
    return found


def test_no_package_imports_upward():
    assert upward_imports() == []


def test_benchmarks_are_scripts_over_the_installed_packages():
    assert benchmark_problems() == []


def test_the_scan_sees_function_level_imports(tmp_path):
    """Negative control: an import hidden inside a function is found."""
    module = tmp_path / "engine" / "x.py"
    module.parent.mkdir()
    module.write_text("def f():\n    from policies import StaticController\n    return StaticController\n")
    assert "policies" in imported_packages(module)


def test_the_scan_sees_importlib_loads_and_layer_breaks(tmp_path):
    """Negative controls: a backend that imports the loop through importlib, a loop module importing a cost
    module with a relative import, a controller importing stable-baselines3 (inside a function), the server
    importing the training, a package module and a benchmark loading a script by path, a benchmark
    importing a sibling script and one editing sys.path are all reported."""
    files = {
        "engine/backends/x.py": "import importlib\n\ndef f():\n    return importlib.import_module('engine.engine')\n",
        "engine/y.py": "from .costs import observation\n",
        "engine/costs/z.py": "from engine.engine import SpeculativeEngine\nfrom engine.backends import models\n",
        "evaluation/w.py": "import importlib.util\nspec = importlib.util.spec_from_file_location('m', 'a.py')\n",
        "policies/u.py": "import numpy\n\ndef f():\n    from stable_baselines3 import PPO\n    return PPO\n",
        "serving/v.py": "from training.export import write_exports\n",
        "benchmarks/a.py": "import sys\nsys.path.insert(0, '.')\nimport b\n",
        "benchmarks/b.py": "import runpy\nrunpy.run_path('a.py')\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    assert sorted(upward_imports(tmp_path)) == [
        "engine/backends/x.py (engine.backends) imports engine.engine",
        "engine/y.py (engine) imports engine.costs",
        "engine/y.py (engine) imports engine.costs.observation",
        "evaluation/w.py loads a file by path",
        "policies/u.py imports stable_baselines3",
        "serving/v.py imports training",
    ]
    assert benchmark_problems(tmp_path) == [
        "benchmarks/a.py imports the script b",
        "benchmarks/a.py:2 uses sys.path",
        "benchmarks/b.py loads a file by path",
    ]


def test_allowed_exceptions_are_still_needed():
    """An exception that no longer applies must be removed from the list."""
    assert [(rel, name) for rel, name in sorted(ALLOWED) if name not in imported_packages(ROOT / rel)] == []
