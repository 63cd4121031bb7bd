"""The prefix cache as a user meets it (``serve.py --pair tiny``, on by default): a multi-turn chat's later
turns take the conversation so far from the cache, report it in OpenAI's
``usage.prompt_tokens_details.cached_tokens`` (both endpoints, the final stream chunk), decode the tokens the
same request gets cold (generate alone, and a ``--no-prefix-cache`` server), and ``/metrics`` counts the
lookups, hits, bytes and evictions."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests_serving_helpers import MODEL, metric_sum, reference

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = {"temperature": 0, "extra_body": {"return_token_ids": True}}
SYSTEM = (
    "You answer questions about this text. " + "The river runs north past the old mill and the bridge. " * 12
)


@pytest.fixture(scope="module")
def servers(launch_server, served_pair):
    on = launch_server("--max-requests", "4", "--max-context", "1000")
    off = launch_server("--max-requests", "4", "--max-context", "1000", "--no-prefix-cache")
    return on.wait_ready(), off.wait_ready()


@pytest.fixture(scope="module")
def chat_ids(served_pair):
    return lambda messages: list(
        served_pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    )


def converse(client, turns: list[str], max_tokens: int = 16) -> list:
    messages, outs = [{"role": "system", "content": SYSTEM}], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
        outs.append((list(messages), out))
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
    return outs


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_later_turns_hit_and_decode_as_cold(servers, served_pair, chat_ids):
    on, off = servers
    turns = ["Where does the river run?", "And past what?", "Say it again, shorter."]
    hot, cold = converse(on.openai(), turns), converse(off.openai(), turns)
    for (messages, a), (_, b) in zip(hot, cold):
        assert a.choices[0].message.content == b.choices[0].message.content
        ids = chat_ids(messages)
        ref = reference(served_pair, ids, 16).tokens
        assert list(a.choices[0].model_extra["token_ids"]) == ref[:16]
        assert cached(b.usage) == 0 and a.usage.prompt_tokens == len(ids)
    first, second, third = (cached(out.usage) for _, out in hot)
    assert first == 0
    assert second > len(chat_ids(hot[0][0])) - 4  # the whole first prompt, and more
    assert third > second


def test_cached_tokens_in_the_stream_and_on_completions(servers, served_pair):
    on, _ = servers
    client = on.openai()
    prompt = SYSTEM + "Question: what crosses the river?"
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
    b = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
    assert cached(b.usage) == b.usage.prompt_tokens - 1  # all but the last prompt token
    assert b.choices[0].text == a.choices[0].text
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where?"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
    )
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and cached(usages[0]) > 100


def test_concurrent_requests_sharing_a_prefix_decode_as_alone(servers, served_pair):
    on, _ = servers
    client = on.openai()
    prompts = [SYSTEM + f"Question {i}: {'why ' * i}?" for i in range(6)]

    def one(prompt):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        return list(out.choices[0].model_extra["token_ids"]), cached(out.usage)

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, prompts))
    for prompt, (ids, _) in zip(prompts, got):
        ref = reference(served_pair, served_pair.tokenizer.encode(prompt), 12).tokens
        assert ids == ref[: len(ids)] and len(ids) >= min(len(ref), 1)
    assert sum(hit > 0 for _, hit in got) >= 4


def test_metrics_count_the_prefix_cache(servers):
    on, off = servers
    before = on.metrics()
    client = on.openai()
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=SYSTEM + "Metrics?", max_tokens=4, **GREEDY)
    after = on.metrics()
    assert (
        metric_sum(after, "draftpilot_prefix_cache_requests_total")
        >= metric_sum(before, "draftpilot_prefix_cache_requests_total") + 2
    )
    assert metric_sum(after, "draftpilot_prefix_cache_hits_total") > metric_sum(
        before, "draftpilot_prefix_cache_hits_total"
    )
    assert metric_sum(after, "draftpilot_prefix_cache_queries_total") > metric_sum(
        after, "draftpilot_prefix_cache_hits_total"
    )
    assert metric_sum(after, "draftpilot_prefix_cache_bytes") > 0
    assert metric_sum(after, "draftpilot_prefix_cache_max_bytes") > 0
    assert "draftpilot_prefix_cache_evictions_total" in httpx.get(on.url("/metrics"), timeout=10).text
    assert metric_sum(off.metrics(), "draftpilot_prefix_cache_max_bytes") == 0
    assert on.health()["prefix_cache_max_bytes"] > 0 and off.health()["prefix_cache_max_bytes"] == 0


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--prefix-cache-memory", "lots"], ["--prefix-cache-memory", "a size"]),
        (
            ["--no-prefix-cache", "--prefix-cache-memory", "1GiB"],
            ["--no-prefix-cache", "--prefix-cache-memory"],
        ),
        (["--idle-prefill-tokens", "0"], ["--idle-prefill-tokens"]),
    ],
)
def test_bad_prefix_cache_flags_are_one_error_line(argv, needles, capsys, monkeypatch):
    import serve
    from tests_helpers import one_error_line

    def refuse(*args, **kwargs):
        pytest.fail("models were loaded before the arguments were checked")

    monkeypatch.setattr("engine.cli.load_pair", refuse)
    assert serve.main(["--pair", "tiny", *argv]) == 2
    one_error_line(capsys, *needles)
