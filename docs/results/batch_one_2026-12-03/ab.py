"""Batch-one A/B of the 2026-12-03 serving study: run as `python ab.py REPO` for each checkout, alternately."""

import json
import os
import sys

repo = sys.argv[1]
sys.path.insert(0, repo)
os.chdir(repo)

from engine import SamplingConfig, SpeculativeEngine, load_pair  # noqa: E402
from engine.control import StaticController  # noqa: E402
from engine.engine import EngineConfig  # noqa: E402
from engine.lookup import resolve_lookup  # noqa: E402
from envs.prompts import interleave_languages, load_suite  # noqa: E402

pair = load_pair("qwen2.5-coder")
suite = interleave_languages(load_suite(split="test", limit_per_language=1))
prompts = [pair.encode(p["prompt"]) for p in suite]
settings = {"ar": (None, None), "static11+lookup": (StaticController(1, 1), resolve_lookup("on"))}
engines = {
    k: SpeculativeEngine(pair, SamplingConfig(0.0), EngineConfig(lookup=lk))
    for k, (_, lk) in settings.items()
}
engines["ar"].generate(prompts[0], max_new_tokens=16, controller=None)
out: dict[str, list[float]] = {}
for _ in range(2):
    for k, (controller, _) in settings.items():
        tokens = seconds = 0
        for ids in prompts:
            r = engines[k].generate(ids, max_new_tokens=96, controller=controller)
            tokens += len(r.tokens)
            seconds += sum(c.total_s for c in r.cycles)
        out.setdefault(k, []).append(tokens / seconds)
rates = {k: [round(v, 3) for v in vs] for k, vs in out.items()}
print(json.dumps({"repo": repo, **rates, "load": os.getloadavg()[0]}))
