"""The built distribution carries every file the native build needs: an sdist of the project, and a wheel
built from that sdist (the way pip installs from one), hold each source ``engine/backends/native.py`` compiles and
each header those sources include; the sources preprocess from the unpacked wheel alone, and (``slow``)
the kernels compile from it. Negative controls: the check flags a listing without the header, an archive
built from a ``pyproject.toml`` that ships only ``csrc/*.cpp`` fails it, and the preprocessor fails on the
sources without their header."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from engine.backends import native

REPO = Path(__file__).resolve().parents[2]
# pyproject's [tool.setuptools] packages (read, not repeated: a package added there is copied too)
PACKAGES = tuple(
    re.findall(
        r'"([^"]+)"', re.search(r"^packages = \[(.*)\]", (REPO / "pyproject.toml").read_text(), re.M)[1]
    )
)
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
CPP_ONLY = '"engine.backends" = ["csrc/*.cpp"]'
SAFE_EXTRACT = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def native_files(csrc: Path = native.CSRC) -> set[str]:
    """Repository paths of every file under ``csrc`` the native build compiles (``native.SOURCES``) or
    includes: ``native.HEADERS`` and every ``#include "..."`` reached from the sources, transitively."""
    todo = [*native.SOURCES, *native.HEADERS]
    seen: set[Path] = set()
    while todo:
        path = todo.pop().resolve()
        if path in seen:
            continue
        seen.add(path)
        if path.exists():  # a missing include is still required: the archive check then names it
            todo.extend(path.parent / name for name in LOCAL_INCLUDE.findall(path.read_text()))
    return {path.relative_to(REPO).as_posix() for path in seen}


def missing_files(required: set[str], archive_names: list[str]) -> list[str]:
    """The required repository paths an archive listing lacks (an sdist prefixes its names with
    ``<name>-<version>/``, a wheel does not)."""
    return sorted(r for r in required if not any(n == r or n.endswith("/" + r) for n in archive_names))


def _build(kind: str, source: Path, out: Path) -> Path:
    """``setuptools.build_meta.build_<kind>`` in a subprocess whose working directory is ``source``."""
    out.mkdir(parents=True, exist_ok=True)
    code = f"import setuptools.build_meta as b, sys; print(b.build_{kind}(sys.argv[1]))"
    run = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out / run.stdout.strip().splitlines()[-1]


def _project_copy(dest: Path, pyproject: str | None = None) -> Path:
    """What the build reads (pyproject.toml, the readme, the packages), copied, so no build output lands
    in the checkout."""
    dest.mkdir(parents=True)
    (dest / "pyproject.toml").write_text(pyproject or (REPO / "pyproject.toml").read_text())
    shutil.copy2(REPO / "README.md", dest / "README.md")
    for package in sorted(
        {name.split(".")[0] for name in PACKAGES}
    ):  # a top-level copy holds its subpackages
        shutil.copytree(REPO / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return dest


def _sdist_then_wheel(root: Path, pyproject: str | None = None) -> tuple[Path, Path]:
    sdist = _build("sdist", _project_copy(root / "src", pyproject), root / "dist")
    with tarfile.open(sdist) as archive:
        archive.extractall(root / "unpacked", **SAFE_EXTRACT)
    (unpacked,) = (root / "unpacked").iterdir()
    return sdist, _build("wheel", unpacked, root / "dist")


def _names(archive: Path) -> list[str]:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            return z.namelist()
    with tarfile.open(archive) as t:
        return t.getnames()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    return _sdist_then_wheel(tmp_path_factory.mktemp("package"))


@pytest.fixture(scope="module")
def wheel_csrc(built, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    with zipfile.ZipFile(built[1]) as z:
        z.extractall(out)
    return out / "engine" / "backends" / "csrc"


def test_the_native_build_needs_its_sources_and_header():
    required = native_files()
    assert {
        "engine/backends/csrc/kquant.cpp",
        "engine/backends/csrc/decoder.cpp",
        "engine/backends/csrc/kquant.h",
    } <= required
    assert all((REPO / path).is_file() for path in required)


def test_the_sdist_and_the_wheel_ship_every_native_file(built):
    sdist, wheel = built
    for archive in (sdist, wheel):
        assert missing_files(native_files(), _names(archive)) == [], archive.name


def test_the_check_rejects_an_archive_without_the_header(built, tmp_path):
    """Negative controls: a listing with the header removed, and a real build whose package data ships
    only ``csrc/*.cpp`` (what pyproject.toml did before it shipped the headers)."""
    names = [n for n in _names(built[1]) if not n.endswith("kquant.h")]
    assert missing_files(native_files(), names) == ["engine/backends/csrc/kquant.h"]
    pyproject = (REPO / "pyproject.toml").read_text()
    line = next(li for li in pyproject.splitlines() if li.startswith('"engine.backends" = ['))
    for archive in _sdist_then_wheel(tmp_path, pyproject.replace(line, CPP_ONLY)):
        assert "engine/backends/csrc/kquant.h" in missing_files(native_files(), _names(archive)), archive.name


def _preprocess(csrc: Path) -> list[subprocess.CompletedProcess]:
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]
    return [
        subprocess.run(
            ["c++", "-E", *native.CFLAGS, *includes, str(csrc / src.name), "-o", "/dev/null"],
            capture_output=True,
            text=True,
        )
        for src in native.SOURCES
    ]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_the_sources_preprocess_from_the_unpacked_wheel(wheel_csrc, tmp_path):
    for run in _preprocess(wheel_csrc):
        assert run.returncode == 0, run.stderr[-2000:]
    bare = tmp_path / "csrc"  # negative control: the same sources without their header do not
    bare.mkdir()
    for src in native.SOURCES:
        shutil.copy2(wheel_csrc / src.name, bare / src.name)
    for run in _preprocess(bare):
        assert run.returncode != 0 and "kquant.h" in run.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_the_kernels_compile_from_the_unpacked_wheel(wheel_csrc, tmp_path):
    """The full build (``native.build`` on the wheel's sources, in a subprocess so that this extension
    never loads into the test process): minutes on a 2-core CPU."""
    code = (
        "import sys; from pathlib import Path; from engine.backends import native; "
        "m = native.build('draftpilot_kquant_wheel', Path(sys.argv[1]), sources=Path(sys.argv[2])); print(m.isa())"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "build"), str(wheel_csrc)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] in ("avx512-vnni", "avx2-vnni", "avx2", "portable"), run.stdout
