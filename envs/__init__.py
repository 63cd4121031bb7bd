"""Gymnasium environments over the engine: the depth and size decisions, each on two backends (exact
trace replay, the live engine). Registered ids: ``draftpilot/ReplayDepth-v0``, ``draftpilot/ReplaySize-v0``,
``draftpilot/LiveDepth-v0``, ``draftpilot/LiveSize-v0`` (kwargs: ``backend``, the other decision's
``size_controller`` / ``depth_controller``, optional ``config``)."""

from gymnasium.envs.registration import register, registry

from envs.backends import LiveBackend, ReplayBackend
from envs.environments import DepthEnv, EnvConfig, SizeEnv
from envs.replay import SIZE_LADDER, ReplayTrace, replay_generate, throughput
from envs.trace import Trace, TraceError

for _backend in ("Replay", "Live"):
    for _problem in ("Depth", "Size"):
        _id = f"draftpilot/{_backend}{_problem}-v0"
        if _id not in registry:
            register(id=_id, entry_point=f"envs.environments:{_problem}Env", disable_env_checker=False)

__all__ = [
    "SIZE_LADDER",
    "DepthEnv",
    "EnvConfig",
    "LiveBackend",
    "ReplayBackend",
    "ReplayTrace",
    "SizeEnv",
    "Trace",
    "TraceError",
    "replay_generate",
    "throughput",
]
