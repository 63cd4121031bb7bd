"""Load: N requests at once, with and without speculation (the article: a batch-one gain can vanish
under load, because the draft uses compute other requests could have used).

Design: a closed loop of N clients. N worker threads, each with its own ``SpeculativeEngine`` (its own
caches and request state) and its own controller instance, share one ``ModelPair`` (the weights are
read-only during inference; model forwards release the GIL, so the threads really run together and
compete for the cores or the GPU). The workers pull prompts from one shared queue until it is empty.
Aggregate throughput is all generated tokens over the wall time of the whole pass; per-request latency
is each request's own time from its start to its last token. There is no batching across requests:
this measures what speculation costs co-running requests, not a batched server.
On CUDA the engine's clock synchronises the whole device, so per-request times include the other
requests' queued kernels (the wall-clock aggregate is unaffected).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from engine.engine import SpeculativeEngine
from evaluation.measurements import itl_samples, run_engine


def run_pass(
    pair,
    sampling,
    controller_factory: Callable[[], object] | None,
    prompts: Sequence[tuple[str, list[int]]],
    workers: int,
    max_new_tokens: int,
    seed: int,
    bar=None,
) -> dict:
    """All ``prompts`` (id, token ids) through ``workers`` threads; raw requests and the pass wall time."""
    todo: queue.Queue = queue.Queue()
    for item in prompts:
        todo.put(item)
    requests: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def worker(index: int) -> None:
        engine = SpeculativeEngine(pair, sampling)
        controller = controller_factory() if controller_factory is not None else None
        while not errors:
            try:
                pid, ids = todo.get_nowait()
            except queue.Empty:
                return
            try:
                t0 = time.perf_counter()
                run = run_engine(engine, ids, controller, max_new_tokens, seed)
                t1 = time.perf_counter()
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                with lock:
                    errors.append(err)
                return
            run.update(prompt_id=pid, worker=index, start_s=t0 - start, end_s=t1 - start, latency_s=t1 - t0)
            with lock:
                requests.append(run)
                if bar is not None:
                    bar.update()

    threads = [threading.Thread(target=worker, args=(i,), name=f"eval-worker-{i}") for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"wall_s": time.perf_counter() - start, "requests": sorted(requests, key=lambda r: r["start_s"])}


def summarize_pass(result: dict) -> dict[str, float]:
    reqs = result["requests"]
    tokens = sum(r["num_tokens"] for r in reqs)
    latency = np.asarray([r["latency_s"] for r in reqs])
    ttft = np.asarray([r["ttft_s"] for r in reqs])
    itl = itl_samples([c for r in reqs for c in r["cycles"]])

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q)) if values.size else float("nan")

    return {
        "requests": float(len(reqs)),
        "tokens": float(tokens),
        "wall_s": result["wall_s"],
        "aggregate_tokens_per_s": tokens / result["wall_s"] if result["wall_s"] > 0 else float("nan"),
        "latency_p50_s": pct(latency, 50),
        "latency_p90_s": pct(latency, 90),
        "latency_p99_s": pct(latency, 99),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "itl_p50_s": pct(itl, 50),
        "itl_p90_s": pct(itl, 90),
        "itl_p99_s": pct(itl, 99),
    }


def run_load(
    pair,
    sampling,
    factories: dict[str, Callable[[], object] | None],
    prompts: Sequence[tuple[str, list[int]]],
    workers: int,
    max_new_tokens: int,
    seed: int,
    reps: int = 1,
    progress: bool = False,
) -> dict:
    """Each mode (name -> controller factory; None: autoregressive) runs all prompts with ``workers``
    concurrent requests, ``reps`` times, the mode order rotated per repetition; per mode the repetition
    with the median aggregate throughput is summarised (all of them are kept)."""
    names = list(factories)
    passes: dict[str, list[dict]] = {name: [] for name in names}
    with tqdm(total=reps * len(names) * len(prompts), desc=f"load x{workers}", disable=not progress) as bar:
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                passes[name].append(
                    run_pass(pair, sampling, factories[name], prompts, workers, max_new_tokens, seed, bar)
                )
    out = {"workers": workers, "reps": reps, "modes": {}}
    for name, results in passes.items():
        summaries = [summarize_pass(r) for r in results]
        order = np.argsort([s["aggregate_tokens_per_s"] for s in summaries])
        out["modes"][name] = {"summary": summaries[int(order[len(order) // 2])], "passes": results}
    base = out["modes"].get("autoregressive", {}).get("summary", {}).get("aggregate_tokens_per_s")
    for mode in out["modes"].values():
        tps = mode["summary"]["aggregate_tokens_per_s"]
        mode["summary"]["speedup"] = tps / base if base else float("nan")
    return out
