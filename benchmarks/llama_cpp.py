"""Peer benchmark: llama.cpp on the same GGUF files the engine uses, autoregressive and speculative, greedy.

For each test-split prompt of the suite (chat template applied with our tokenizer, so llama.cpp sees the
same prompt tokens as our engine), every setting runs in turn, order rotated per prompt so machine drift
hits all settings alike:

* ``autoregressive``: ``llama-completion`` (``llama-cli`` in older llama.cpp) on the target alone;
* ``spec n=K p=P``: ``llama-speculative-simple`` with the draft model, at most K drafted tokens per cycle
  and draft probability threshold P (drafting stops early below it), over the --draft-max x
  --draft-p-min grid;
* ``lookup n=N m=M``: ``llama-speculative-simple --spec-type ngram-simple`` without a draft model: the
  latest earlier occurrence of the last N tokens proposes up to M following tokens (llama.cpp drafts
  nothing when fewer than N would follow, so M >= N), over --ngram (N,M pairs; none by default).

Decoding is greedy (``--temp 0 --top-k 1``) and stops at EOS like our engine (no ``--ignore-eos``).
Speeds are llama.cpp's own decode figures (prompt processing excluded): autoregressive ``eval time`` runs
per second, speculative ``decoded N tokens in S seconds``. ``llama-speculative-simple`` may end a few tokens
past ``-n`` (it checks the limit after a verified cycle); rates are per token, so this does not bias them.

The binaries come from ``--llama-bin DIR`` or the cache (``$DRAFTPILOT_CACHE``, default
``~/.cache/draftpilot``, under ``llama.cpp/<version>/bin``); when absent they are built once from the
llama.cpp sources vendored in the llama-cpp-python sdist on PyPI (cmake and a C++ compiler needed; about
10 minutes at -j1 on 2 cores). Without binaries, tools or network the script prints one ``skipped`` line
and exits 0.

    python benchmarks/llama_cpp.py                                    # 1 test prompt per language, 128 tokens
    python benchmarks/llama_cpp.py --prompts-per-language 3 --threads 2 --json runs/llama_cpp.json
    python benchmarks/llama_cpp.py --draft-max 4,8 --draft-p-min 0.5 --max-new-tokens 64
    python benchmarks/llama_cpp.py --llama-bin ~/src/llama.cpp/build/bin --no-build

Another script can interleave llama.cpp runs with its own: load this file by path (its module name would
clash with the llama-cpp-python package; see ``load_benchmark`` in tests/evaluation), then

    binaries = lc.find_binaries(lc.default_bin_dir())        # None when absent; lc.build_binaries builds
    run = lc.run_llama_cpp(binaries, lc.LlamaSetting(n_max=8, p_min=0.75), chat_text, target_gguf, draft_gguf)
    run["tok_s"], run["tokens"], run.get("accept")           # one subprocess, no other side effect
"""

# No `from __future__ import annotations`: with string annotations, @dataclass looks the module up in
# sys.modules, where a script loaded by path (tests, other benchmarks) is not registered.
import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.measure_costs import device_name  # noqa: E402
from engine.weights import DEFAULT_PAIRS, WeightsError, convert_to_hf, fetch_gguf  # noqa: E402
from envs.prompts import LANGUAGES, interleave_languages, language_of, load_suite  # noqa: E402

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


class LlamaCppRunError(RuntimeError):
    """A llama.cpp run failed or printed no timing line this script can read."""


