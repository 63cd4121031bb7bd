"""Exact speculative decoding engine: models, sampler, drafting, verification, the cycle loop, timing.

The engine knows nothing of environments or policies; controllers plug in through ``engine.control``. Each
name is imported from the module that defines it (docs/modules.md lists them), e.g.
``engine.engine.SpeculativeEngine``, ``engine.inputs.EngineConfig``, ``engine.sampling.SamplingConfig``,
``engine.control.StaticController``, ``engine.backends.models.load_pair``. Three layers: ``engine.backends``
(models, weights, kernels, caches), the loop (this package's own modules) and ``engine.costs`` (measurement,
cost profiles, the speedup model, the observation).
"""
