"""The server on the real default pair: started as a user starts it, three clients at once, each answer the
tokens of its request decoded alone by ``SpeculativeEngine.generate`` (batch invariance on the real
formats), and the metrics counting what happened."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine.backends.models import load_pair
from engine.control import StaticController
from engine.engine import SpeculativeEngine
from engine.inputs import EngineConfig
from engine.lookup import resolve_lookup
from engine.sampling import SamplingConfig
from peers.launch import ServerProcess, free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = (
    "Write a Python function that adds two numbers.",
    "Spiega in una frase cos'è una lista in Python.",
    "用一句话解释 Python 的元组。",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    command = [sys.executable, str(ROOT / "serve.py"), "--port", str(port), "--log-level", "warning"]
    command += ["--policy", "none", "--depth", "2", "--lookup", "on", "--max-requests", "4"]
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess("real server", command, port, log, ready_s=1800, cwd=ROOT) as srv:
        yield srv


def test_concurrent_greedy_answers_are_the_answers_alone(server):
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600)

    def ask(question: str):
        r = client.chat.completions.create(
            model="draftpilot",
            messages=[{"role": "user", "content": question}],
            max_tokens=24,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        return r.choices[0]

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(ask, QUESTIONS))

    pair = load_pair("qwen2.5-coder", progress=False)  # the server's formats: the defaults
    engine = SpeculativeEngine(pair, SamplingConfig(0.0), EngineConfig(lookup=resolve_lookup("on")))
    for question, answer in zip(QUESTIONS, answers):
        alone = engine.generate(
            pair.encode(question), max_new_tokens=24, controller=StaticController(depth=2)
        )
        assert answer.token_ids == alone.tokens, question
        assert answer.message.content == pair.tokenizer.decode(alone.tokens, skip_special_tokens=True)
        assert answer.finish_reason == ("stop" if alone.finish_reason == "eos" else "length")

    metrics = httpx.get(server.base + "/metrics", timeout=30).text
    assert 'draftpilot_requests_total{finish_reason="length"}' in metrics
    drafted = [
        line for line in metrics.splitlines() if line.startswith('draftpilot_cycles_total{kind="draft"}')
    ]
    assert drafted and float(drafted[0].split()[-1]) > 0  # it really speculated