# ----------------------------------------------------------------------------------------------- parsing
_NUM = r"(?:[0-9]+(?:\.[0-9]*)?|inf|nan|-nan)"
EVAL_RE = re.compile(
    rf"(?<!prompt )(?<!\w)eval time\s*=\s*(?P<ms>{_NUM})\s*ms\s*/\s*(?P<runs>\d+)\s*runs"
    rf"\s*\(\s*(?P<ms_per>{_NUM})\s*ms per token,\s*(?P<tps>{_NUM})\s*tokens per second\)"
)
PROMPT_EVAL_RE = re.compile(
    rf"prompt eval time\s*=\s*(?P<ms>{_NUM})\s*ms\s*/\s*(?P<tokens>\d+)\s*tokens"
    rf"\s*\(\s*(?P<ms_per>{_NUM})\s*ms per token,\s*(?P<tps>{_NUM})\s*tokens per second\)"
)
TOTAL_RE = re.compile(rf"total time\s*=\s*(?P<ms>{_NUM})\s*ms\s*/\s*(?P<tokens>\d+)\s*tokens")
ENCODED_RE = re.compile(
    rf"encoded\s+(?P<tokens>\d+)\s+tokens in\s+(?P<s>{_NUM})\s+seconds,\s*speed:\s*(?P<tps>{_NUM})\s*t/s"
)
DECODED_RE = re.compile(
    rf"decoded\s+(?P<tokens>\d+)\s+tokens in\s+(?P<s>{_NUM})\s+seconds,\s*speed:\s*(?P<tps>{_NUM})\s*t/s"
)
SPEC_STAT_RE = re.compile(
    rf"(?<!\w)(?P<key>n_draft|n_predict|n_drafted|n_accept|accept)\s*=\s*(?P<value>{_NUM})\s*%?"
)
VERSION_RE = re.compile(
    r"version:\s*(?P<version>\S+)\s*\(build\s*(?P<build>-?\d+),\s*commit\s*(?P<commit>[^)]*)\)"
)


def _num(text: str) -> float:
    return float("nan") if text.lstrip("-") == "nan" else float(text)


def _last(pattern: re.Pattern, text: str) -> re.Match | None:
    matches = list(pattern.finditer(text))
    return matches[-1] if matches else None


def parse_completion_output(log: str) -> dict:
    """Timings of a ``llama-completion`` / ``llama-cli`` run from its stderr (the last perf block wins).

    Returns ``decode_s``, ``decode_runs`` (one target forward per token after the first), ``tokens``
    (generated, EOS included: the first token comes from the prompt forward, so ``decode_runs + 1``),
    ``tok_s`` (``decode_runs / decode_s``, llama.cpp's own "tokens per second"), ``prompt_tokens``,
    ``prompt_s``, ``total_s``. Raises ``LlamaCppRunError`` without an ``eval time`` line.
    """
    m = _last(EVAL_RE, log)
    if m is None:
        raise LlamaCppRunError("no 'eval time = ... ms / N runs' line in llama.cpp's output")
    runs, ms = int(m["runs"]), _num(m["ms"])
    out = {
        "decode_runs": runs,
        "decode_s": ms / 1e3,
        "tokens": runs + 1,
        "tok_s": runs / (ms / 1e3) if ms > 0 else float("nan"),
    }
    if p := _last(PROMPT_EVAL_RE, log):
        out.update(prompt_tokens=int(p["tokens"]), prompt_s=_num(p["ms"]) / 1e3)
    if t := _last(TOTAL_RE, log):
        out.update(total_s=_num(t["ms"]) / 1e3)
    return out


def parse_speculative_output(log: str) -> dict:
    """Timings and acceptance of a ``llama-speculative-simple`` run from its stderr.

    Returns ``tokens`` (generated, EOS included), ``decode_s``, ``tok_s`` (``tokens / decode_s``),
    ``prompt_tokens``, ``prompt_s`` and, where printed, ``n_draft`` (the maximum draft length),
    ``n_drafted``, ``n_accept``, ``accept`` (a fraction: n_accept / n_drafted). Raises
    ``LlamaCppRunError`` without a ``decoded N tokens`` line.
    """
    m = _last(DECODED_RE, log)
    if m is None:
        raise LlamaCppRunError("no 'decoded N tokens in S seconds' line in llama.cpp's output")
    tokens, seconds = int(m["tokens"]), _num(m["s"])
    out: dict = {
        "tokens": tokens,
        "decode_s": seconds,
        "tok_s": tokens / seconds if seconds > 0 else float("nan"),
    }
    if e := _last(ENCODED_RE, log):
        out.update(prompt_tokens=int(e["tokens"]), prompt_s=_num(e["s"]))
    for s in SPEC_STAT_RE.finditer(log[m.start() :]):  # the summary after the decoded line, not the draft's
        key, value = s["key"], _num(s["value"])
        if key == "accept":
            out.setdefault("accept", value / 100.0)
        elif key != "n_predict":
            out.setdefault(key, int(value))
    if out.get("n_drafted"):
        out["accept"] = out["n_accept"] / out["n_drafted"]
    return out


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
    if cache is None:
        env = os.environ.get("DRAFTPILOT_CACHE")
        cache = Path(env).expanduser() if env else Path.home() / ".cache" / "draftpilot"
    return Path(cache) / "llama.cpp" / SOURCE_VERSION / "bin"


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


