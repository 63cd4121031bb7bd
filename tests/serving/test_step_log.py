"""``serve.py --step-log FILE``: every batched step as one JSON line. In process (the tiny pair's batched
engine stepped by hand, the log written as the server writes it): one line a step, the prefill chunks cover
each prompt exactly once from position 0 (a prefix-cache hit starts the next chunk where the hit ends), the
cycles' emitted tokens are the tokens each request got, the rows are the cycles' roots and verified nodes.
As a user meets it: a real server with the flag logs the steps of concurrent requests, and a bad path is one
error line before any model loads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.batch import BatchedEngine
from engine.batch_api import BatchConfig, BatchRequest
from engine.control import StaticController
from engine.scheduling import CYCLE_FIELDS
from serving.step_log import StepLog, read_step_log
from tests_serving_helpers import MODEL

pytestmark = pytest.mark.usefixtures("single_thread")


def test_each_step_is_one_line_that_accounts_for_every_token(served_pair, tmp_path):
    engine = BatchedEngine(
        served_pair,
        BatchConfig(
            max_requests=3, max_prefill_tokens=16, idle_prefill_tokens=16, prefix_cache_bytes=1 << 26
        ),
    )
    prompts = [
        served_pair.encode(text) for text in ("def main():\n    return", "The quick brown fox", "Once upon")
    ]
    prompts.append(prompts[0] + served_pair.encode(" 42"))  # shares the first prompt's prefix: a cache hit
    rids, got = [], {}
    log = StepLog(tmp_path / "steps.jsonl")
    steps = 0
    for i, ids in enumerate(prompts[:3]):
        control = StaticController(depth=2, verify=2) if i != 1 else None
        rids.append(engine.add(BatchRequest(ids, max_new_tokens=12, controller=control, ignore_eos=True)))
    while engine.requests or len(rids) < len(prompts):
        if not engine.requests:  # the fourth prompt once the first has left its KV in the prefix cache
            rids.append(engine.add(BatchRequest(prompts[3], max_new_tokens=6, ignore_eos=True)))
        events = engine.step()
        steps += 1
        log.record(engine, 0.01, events)
        for event in events:
            got[event.rid] = got.get(event.rid, 0) + len(event.tokens)
    log.close()
    lines = read_step_log(tmp_path / "steps.jsonl")
    assert len(lines) == steps
    filled = dict.fromkeys(rids, None)
    emitted = dict.fromkeys(rids, 0)
    for line in lines:
        for rid, tokens, start in line["prefill"]:
            assert tokens > 0 and start == (filled[rid] if filled[rid] is not None else start)
            filled[rid] = start + tokens
        for cycle in line["cycles"]:
            assert len(cycle) == 1 + len(CYCLE_FIELDS)
            emitted[cycle[0]] += cycle[CYCLE_FIELDS.index("emitted") + 1]
        assert line["rows"] == sum(1 + c[CYCLE_FIELDS.index("verified") + 1] for c in line["cycles"])
        assert line["requests"] >= len(line["cycles"]) and line["s"] == 0.01
    for rid, ids in zip(rids, prompts):
        assert filled[rid] == len(ids)  # every prompt token computed or taken from the cache, once
        assert emitted[rid] + 1 == got[rid]  # the first token comes from the prefill, the rest from cycles
    first = next(line["prefill"] for line in lines if any(c[0] == rids[3] for c in line["prefill"]))
    assert [start for rid, _, start in first if rid == rids[3]][0] > 0  # the hit: its chunk starts past 0
    assert any(c[CYCLE_FIELDS.index("depth") + 1] == 2 for line in lines for c in line["cycles"])


def test_a_server_logs_its_steps(launch_server, tmp_path):
    path = tmp_path / "steps.jsonl"
    server = launch_server("--max-requests", "3", "--step-log", str(path)).wait_ready()
    client = server.openai()

    def one(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)

    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(one, ["def f(x):", "Hello there", "1, 2, 3,"]))
    lines = read_step_log(path)
    assert lines and all({"t", "s", "prefill", "cycles", "rows", "requests"} <= set(line) for line in lines)
    assert sum(tokens for line in lines for _, tokens, _ in line["prefill"]) == sum(
        o.usage.prompt_tokens - o.usage.prompt_tokens_details.cached_tokens for o in outs
    )
    assert max(len(line["cycles"]) for line in lines) >= 2  # concurrent requests shared steps
    assert all(line["s"] > 0 for line in lines)


def test_a_step_log_that_cannot_be_written_is_one_error_line(tmp_path, capsys, monkeypatch):
    import serve
    from tests_helpers import one_error_line

    def refuse(*args, **kwargs):
        pytest.fail("models were loaded before the arguments were checked")

    monkeypatch.setattr("engine.cli.load_pair", refuse)
    assert serve.main(["--pair", "tiny", "--step-log", str(tmp_path)]) == 2
    one_error_line(capsys, "--step-log", "is a directory")
