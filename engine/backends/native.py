"""The project's compiled CPU kernels (``engine/backends/csrc/``: the K-quant products of ``kquant.cpp`` and the
native decoder of ``decoder.cpp``): built on first use with the machine's
C++ compiler for the machine's own instruction set (``-march=native``) and cached, keyed by the source,
the compiler flags, the torch version and the CPU's instruction-set flags, so a cache made on one CPU is
never loaded on another.

``kernels()`` returns the loaded extension or raises ``NativeUnavailable`` with the reason (no compiler,
no ninja, a compile error); ``available()`` says whether it loads. The AVX-512 VNNI path is compiled where
the CPU has it, else an AVX2 path (FMA, F16C; AVX-VNNI where present) that computes the same bits, else a
portable path (the same integer sums, other float orders, slow); ``kernels().isa()`` names the one built.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType

from engine.errors import DraftpilotError

KERNEL_NUMERICS = 2
"""Version of the kernels' arithmetic (every output bit). Traces and profiles recorded through the kernels
are cached under a key that includes it (``envs.workspace.pair_dir``) when it is above 1: a change to
``engine/backends/csrc`` that alters any output bit (tests/engine/test_kquant.py holds a fingerprint of the
outputs) must increment it, so stale traces are re-recorded instead of replayed. Changes that keep every
bit (tiling, chunking, prefetching, instruction selection) leave it alone."""

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "kquant.cpp", CSRC / "decoder.cpp")
HEADERS = (CSRC / "kquant.h",)
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


class NativeUnavailable(DraftpilotError, RuntimeError):
    """The compiled kernels cannot be built or loaded on this machine."""


def cpu_signature() -> str:
    """The CPU's model name and instruction-set flags (a compiled kernel is only valid for these)."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


def build_dir() -> Path:
    import torch

    from engine.backends.files import cache_dir

    key = hashlib.sha256()
    for part in (
        *(path.read_bytes() for path in SOURCES + HEADERS),
        " ".join(CFLAGS + LDFLAGS).encode(),
        torch.__version__.encode(),
        cpu_signature().encode(),
    ):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "native" / key.hexdigest()[:16]


def build(
    name: str, directory: Path, defines: tuple[str, ...] = (), sources: Path | None = None
) -> ModuleType:
    """Compile (or load from ``directory``) the sources as extension ``name``; ``defines``: extra ``-D``
    flags (``benchmarks/kernel_variants.py`` builds variants this way); ``sources``: a directory holding
    other versions of the same files (``benchmarks/decoder_ab.py``: a git revision's), else ``CSRC``."""
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(directory)
    # compile copies kept in the build directory: torch writes the sources' absolute paths into build.ninja,
    # so compiling another checkout's files (a worktree, an installed copy) would rebuild the cached
    # extension every time the checkout changes; a copy is rewritten only when its content differs
    staged = directory / "src"
    staged.mkdir(exist_ok=True)
    for path in SOURCES + HEADERS:
        data = ((sources or CSRC) / path.name).read_bytes()
        copy = staged / path.name
        if not copy.is_file() or copy.read_bytes() != data:
            partial = copy.with_name(f".{copy.name}.{os.getpid()}.partial")
            partial.write_bytes(data)
            os.replace(partial, copy)
    return load(
        name=name,
        sources=[str(staged / path.name) for path in SOURCES],
        extra_cflags=list(CFLAGS) + [f"-D{d}" for d in defines],
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        verbose=bool(os.environ.get("DRAFTPILOT_VERBOSE_BUILD")),
    )


STALE_LOCK_S = 1800
"""torch's build lock (``<build dir>/lock``) older than this is left by a process killed while loading the
extension (a build takes minutes): torch would wait on it forever, so it is removed."""


def clear_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``directory``'s torch build lock when it is older than ``max_age_s``; True when it did."""
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
            return True
    except OSError:
        pass
    return False


def variant(*defines: str) -> ModuleType:
    """The extension compiled with extra ``-D`` flags, cached next to the default build: ``variant("KQ_NO_AVX512")``
    is the AVX2 path on an AVX-512 CPU, which tests compare with the default build bit for bit."""
    tag = hashlib.sha256(" ".join(defines).encode()).hexdigest()[:8]
    base = build_dir()
    return build(f"draftpilot_kquant_{tag}", base.with_name(f"{base.name}-{tag}"), tuple(defines))


ROOF_SOURCE = CSRC / "roof.cpp"


def roof() -> ModuleType:
    """The peak microkernels of ``csrc/roof.cpp`` (``benchmarks/roof.py``), compiled with the kernels' flags and
    cached like them (keyed by its source, the flags, torch and the CPU); separate from ``kernels()`` so a git
    revision's kernels build alone."""
    import torch
    from torch.utils.cpp_extension import load

    from engine.backends.files import cache_dir

    key = hashlib.sha256()
    for part in (
        ROOF_SOURCE.read_bytes(),
        " ".join(CFLAGS).encode(),
        torch.__version__.encode(),
        cpu_signature().encode(),
    ):
        key.update(part)
        key.update(b"\0")
    directory = cache_dir() / "native" / f"roof-{key.hexdigest()[:16]}"
    directory.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(directory)
    return load(
        name="draftpilot_roof",
        sources=[str(ROOF_SOURCE)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        verbose=bool(os.environ.get("DRAFTPILOT_VERBOSE_BUILD")),
    )


def kernels() -> ModuleType:
    """The compiled extension (built on first use, a minute or so; then loaded from the cache)."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise NativeUnavailable(_error)
        try:
            _module = build("draftpilot_kquant", build_dir())
        except Exception as err:  # a compiler missing or failing: the kquant formats are then unavailable
            _error = (
                f"the compiled kquant kernels are unavailable on this machine ({type(err).__name__}: "
                f"{str(err).strip().splitlines()[-1] if str(err).strip() else err}); they need a C++ "
                f"compiler and ninja (set DRAFTPILOT_VERBOSE_BUILD=1 to see the build)"
            )
            raise NativeUnavailable(_error) from err
        return _module


def use_variant(*defines: str) -> ModuleType:
    """From now on ``kernels()`` is the build of ``variant(*defines)`` (a benchmark's A/B of a kernel change,
    in this process only); returns it. Modules made before keep the kernels they were made with."""
    global _module
    module = variant(*defines)
    with _lock:
        _module = module
    return module


def available() -> bool:
    try:
        kernels()
    except NativeUnavailable:
        return False
    return True