# ------------------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class LlamaSetting:
    """One llama.cpp configuration: ``n_max`` None is autoregressive, else speculative with the draft;
    ``ngram`` (N, M): n-gram lookup drafting instead (no draft model, ``n_max`` unused)."""

    n_max: int | None = None
    p_min: float = 0.0
    ngram: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        if self.ngram is not None:
            return f"lookup n={self.ngram[0]} m={self.ngram[1]}"
        return "autoregressive" if self.n_max is None else f"spec n={self.n_max} p={self.p_min:g}"

    @property
    def speculative(self) -> bool:
        return self.n_max is not None or self.ngram is not None


AUTOREGRESSIVE = LlamaSetting()


def llama_command(
    binaries: LlamaBinaries,
    setting: LlamaSetting,
    prompt_text: str,
    target: Path | str,
    draft: Path | str | None,
    max_new_tokens: int = 128,
    threads: int = 2,
    ctx_size: int = 2048,
    seed: int = 0,
) -> list[str]:
    """The command line of one greedy run (no EOS suppression, llama.cpp's chat template off)."""
    common = [
        "-p",
        prompt_text,
        "-n",
        str(max_new_tokens),
        "--temp",
        "0",
        "--top-k",
        "1",
        "--seed",
        str(seed),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(ctx_size),
    ]
    if setting.ngram is not None:
        if not binaries.ngram_simple:
            raise LlamaCppRunError(f"{setting.name}: this llama.cpp has no --spec-type ngram-simple")
        n, m = setting.ngram
        return [
            str(binaries.speculative),
            "-m",
            str(target),
            *common,
            "--spec-type",
            "ngram-simple",
            "--spec-ngram-simple-size-n",
            str(n),
            "--spec-ngram-simple-size-m",
            str(m),
        ]
    if setting.n_max is None:
        return [str(binaries.completion), "-m", str(target), *common, *binaries.completion_extra]
    if draft is None:
        raise ValueError(f"{setting.name} needs a draft model")
    cmd = [
        str(binaries.speculative),
        "-m",
        str(target),
        "-md",
        str(draft),
        *common,
        *binaries.speculative_extra,
        binaries.draft_max_flag,
        str(setting.n_max),
        binaries.p_min_flag,
        f"{setting.p_min:g}",
    ]
    for flag in binaries.draft_threads_flags:
        cmd += [flag, str(threads)]
    return cmd


def run_llama_cpp(
    binaries: LlamaBinaries,
    setting: LlamaSetting,
    prompt_text: str,
    target: Path | str,
    draft: Path | str | None = None,
    *,
    max_new_tokens: int = 128,
    threads: int = 2,
    ctx_size: int = 2048,
    seed: int = 0,
    timeout: float = 900.0,
) -> dict:
    """One greedy llama.cpp run of ``prompt_text`` (already chat-formatted) under ``setting``.

    Returns the parsed timings (see ``parse_completion_output`` / ``parse_speculative_output``) plus
    ``setting``, ``n_max``, ``p_min``, ``wall_s`` (process start to exit, model loading included) and
    ``output`` (the generated text, prompt echo removed). Raises ``LlamaCppRunError`` when the process
    fails, times out or prints no timing line. Starts one subprocess, nothing else.
    """
    cmd = llama_command(
        binaries,
        setting,
        prompt_text,
        target,
        draft,
        max_new_tokens=max_new_tokens,
        threads=threads,
        ctx_size=ctx_size,
        seed=seed,
    )
    started = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as err:
        raise LlamaCppRunError(f"{setting.name}: no exit within {timeout:g} s") from err
    except OSError as err:
        raise LlamaCppRunError(f"{setting.name}: cannot start {cmd[0]}: {err}") from err
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise LlamaCppRunError(f"{setting.name}: {Path(cmd[0]).name} exited {done.returncode}: {tail}")
    parse = parse_speculative_output if setting.speculative else parse_completion_output
    try:
        result = parse(done.stderr + "\n" + done.stdout)
    except LlamaCppRunError as err:
        raise LlamaCppRunError(f"{setting.name}: {err}") from None
    output = done.stdout.strip("\n")
    if output.startswith(prompt_text):  # speculative-simple echoes the prompt
        output = output[len(prompt_text) :]
    output = output.removesuffix(" [end of text]").rstrip("\n")
    return {
        "setting": setting.name,
        "n_max": setting.n_max,
        "p_min": None if setting.n_max is None else setting.p_min,
        "ngram": None if setting.ngram is None else list(setting.ngram),
        **result,
        "wall_s": wall,
        "output": output,
    }


