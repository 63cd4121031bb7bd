"""Exact speculative decoding engine: models, sampler, drafting, verification, the cycle loop, timing.

The engine knows nothing of environments or policies; controllers plug in through ``engine.control``.
"""

from engine.control import Controller, DraftState, StaticController
from engine.engine import EngineConfig, SpeculativeEngine
from engine.models import IncompatiblePairError, ModelPair, load_pair
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
