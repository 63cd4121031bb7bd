"""Gymnasium environments over the engine: the depth and size decisions, each on two backends (exact
trace replay, the live engine). Registered ids: ``draftpilot/ReplayDepth-v0``, ``draftpilot/ReplaySize-v0``,
``draftpilot/LiveDepth-v0``, ``draftpilot/LiveSize-v0`` (kwargs: ``backend``, the other decision's
``size_controller`` / ``depth_controller``, optional ``config``). An id runs on the backend it names: a
``Replay*`` id refuses a ``LiveBackend`` and a ``Live*`` id a ``ReplayBackend`` (``WrongBackendError``)."""

from gymnasium.envs.registration import register, registry


def _register(env_id: str, entry_point: str, backend_kind: str) -> None:
    """Register ``env_id`` once (a re-import must not register it twice); it refuses the other backend."""
    if env_id not in registry:
        register(id=env_id, entry_point=entry_point, kwargs={"backend_kind": backend_kind})


_register("draftpilot/ReplayDepth-v0", "envs.environments:DepthEnv", "replay")
_register("draftpilot/ReplaySize-v0", "envs.environments:SizeEnv", "replay")
_register("draftpilot/LiveDepth-v0", "envs.environments:DepthEnv", "live")
_register("draftpilot/LiveSize-v0", "envs.environments:SizeEnv", "live")