# ----------------------------------------------------------------------------------------------- report
def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def summarize(runs: list[dict], names: list[str]) -> dict[str, dict]:
    """Per setting: median tok/s over prompts, aggregate and per-language tok/s, acceptance."""
    out = {}
    for name in names:
        mine = [r for r in runs if r["setting"] == name]
        tokens = sum(r["decode_runs"] if "decode_runs" in r else r["tokens"] for r in mine)
        seconds = sum(r["decode_s"] for r in mine)
        row = {
            "prompts": len(mine),
            "median_tok_s": statistics.median(r["tok_s"] for r in mine),
            "aggregate_tok_s": tokens / seconds if seconds > 0 else float("nan"),
            "mean_tokens": statistics.mean(r["tokens"] for r in mine),
            "prefill_tok_s": (
                sum(r["prompt_tokens"] for r in mine) / sum(r["prompt_s"] for r in mine)
                if all(r.get("prompt_tokens", -1) > 0 and r.get("prompt_s") for r in mine)
                else None
            ),
            "languages": {},
        }
        for lang in dict.fromkeys(r["language"] for r in mine):
            part = [r for r in mine if r["language"] == lang]
            t = sum(r["decode_runs"] if "decode_runs" in r else r["tokens"] for r in part)
            s = sum(r["decode_s"] for r in part)
            row["languages"][lang] = t / s if s > 0 else float("nan")
        if all("agrees_with_ar" in r for r in mine):
            row["agrees_with_ar"] = sum(r["agrees_with_ar"] for r in mine)
        drafted = sum(r.get("n_drafted", 0) for r in mine)
        if drafted:
            row["accept"] = sum(r.get("n_accept", 0) for r in mine) / drafted
        out[name] = row
    return out


def print_table(summary: dict[str, dict], languages: list[str]) -> None:
    base = summary.get(AUTOREGRESSIVE.name, {}).get("aggregate_tok_s")
    head = (
        f"{'setting':22s} {'median':>8s} {'aggr.':>8s} {'vs AR':>6s} {'accept':>7s} {'tokens':>7s} "
        f"{'=AR':>5s} {'prefill':>8s}  "
    )
    print(head + "  ".join(f"{lang:>6s}" for lang in languages))
    for name, row in summary.items():
        ratio = f"{row['aggregate_tok_s'] / base:5.2f}x" if base else "     -"
        accept = f"{100 * row['accept']:6.1f}%" if "accept" in row else "      -"
        agree = f"{row['agrees_with_ar']}/{row['prompts']}" if "agrees_with_ar" in row else "-"
        print(
            f"{name:22s} {row['median_tok_s']:8.2f} {row['aggregate_tok_s']:8.2f} {ratio:>6s} {accept:>7s} "
            f"{row['mean_tokens']:7.1f} {agree:>5s} {row.get('prefill_tok_s') or float('nan'):8.1f}  "
            + "  ".join(f"{row['languages'].get(lang, float('nan')):6.2f}" for lang in languages)
        )
    print(
        "(decoding tok/s, prompt excluded; median over prompts; aggregate = sum tokens / sum decode time;\n"
        " per-language columns are aggregates; tokens = mean generated per prompt, EOS included;\n"
        " =AR: prompts whose text agrees with autoregressive up to the shorter one;\n"
        " prefill = prompt tokens / prompt-processing seconds, all prompts)"
    )


# ------------------------------------------------------------------------------------------------- main
def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def parse_ngram(text: str) -> tuple[int, int]:
    """``"N:M"`` (or ``"N,M"``) -> (N, M) with 1 <= N <= M: llama.cpp's ngram-simple drafts nothing when fewer
    than N tokens would follow a match, so M < N would never draft."""
    try:
        n, m = (int(x) for x in text.replace(",", ":").split(":"))
    except ValueError:
        raise ValueError(f"expected N:M (lookup N tokens, draft up to M), got {text!r}") from None
    if not 1 <= n <= m:
        raise ValueError(f"expected 1 <= N <= M (llama.cpp drafts nothing for M < N), got {text!r}")
    return n, m


