"""A lone long prompt, cold: the server's time to first token next to the engine's own prefill of it.

The server (``serve.py`` with ``--flags``, its prefix cache off so every prompt is cold) gets one request at a
time: a prompt of ``--tokens`` tokens cut from the suite's train prompts (a different one each repeat, so
nothing is reused), ``max_tokens`` 1, streamed; its TTFT is measured by the client. Then, in this process with
the server stopped, ``SpeculativeEngine.generate`` prefills the same prompts (``GenerationResult.prefill_s``:
the engine's best path, ``MAX_ROWWISE_ROWS``-row chunks back to back). The two are interleaved over
``--repeats`` and printed with their ratio (median and range).

    python benchmarks/lone_prompt.py --tokens 2000 --repeats 3
    python benchmarks/lone_prompt.py --tokens 2000 --flags "--autoregressive --idle-prefill-tokens 16"
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from engine.cli import ArgumentParser
from envs.prompts import cold_prompts
from peers.launch import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]


def ttft(url: str, ids: list[int]) -> float:
    body = {"model": "draftpilot", "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.Client(timeout=3600) as client, client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"choices"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token came back")


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python benchmarks/lone_prompt.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flags", default="--autoregressive", help="serve.py's flags (its prefix cache is off)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    prompts = cold_prompts(args.pair, args.tokens, 2 * args.repeats)
    from engine.backends.models import load_pair
    from engine.engine import SpeculativeEngine

    served, engine_s = [], []
    for repeat in range(args.repeats):
        port = free_port()
        command = [
            sys.executable,
            str(ROOT / "serve.py"),
            "--pair",
            args.pair,
            "--threads",
            str(args.threads),
        ]
        command += [*args.flags.split(), "--no-prefix-cache", "--port", str(port), "--log-level", "warning"]
        log = ROOT / "runs" / "lone_prompt.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with ServerProcess("ours", command, port, log, ready_s=1800, cwd=ROOT):
            url = f"http://127.0.0.1:{port}/v1/completions"
            ttft(url, prompts[0][:32])  # warm-up
            served.append(ttft(url, prompts[2 * repeat]))
        import torch

        torch.set_num_threads(args.threads)
        pair = load_pair(args.pair)
        engine = SpeculativeEngine(pair)
        engine.generate(prompts[0][:32], 1)  # warm-up
        engine_s.append(engine.generate(prompts[2 * repeat + 1], 1).prefill_s)
        del engine, pair
        print(
            f"repeat {repeat}: server ttft {served[-1]:.2f} s, engine prefill {engine_s[-1]:.2f} s, "
            f"ratio {served[-1] / engine_s[-1]:.3f}  load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    ratios = [a / b for a, b in zip(served, engine_s)]
    print(
        f"# {args.tokens} tokens, {args.repeats} repeats: server ttft median {statistics.median(served):.2f} s, "
        f"engine prefill {statistics.median(engine_s):.2f} s, ratio median {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}, {max(ratios):.3f}]"
    )
    if args.json:
        out = {"args": vars(args), "served_ttft_s": served, "engine_prefill_s": engine_s, "ratios": ratios}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
