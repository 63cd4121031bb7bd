"""Building llama.cpp for the peer rows: its programs (``llama-completion`` or ``llama-cli``,
``llama-speculative-simple``, ``llama-server``) built once from the llama.cpp sources vendored in the
llama-cpp-python sdist on PyPI (cmake and a C++ compiler needed), cached under
``<cache>/llama.cpp/<version>/bin``, and found again with the flag spellings their ``--help`` shows.
``peers.llama_cpp`` runs them; ``benchmarks/llama_cpp.py`` is the command line over both."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.backends.files import cache_dir

SOURCE_PACKAGE = "llama-cpp-python"
SOURCE_VERSION = "0.3.36"
"""The llama-cpp-python sdist whose vendored llama.cpp is built; also the cache key of the binaries."""
COMPLETION_NAMES = ("llama-completion", "llama-cli")
"""Autoregressive binary, newest name first (``llama-cli`` turned into a chat UI in newer llama.cpp)."""
SPECULATIVE_NAME = "llama-speculative-simple"
SERVER_NAME = "llama-server"
"""llama.cpp's HTTP server (continuous batching over ``-np`` slots), the peer of ``serve.py`` under load."""
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF",
)  # fmt: skip
"""Static binaries (they are copied out of the build tree), no network code, optimised for this CPU."""
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
"""On x86 the build leaves out ggml's AMX kernels, which ``-march=native`` enables on a CPU that lists AMX: in
this llama.cpp they crash (SIGSEGV on the first request with the default pair's Q4_K_M target, measured on a
Sapphire Rapids VM, 2026-12-02), and the AVX-512 kernels, which the build keeps, run the same files."""