def _ngram_list(text: str) -> list[tuple[int, int]]:
    try:
        return list(dict.fromkeys(parse_ngram(x) for x in text.split(",") if x.strip()))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _prob_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected probabilities in [0, 1], got {text!r}")
    return list(dict.fromkeys(values))


def skip(reason: str) -> int:
    print(f"llama.cpp benchmark skipped: {reason}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen2.5-coder", help="a pair of engine.weights.DEFAULT_PAIRS")
    ap.add_argument(
        "--llama-bin",
        help="directory with llama-completion (or llama-cli) and "
        "llama-speculative-simple; default: the cache, built there if absent",
    )
    ap.add_argument("--no-build", action="store_true", help="never build llama.cpp; skip without binaries")
    ap.add_argument("--jobs", type=int, default=1, help="parallel compile jobs of a build (default 1)")
    ap.add_argument(
        "--suite",
        help="JSONL prompt suite (default: the built-in prompts/suite.jsonl; prompts/long.jsonl has "
        "~1.3-2.2k-token contexts: use --ctx-size 4096 --max-new-tokens 512)",
    )
    ap.add_argument("--split", default="test")
    ap.add_argument("--languages", default="it,en,zh,es")
    ap.add_argument("--prompts-per-language", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="-t and -tb (and the draft's) threads (default 2)")
    ap.add_argument("--ctx-size", type=int, default=2048)
    ap.add_argument(
        "--draft-max",
        type=_int_list,
        default=[4, 8, 16],
        metavar="K,K,...",
        help="maximum drafted tokens per cycle, the grid's first axis (default 4,8,16)",
    )
    ap.add_argument(
        "--draft-p-min",
        type=_prob_list,
        default=[0.0, 0.75],
        metavar="P,P,...",
        help="draft probability threshold, the grid's second axis (default 0,0.75)",
    )
    ap.add_argument(
        "--ngram",
        type=_ngram_list,
        default=[],
        metavar="N:M,N:M,...",
        help="n-gram lookup settings (ngram-simple: lookup N tokens, draft up to M >= N), e.g. 2:2,3:3",
    )
    ap.add_argument("--no-autoregressive", action="store_true", help="speculative settings only")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per llama.cpp run")
    ap.add_argument("--json", metavar="OUT", help="save conditions, summary and every run here")
    args = ap.parse_args(argv)
    for name in ("jobs", "prompts_per_language", "max_new_tokens", "threads", "ctx_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    languages = [x.strip() for x in args.languages.split(",") if x.strip()]

    if not languages or set(languages) - set(LANGUAGES):
        ap.error(
            f"--languages takes a comma-separated subset of {','.join(LANGUAGES)}, got {args.languages!r}"
        )

    if args.pair not in DEFAULT_PAIRS:
        ap.error(f"--pair must be one of {sorted(DEFAULT_PAIRS)}, got {args.pair!r}")

    bin_dir = Path(args.llama_bin).expanduser() if args.llama_bin else default_bin_dir()
    binaries = find_binaries(bin_dir)
    stale = None if args.llama_bin or binaries is None else stale_build(bin_dir)
    if stale and not args.no_build:
        print(f"llama.cpp in {bin_dir}: {stale}; building it again", flush=True)
        binaries = None
    if binaries is None:
        if args.no_build:
            return skip(f"no runnable {COMPLETION_NAMES[0]}/{SPECULATIVE_NAME} in {bin_dir} and --no-build")
        try:
            binaries = build_binaries(bin_dir, jobs=args.jobs)
        except (LlamaCppUnavailable, OSError, tarfile.TarError, StopIteration) as err:
            return skip(f"cannot build llama.cpp: {err}")

    target_spec, draft_spec = DEFAULT_PAIRS[args.pair]
    try:
        target, draft = fetch_gguf(target_spec, progress=False), fetch_gguf(draft_spec, progress=False)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(convert_to_hf(target_spec, progress=False))
    except (WeightsError, OSError) as err:
        return skip(f"cannot get the {args.pair} GGUF files or tokenizer: {err}")

    prompts = interleave_languages(
        load_suite(
            args.suite, split=args.split, languages=languages, limit_per_language=args.prompts_per_language
        )
    )
    if not prompts:
        ap.error(f"no {args.split} prompts for languages {languages}")
    settings = (
        ([] if args.no_autoregressive else [AUTOREGRESSIVE])
        + [LlamaSetting(n, p) for n in args.draft_max for p in args.draft_p_min]
        + [LlamaSetting(ngram=nm) for nm in args.ngram]
    )
    names = [s.name for s in settings]
    opts = dict(
        max_new_tokens=args.max_new_tokens, threads=args.threads, ctx_size=args.ctx_size, timeout=args.timeout
    )

    def formatted(text: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    version = binaries.version or {}
    print(
        f"llama.cpp {version.get('version', '?')} (build {version.get('build', '?')}, commit "
        f"{version.get('commit', '?')}) from {binaries.completion.parent}; {target.name} + {draft.name}; "
        f"{len(prompts)} {args.split} prompts x {len(settings)} settings, {args.max_new_tokens} tokens, "
        f"{args.threads} threads",
        flush=True,
    )
    load_before = _loadavg()
    if load_before and load_before[0] > 0.5:
        print(
            f"warning: load average {load_before[0]:.2f} > 0.5 at start: other work will skew the timings",
            file=sys.stderr,
            flush=True,
        )

    runs: list[dict] = []
    started = time.perf_counter()
    try:
        warm = formatted(prompts[0]["prompt"])  # page the model files in, not measured
        run_llama_cpp(binaries, AUTOREGRESSIVE, warm, target, **{**opts, "max_new_tokens": 4})
        if any(s.n_max for s in settings):
            run_llama_cpp(binaries, LlamaSetting(4), warm, target, draft, **{**opts, "max_new_tokens": 4})
        for index, item in enumerate(prompts):
            text = formatted(item["prompt"])
            n_prompt = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            shift = index % len(settings)
            for setting in settings[shift:] + settings[:shift]:
                run = run_llama_cpp(binaries, setting, text, target, draft, **opts)
                run.update(prompt_id=item["id"], language=language_of(item), prompt_tokens_ours=n_prompt)
                runs.append(run)
            mine = {r["setting"]: r for r in runs if r["prompt_id"] == item["id"]}
            if AUTOREGRESSIVE.name in mine:  # greedy: the texts agree up to the shorter one
                ar = mine[AUTOREGRESSIVE.name]["output"]
                for r in mine.values():
                    r["agrees_with_ar"] = ar.startswith(r["output"]) or r["output"].startswith(ar)
            print(
                f"[{index + 1}/{len(prompts)} {time.perf_counter() - started:5.0f} s] {item['id']}: "
                + ", ".join(f"{n} {mine[n]['tok_s']:.2f}" for n in names),
                flush=True,
            )
    except LlamaCppRunError as err:
        print(f"error: llama.cpp run failed: {err}", file=sys.stderr)
        return 1
    load_after = _loadavg()

    summary = summarize(runs, names)
    conditions = {
        "cpu": device_name(torch.device("cpu")),
        "logical_cpus": os.cpu_count(),
        "threads": args.threads,
        "load_before": load_before,
        "load_after": load_after,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "llama_cpp": version,
        "source": f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
        "bin_dir": str(binaries.completion.parent),
        "target": target.name,
        "draft": draft.name,
        "max_new_tokens": args.max_new_tokens,
        "ctx_size": args.ctx_size,
        "split": args.split,
        "prompts": len(prompts),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    load = " / ".join(f"{a[0]:.2f}" if a else "?" for a in (load_before, load_after))
    print(
        f"\nllama.cpp {version.get('version', '?')} (build {version.get('build', '?')}, commit "
        f"{version.get('commit', '?')}), {conditions['cpu']}, {args.threads} threads, load {load} "
        f"(before / after), {conditions['date']}"
    )
    print(
        f"{args.pair}: {len(prompts)} {args.split} prompts, greedy, <= {args.max_new_tokens} tokens "
        f"(stop at EOS), {conditions['wall_s']:.0f} s\n"
    )
    print_table(summary, languages)
    mismatched = sorted(
        {
            r["prompt_id"]
            for r in runs
            if r.get("prompt_tokens") is not None  # -1: spec
            and r["prompt_tokens_ours"] - r["prompt_tokens"] not in (0, 1)
        }
    )
    if mismatched:
        print(
            f"warning: llama.cpp's prompt token count differs from our tokenizer's on {mismatched}",
            file=sys.stderr,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "conditions": conditions,
                    "binaries": asdict(binaries),
                    "summary": summary,
                    "runs": runs,
                },
                indent=1,
                ensure_ascii=False,
                default=str,
            )
            + "\n"
        )
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
