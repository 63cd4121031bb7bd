"""Running llama.cpp on the same GGUF files as the engine: one greedy run of a setting (autoregressive,
speculative with the draft, n-gram lookup) through the programs ``peers.llama_cpp_build`` builds, and
the parsers of their timing and acceptance lines. One run starts one subprocess, nothing else::

    binaries = find_binaries(default_bin_dir())        # None when absent; build_binaries builds
    run = run_llama_cpp(binaries, LlamaSetting(n_max=8, p_min=0.75), chat_text, target_gguf, draft_gguf)
    run["tok_s"], run["tokens"], run.get("accept")
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from peers.llama_cpp_build import LlamaBinaries


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
