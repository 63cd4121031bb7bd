"""Exact speculative decoding engine: models, sampler, drafting, verification, the cycle loop, timing.

The engine knows nothing of environments or policies; controllers plug in through ``engine.control``.
"""

from engine.backends.models import load_pair
from engine.backends.pair import IncompatiblePairError, ModelPair
from engine.control import Controller, DraftState, StaticController
from engine.engine import EngineConfig, SpeculativeEngine
from engine.results import CycleRecord, GenerationResult
from engine.sampling import SamplingConfig

__all__ = [
    "Controller",
    "CycleRecord",
    "DraftState",
    "EngineConfig",
    "GenerationResult",
    "IncompatiblePairError",
    "ModelPair",
    "SamplingConfig",
    "SpeculativeEngine",
    "StaticController",
    "load_pair",
]
