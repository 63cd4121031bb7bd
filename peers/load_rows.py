"""The servers ``benchmarks/serve_load.py`` puts under the same load: rows of our ``serve.py`` (one per
``--ours NAME=FLAGS``), of llama.cpp's llama-server (autoregressive, with the draft, with its n-gram lookup) and of
vLLM's OpenAI server (``peers.vllm_peer``), each a ``peers.load_client.Row``."""

from __future__ import annotations

import sys
from pathlib import Path

from peers import vllm_peer
from peers.load_client import Row
from policies.static import write_batch_size_table

DEFAULT_VLLM_TABLE = {(1, 1): 3, (2, 4): 2, (5, 1024): 1}
"""The table of the ``vllm table`` row without ``--vllm-table``: longer drafts when the batch is small."""
OURS_WEIGHTS = "GGUF blocks as stored (kquant target, kquant-strict draft: engine/backends/models.py)"
LLAMA_WEIGHTS = "GGUF Q4_K/Q6_K blocks as stored (same files)"


def build_rows(
    args, target_gguf: Path | None, draft_gguf: Path | None, llama_server: Path | None, root: Path
) -> list[Row]:
    """Every row the arguments ask for; ``root`` is the repository (its ``serve.py``, its ``runs/``)."""
    rows = []
    slots = max(args.concurrency)
    for spec in args.ours:
        name, _, flags = spec.partition("=")
        command = [
            sys.executable,
            str(root / "serve.py"),
            "--pair",
            args.pair,
            "--threads",
            str(args.threads),
        ]
        command += ["--max-requests", str(slots), "--max-waiting", "1024", "--log-level", "warning"]
        rows.append(Row(f"ours {name}", command + flags.split(), {"return_token_ids": True}, OURS_WEIGHTS))
    if llama_server is not None:
        base = [str(llama_server), "-m", str(target_gguf), "--host", "127.0.0.1", "-t", str(args.threads)]
        base += [
            "-tb",
            str(args.threads),
            "-np",
            str(slots),
            "-c",
            str(slots * args.slot_context),
            "--no-webui",
        ]
        base += ["--temp", "0", "--top-k", "1", "--log-disable"]
        cache = getattr(args, "cache", "off")
        states = {"off": [False], "on": [True], "both": [True, False]}[cache]
        for on in states:  # llama-server's prompt cache (cache_prompt, its default true), as --cache says
            suffix = " cache" if on and cache == "both" else ""
            body = {"cache_prompt": on}
            rows.append(Row(f"llama ar{suffix}", base, body, LLAMA_WEIGHTS))
            for n in args.llama_draft_max:
                draft = ["-md", str(draft_gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", str(n)]
                draft += ["--spec-draft-n-min", "0", "--spec-draft-p-min", str(args.llama_p_min)]
                draft += ["-td", str(args.threads), "-tbd", str(args.threads)]
                rows.append(Row(f"llama spec n={n}{suffix}", base + draft, body, LLAMA_WEIGHTS))
            if args.llama_ngram:
                ngram = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]
                ngram += ["--spec-ngram-simple-size-m", "8"]
                rows.append(Row(f"llama ngram{suffix}", base + ngram, body, LLAMA_WEIGHTS))
    rows += vllm_rows(args, slots, root)
    return rows


def vllm_rows(args, slots: int, root: Path) -> list[Row]:
    """The ``--vllm`` rows (``ar``, ``draft-K``, ``table``, ``lookup``), or none with one line saying why."""
    if not args.vllm:
        return []
    if args.pair != "qwen2.5-coder":
        print("skipped vllm rows: only the default pair has converted checkpoints", flush=True)
        return []
    python, why = vllm_peer.vllm_python(args.vllm_venv)
    if python is None:
        print(f"skipped vllm rows: {why}", flush=True)
        return []
    target, draft = vllm_peer.default_pair_dirs(args.pair)
    rows = []
    for name in args.vllm:
        options: dict = {}
        if name.startswith("draft-"):
            options = {"draft": draft, "k": int(name.split("-", 1)[1])}
        elif name == "table":
            table = args.vllm_table
            if table is None:
                table = write_batch_size_table(
                    DEFAULT_VLLM_TABLE, root / "runs" / "serve_load_logs" / "vllm_table.json"
                )
            options = {"draft": draft, "table": table}
        elif name == "lookup":
            options = {"lookup": args.vllm_lookup}
        elif name != "ar":
            raise SystemExit(f"error: --vllm: unknown row {name!r} (ar, draft-K, table, lookup)")
        argv, env = vllm_peer.vllm_command(
            python,
            target,
            threads=args.threads,
            max_num_seqs=slots,
            kv_cache_gib=args.vllm_kv_gib,
            dtype=args.vllm_dtype,
            **options,
        )
        weights = vllm_peer.weights(args.vllm_dtype)
        rows.append(Row(f"vllm {name}", argv, {"return_token_ids": True}, weights, env))
    return rows
