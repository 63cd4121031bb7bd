"""The multi-turn workload of ``benchmarks/serve_load.py --workload multi-turn``: conversations as users have
them, each a system turn (a shared system prompt and the user's own document) then several user turns, each
sent once the previous answer has streamed in full; prompts in the suite's four languages.

Every turn is a streamed ``/v1/completions`` request whose prompt is the conversation so far, templated by our
tokenizer (the answers as the server streamed them), so every server sees the same kind of token ids; greedy,
``max_tokens`` with ``ignore_eos``. ``C`` clients each run one conversation at a time, taking the next from the
level's list. A turn's figures: its time to first token (the cost of the prompt the server did not reuse), its
inter-token latencies, and the prompt tokens the server says it took from its cache (our
``usage.prompt_tokens_details.cached_tokens``, llama-server's ``timings.cache_n``). The conversations of each
level and repeat carry their own session line, so no level reuses another's turns; the shared system prompt is
the same everywhere, as a deployment's is.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from peers.load_client import Outcome, Row, latencies, percentile, request_body

QUESTIONS = {
    "en": [
        "Summarise the document above in three sentences.",
        "Which function in it would you test first, and why?",
        "Rewrite its first paragraph for a beginner.",
        "List two risks the document does not mention.",
        "What would you rename, and to what?",
    ],
    "es": [
        "Resume el documento anterior en tres frases.",
        "¿Qué parte probarías primero y por qué?",
        "Reescribe el primer párrafo para un principiante.",
        "Enumera dos riesgos que el documento no menciona.",
        "¿Qué nombre cambiarías, y por cuál?",
    ],
    "it": [
        "Riassumi il documento qui sopra in tre frasi.",
        "Quale parte testeresti per prima, e perché?",
        "Riscrivi il primo paragrafo per un principiante.",
        "Elenca due rischi che il documento non menziona.",
        "Che cosa rinomineresti, e come?",
    ],
    "zh": [
        "用三句话总结上面的文档。",
        "你会先测试哪一部分？为什么？",
        "为初学者改写第一段。",
        "列出文档没有提到的两个风险。",
        "你会重命名什么？改成什么？",
    ],
}
LANGUAGES = tuple(QUESTIONS)


@dataclass
class Conversation:
    user: int
    language: str
    system: str
    """The system turn: the shared system prompt, a session line, the user's document."""
    questions: list[str]


@dataclass
class Turn:
    user: int
    turn: int
    outcome: Outcome
    prompt_tokens: int
    cached: int | None = None
    """Prompt tokens the server says it reused (None: it does not say)."""


@dataclass
class ChatLevel:
    turns: list[Turn] = field(default_factory=list)
    wall: float = 0.0
    start: float = 0.0
    """When the level started (``time.perf_counter``)."""


def conversations(
    users: int, turns: int, shared: str, documents: list[str], session: str
) -> list[Conversation]:
    """``users`` conversations of ``turns`` user turns each: the shared system prompt, a session line, the
    user's document (cycling ``documents``), questions in the four languages in turn."""
    out = []
    for u in range(users):
        language = LANGUAGES[u % len(LANGUAGES)]
        system = f"{shared}\n\nSession {session}, user {u}.\n\nDocument:\n{documents[u % len(documents)]}"
        questions = [QUESTIONS[language][(u + t) % len(QUESTIONS[language])] for t in range(turns)]
        out.append(Conversation(u, language, system, questions))
    return out


async def turn_request(
    client: httpx.AsyncClient, url: str, row: Row, ids: list[int], max_tokens: int
) -> tuple[Outcome, int | None]:
    """One streamed turn: its ``Outcome`` (text, tokens, TTFT, ITL) and the cached prompt tokens the server
    reports, if it does."""
    body = request_body(row, ids, max_tokens)
    start = time.perf_counter()
    out = Outcome(0, False, start=start)
    arrivals, parts, cached, total = [], [], None, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return out, None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return out, None
                usage = chunk.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                if usage.get("completion_tokens") is not None:
                    total = int(usage["completion_tokens"])
                if details.get("cached_tokens") is not None:
                    cached = int(details["cached_tokens"])
                timings = chunk.get("timings") or {}
                if timings.get("cache_n") is not None:
                    cached = int(timings["cache_n"])
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                text = choices[0].get("text") or ""
                ids_k = choices[0].get("token_ids")
                k = (
                    len(ids_k)
                    if ids_k is not None
                    else (1 if text and choices[0].get("finish_reason") is None else 0)
                )
                parts.append(text)
                if k:
                    arrivals.append((time.perf_counter() - start, k))
                    out.times.append(start + arrivals[-1][0])
                    out.tokens += k
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        out.error = f"{type(err).__name__}: {err}"
        return out, None
    out.latency = time.perf_counter() - start
    out.ttft, out.itl = latencies(arrivals)
    out.text, out.ok = "".join(parts), True
    if total is not None:  # the server's count (a last chunk may flush text without a token of its own)
        out.tokens = total
    return out, cached