def cmake_flags(cxx: str | None = None) -> tuple[str, ...]:
    """``CMAKE_FLAGS`` plus, on x86 with a compiler that knows them, the ``NO_AMX`` flags (an explicit
    ``-mno-...`` wins over ``-march=native`` whatever the order)."""
    import platform

    cxx = cxx or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cxx is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return CMAKE_FLAGS
    try:
        probe = subprocess.run(
            [cxx, *NO_AMX, "-x", "c++", "-E", "-"], input="", capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return CMAKE_FLAGS
    if probe.returncode != 0:
        return CMAKE_FLAGS
    extra = " ".join(NO_AMX)
    return (*CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={extra}", f"-DCMAKE_CXX_FLAGS={extra}")


def stale_build(bin_dir: Path | str) -> str | None:
    """Why the binaries this script built in ``bin_dir`` should be built again (their recorded cmake flags
    are not this version's), or None (up to date, or not built by this script: ``--llama-bin`` builds are the
    user's)."""
    info = Path(bin_dir).expanduser() / "BUILD_INFO.json"
    try:
        flags = json.loads(info.read_text()).get("cmake_flags")
    except (OSError, ValueError, AttributeError):
        return None
    want = list(cmake_flags())
    if flags != want:
        return f"built with other cmake flags ({' '.join(sorted(set(want) - set(flags or [])))} missing)"
    return None


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp binaries are absent and could not be built (tools, network or the build itself failed)."""


VERSION_RE = re.compile(
    r"version:\s*(?P<version>\S+)\s*\(build\s*(?P<build>-?\d+),\s*commit\s*(?P<commit>[^)]*)\)"
)


def parse_version(text: str) -> dict:
    """``{"version", "build", "commit"}`` from ``--version`` output (empty dict when not found)."""
    m = VERSION_RE.search(text)
    return {"version": m["version"], "build": int(m["build"]), "commit": m["commit"].strip()} if m else {}


# ---------------------------------------------------------------------------------------------- binaries
@dataclass(frozen=True)
class LlamaBinaries:
    """The two llama.cpp programs the benchmark runs, with the flag spellings their ``--help`` shows."""

    completion: Path
    speculative: Path
    draft_max_flag: str = "--spec-draft-n-max"
    p_min_flag: str = "--spec-draft-p-min"
    draft_threads_flags: tuple[str, ...] = ("-td", "-tbd")
    completion_extra: tuple[str, ...] = ("-no-cnv", "--no-display-prompt")
    speculative_extra: tuple[str, ...] = ("--spec-type", "draft-simple")
    """Newer llama.cpp drafts with nothing unless told to use the draft model (older: no such flag)."""
    version: dict = field(default_factory=dict)
    ngram_simple: bool = False
    """``--spec-type ngram-simple`` (n-gram lookup drafting, no draft model) is available."""


def default_bin_dir(cache: Path | str | None = None) -> Path:
    """``<cache>/llama.cpp/<SOURCE_VERSION>/bin``; cache: ``$DRAFTPILOT_CACHE`` or ``~/.cache/draftpilot``."""
    return Path(cache if cache is not None else cache_dir()) / "llama.cpp" / SOURCE_VERSION / "bin"


def find_server(bin_dir: Path | str) -> Path | None:
    """``llama-server`` in ``bin_dir`` when it is there and runs (``--help`` answers), else None."""
    server = Path(bin_dir).expanduser() / SERVER_NAME
    return server if _executable(server) and _help_text(server) else None


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _help_text(binary: Path) -> str:
    try:
        done = subprocess.run(
            [str(binary), "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            errors="replace",
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def _pick(help_text: str, *spellings: str) -> str | None:
    """The first spelling that ``help_text`` lists as an option (None when none is listed)."""
    for flag in spellings:
        if re.search(rf"(?:^|[\s,]){re.escape(flag)}(?:[\s,=]|$)", help_text, re.M):
            return flag
    return None


def find_binaries(bin_dir: Path | str) -> LlamaBinaries | None:
    """The binaries in ``bin_dir`` (None when either is missing), flag names probed from ``--help``."""
    bin_dir = Path(bin_dir).expanduser()
    completion = next((bin_dir / n for n in COMPLETION_NAMES if _executable(bin_dir / n)), None)
    speculative = bin_dir / SPECULATIVE_NAME
    if completion is None or not _executable(speculative):
        return None
    spec_help, comp_help = _help_text(speculative), _help_text(completion)
    if not spec_help or not comp_help:
        return None  # present but not runnable here (wrong architecture, missing library, ...)
    draft_max = _pick(spec_help, "--spec-draft-n-max", "--draft-max", "--draft") or "--draft-max"
    p_min = _pick(spec_help, "--spec-draft-p-min", "--draft-p-min") or "--draft-p-min"
    threads = (
        _pick(spec_help, "-td", "--spec-draft-threads", "--threads-draft"),
        _pick(spec_help, "-tbd", "--spec-draft-threads-batch", "--threads-batch-draft"),
    )
    threads = tuple(f for f in threads if f)
    extra = tuple(
        f
        for f in (_pick(comp_help, "-no-cnv", "--no-conversation"), _pick(comp_help, "--no-display-prompt"))
        if f
    )
    spec_type = (
        ("--spec-type", "draft-simple")
        if _pick(spec_help, "--spec-type") and re.search(r"(?<![\w-])draft-simple(?![\w-])", spec_help)
        else ()
    )
    try:
        done = subprocess.run(
            [str(completion), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            errors="replace",
        )
        version = parse_version(done.stdout + done.stderr)
    except (OSError, subprocess.TimeoutExpired):
        version = {}
    ngram = bool(
        _pick(spec_help, "--spec-ngram-simple-size-n")
        and re.search(r"(?<![\w-])ngram-simple(?![\w-])", spec_help)
    )
    return LlamaBinaries(completion, speculative, draft_max, p_min, threads, extra, spec_type, version, ngram)


def _run_logged(step: str, cmd: list[str], log) -> None:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise LlamaCppUnavailable(f"{step} failed (exit {done.returncode}), see {log.name}")


def build_binaries(bin_dir: Path | str, jobs: int = 1, niceness: int = 19, echo=print) -> LlamaBinaries:
    """Download the llama-cpp-python sdist, build the two programs, install them into ``bin_dir``.

    The build tree is temporary (next to ``bin_dir``); its log is kept as ``<bin_dir>/../build.log``.
    Raises ``LlamaCppUnavailable`` when a tool is missing or a step fails.
    """
    bin_dir = Path(bin_dir).expanduser()
    cmake = shutil.which("cmake")
    if cmake is None:
        raise LlamaCppUnavailable("cmake not found (`pip install cmake` provides it; or pass --llama-bin)")
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        raise LlamaCppUnavailable("no C++ compiler found (c++, g++ or clang++; or pass --llama-bin)")
    root = bin_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "build.log"
    prefix = ["nice", "-n", str(niceness)] if niceness and shutil.which("nice") else []
    with tempfile.TemporaryDirectory(prefix=".build-", dir=root) as tmp, open(log_path, "w") as log:
        tmp = Path(tmp)
        echo(f"llama.cpp: downloading {SOURCE_PACKAGE}=={SOURCE_VERSION} (sdist) from PyPI ...", flush=True)
        download = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
            "-d",
            str(tmp / "sdist"),
        ]
        _run_logged("pip download", download, log)
        sdists = list((tmp / "sdist").glob("*.tar.gz"))
        if len(sdists) != 1:
            raise LlamaCppUnavailable(f"pip download gave {len(sdists)} sdists, expected one")
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            if not members:
                raise LlamaCppUnavailable(f"{sdists[0].name} has no vendor/llama.cpp")
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp / "src", members=members, **kwargs)
        source = next((tmp / "src").glob("*/vendor/llama.cpp"))
        completion = next(
            (
                n
                for n, d in (("llama-completion", "completion"), ("llama-cli", "cli"))
                if (source / "tools" / d).is_dir() or (source / "examples" / d).is_dir()
            ),
            None,
        )
        if completion is None:
            raise LlamaCppUnavailable("neither tools/completion nor tools/cli in this llama.cpp")
        build = tmp / "build"
        echo(
            f"llama.cpp: building {completion}, {SPECULATIVE_NAME} and {SERVER_NAME} with -j{jobs} (about 15 "
            f"min at -j1 on 2 cores), log: {log_path}",
            flush=True,
        )
        started = time.perf_counter()
        flags = cmake_flags()
        configure = [cmake, "-S", str(source), "-B", str(build), *flags]
        _run_logged("cmake configure", prefix + configure, log)
        _run_logged(
            "cmake build",
            prefix
            + [
                cmake,
                "--build",
                str(build),
                "--config",
                "Release",
                f"-j{jobs}",
                "--target",
                completion,
                SPECULATIVE_NAME,
                SERVER_NAME,
            ],
            log,
        )
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in (completion, SPECULATIVE_NAME, SERVER_NAME):
            built = build / "bin" / name
            if not _executable(built):
                raise LlamaCppUnavailable(f"the build did not produce bin/{name}, see {log_path}")
            staged = bin_dir / f".{name}.partial"
            shutil.copy2(built, staged)
            os.replace(staged, bin_dir / name)
        (bin_dir / "BUILD_INFO.json").write_text(
            json.dumps(
                {
                    "source": f"{SOURCE_PACKAGE}=={SOURCE_VERSION} vendor/llama.cpp",
                    "cmake_flags": list(flags),
                    "built": datetime.datetime.now().isoformat(timespec="seconds"),
                    "build_s": round(time.perf_counter() - started, 1),
                },
                indent=1,
            )
            + "\n"
        )
    echo(f"llama.cpp: built in {time.perf_counter() - started:.0f} s into {bin_dir}", flush=True)
    found = find_binaries(bin_dir)
    if found is None:
        raise LlamaCppUnavailable(f"built binaries in {bin_dir} do not run")
    return found
