import sys, time, statistics, json, os
repo = sys.argv[1]; sys.path.insert(0, repo); os.chdir(repo)
import torch
from engine import SamplingConfig, SpeculativeEngine, load_pair
from engine.engine import EngineConfig
from engine.lookup import resolve_lookup
from engine.control import StaticController
from envs.prompts import load_suite, interleave_languages
pair = load_pair("qwen2.5-coder")
prompts = [pair.encode(p["prompt"]) for p in interleave_languages(load_suite(split="test", limit_per_language=1))]
settings = {"ar": (None, None), "static11+lookup": (StaticController(1, 1), resolve_lookup("on"))}
out = {}
eng = {k: SpeculativeEngine(pair, SamplingConfig(0.0), EngineConfig(lookup=lk)) for k, (c, lk) in settings.items()}
eng["ar"].generate(prompts[0], max_new_tokens=16, controller=None)
for rnd in range(2):
    for k, (c, lk) in settings.items():
        toks = secs = 0
        for ids in prompts:
            r = eng[k].generate(ids, max_new_tokens=96, controller=c)
            toks += len(r.tokens); secs += sum(cy.total_s for cy in r.cycles)
        out.setdefault(k, []).append(toks / secs)
print(json.dumps({"repo": repo, **{k: [round(v, 3) for v in vs] for k, vs in out.items()}, "load": os.getloadavg()[0]}))