async def chat_level(
    url: str, row: Row, convs: list[Conversation], clients: int, max_tokens: int, template
) -> ChatLevel:
    """Run ``convs`` with ``clients`` at a time (each client one conversation at a time, turn after turn);
    ``template(messages) -> ids``."""
    level = ChatLevel()
    queue = list(convs)[::-1]
    start = level.start = time.perf_counter()
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def worker():
            while queue:
                conv = queue.pop()
                messages = [{"role": "system", "content": conv.system}]
                for t, question in enumerate(conv.questions):
                    messages.append({"role": "user", "content": question})
                    ids = template(messages)
                    outcome, cached = await turn_request(client, url, row, ids, max_tokens)
                    outcome.prompt = conv.user * 100 + t
                    level.turns.append(Turn(conv.user, t, outcome, len(ids), cached))
                    if not outcome.ok:
                        break
                    messages.append({"role": "assistant", "content": outcome.text})

        await asyncio.gather(*(worker() for _ in range(clients)))
    level.wall = time.perf_counter() - start
    return level


def chat_figures(level: ChatLevel, turns: int, reference: dict[tuple[int, int], str] | None) -> dict:
    """A level's figures: tokens/s, TTFT p50/p99 over all turns and per turn, ITL, the share of prompt tokens
    reused (where the server says), and the share of turns whose text equals ``reference``'s (same user and
    turn; None: not measured)."""
    good = [t for t in level.turns if t.outcome.ok]
    itl = [x for t in good for x in t.outcome.itl]
    out = {
        "requests": len(level.turns),
        "errors": len(level.turns) - len(good),
        "first_error": next((t.outcome.error for t in level.turns if not t.outcome.ok), ""),
        "tokens": sum(t.outcome.tokens for t in good),
        "wall_s": level.wall,
        "tok_s": sum(t.outcome.tokens for t in good) / level.wall if level.wall > 0 else float("nan"),
        "prompt_tokens": sum(t.prompt_tokens for t in good),
        **{f"ttft_p{q}": percentile([t.outcome.ttft for t in good], q / 100) for q in (50, 90, 99)},
        **{f"itl_p{q}": percentile(itl, q / 100) for q in (50, 90, 99)},
        **{f"latency_p{q}": percentile([t.outcome.latency for t in good], q / 100) for q in (50, 99)},
        "decode_tok_s": float("nan"),
    }
    for k in range(turns):
        of_turn = [t.outcome.ttft for t in good if t.turn == k]
        out[f"turn{k + 1}_ttft_p50"] = percentile(of_turn, 0.5)
        out[f"turn{k + 1}_ttft_p99"] = percentile(of_turn, 0.99)
    said = [t for t in good if t.cached is not None]
    out["hit_rate"] = (
        sum(t.cached for t in said) / sum(t.prompt_tokens for t in said) if said else float("nan")
    )
    same = [
        t.outcome.text == reference[(t.user, t.turn)]
        for t in good
        if reference is not None and (t.user, t.turn) in reference
    ]
    out["identical"] = sum(same) / len(same) if same else float("nan")
    out["per_turn"] = [  # every turn: user, turn, sent (s from the level's start), TTFT, prompt, cached
        [
            t.user,
            t.turn,
            round(t.outcome.start - level.start, 3),
            round(t.outcome.ttft, 3),
            t.prompt_tokens,
            t.cached,
        ]
        for t in level.turns
    ]
    return out


def texts(level: ChatLevel) -> dict[tuple[int, int], str]:
    return {(t.user, t.turn): t.outcome.text for t in level.turns if t.outcome.ok}
