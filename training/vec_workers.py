"""Training environments stepped in worker processes, so that PPO's rollouts use every core (training only).

A replay environment step is Python: the server replay simulates every request of the batch, so one process
keeps one core busy and the other idle. ``WorkerPool`` starts ``workers`` processes once per run (each
imports the project once: seconds), and ``PooledVecEnv`` (an SB3 ``VecEnv``) gives each of them a slice of
a phase's environments: a step sends each worker its slice of the actions, the workers step their
environments at the same time, and the parent stacks the results. Inside a worker, the environments are
stepped exactly as SB3's ``DummyVecEnv`` steps them (auto-reset, ``terminal_observation``,
``TimeLimit.truncated``), and every environment keeps its own seed and random generator, so a run with workers
takes the same episodes, observations and rewards as one without (``tests/training/test_vec_workers.py``).

Why not SB3's ``SubprocVecEnv``: it starts one process per environment (eight here, each importing torch:
~0.3 GB and seconds apiece) for every phase; the pool starts one per core, once. An exception an environment
raises in a worker (``envs.environments.NoDecisionError``: nothing left to decide) is raised again in the
parent, as it would be in-process. Environments are sent to the workers pickled (cloudpickle, the way SB3
sends them): a replay backend, its traces and the other policy's controller travel; a live backend (a model
and its engine) does not, and trains in-process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env.base_vec_env import VecEnv


def default_workers() -> int:
    """One worker per core this process may run on."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


def _worker(remote, parent_remote) -> None:
    parent_remote.close()
    envs: list[gym.Env] = []
    while True:
        try:
            cmd, data = remote.recv()
        except (EOFError, KeyboardInterrupt):
            break
        try:
            if cmd == "build":
                for env in envs:
                    env.close()
                envs = [fn() for fn in cloudpickle.loads(data)]
                out: Any = (envs[0].observation_space, envs[0].action_space) if envs else None
            elif cmd == "step":
                out = [_step(env, action) for env, action in zip(envs, data)]
            elif cmd == "reset":
                out = [
                    env.reset(seed=seed, **({"options": options} if options else {}))
                    for env, (seed, options) in zip(envs, data)
                ]
            elif cmd == "call":
                name, args, kwargs, which = data
                out = [getattr(envs[i], name)(*args, **kwargs) for i in which]
            elif cmd == "get":
                name, which = data
                out = [getattr(envs[i], name) for i in which]
            elif cmd == "set":
                name, value, which = data
                for i in which:
                    setattr(envs[i], name, value)
                out = None
            elif cmd == "run":
                fn, args = cloudpickle.loads(data)
                out = fn(*args)
            elif cmd == "close":
                for env in envs:
                    env.close()
                remote.send(("ok", None))
                break
            else:
                raise ValueError(f"unknown worker command {cmd!r}")
            remote.send(("ok", out))
        except Exception as err:  # raised again in the parent
            remote.send(("error", err))
    remote.close()


def _step(env: gym.Env, action):
    """One step as SB3's ``DummyVecEnv`` takes it: auto-reset at the end of an episode."""
    obs, reward, terminated, truncated, info = env.step(action)
    done = terminated or truncated
    info["TimeLimit.truncated"] = truncated and not terminated
    reset_info: dict = {}
    if done:
        info["terminal_observation"] = obs
        obs, reset_info = env.reset()
    return obs, reward, done, info, reset_info


class WorkerPool:
    """``workers`` processes that host environments for ``PooledVecEnv`` (start once, ``close`` at the end)."""

    def __init__(self, workers: int, start_method: str | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if start_method is None:
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(start_method)
        self.remotes, self.processes = [], []
        for _ in range(workers):
            remote, work_remote = ctx.Pipe()
            process = ctx.Process(target=_worker, args=(work_remote, remote), daemon=True)
            process.start()
            work_remote.close()
            self.remotes.append(remote)
            self.processes.append(process)
        self.closed = False

    @property
    def size(self) -> int:
        return len(self.remotes)

    def send(self, worker: int, cmd: str, data: Any = None) -> None:
        self.remotes[worker].send((cmd, data))

    def receive(self, worker: int) -> Any:
        status, out = self.remotes[worker].recv()
        if status == "error":
            raise out
        return out

    def receive_all(self, workers: Sequence[int]) -> list:
        """Each worker's reply, in order; a worker's error is raised after every one of them has replied (so
        that no reply is left in a pipe for the next command)."""
        outs, error = [], None
        for w in workers:
            try:
                outs.append(self.receive(w))
            except Exception as err:
                error = error or err
        if error is not None:
            raise error
        return outs

    def map(self, fn: Callable, calls: Sequence[tuple]) -> list:
        """``[fn(*args) for args in calls]``, the calls spread over the workers (call i on worker i % size),
        results in order; the environments the workers host are left alone."""
        out: list = [None] * len(calls)
        for start in range(0, len(calls), self.size):
            batch = list(enumerate(calls))[start : start + self.size]
            for w, (_, args) in enumerate(batch):
                self.send(w, "run", cloudpickle.dumps((fn, tuple(args))))
            for (i, _), result in zip(batch, self.receive_all(range(len(batch)))):
                out[i] = result
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for remote in self.remotes:
            try:
                remote.send(("close", None))
                remote.recv()
            except (EOFError, OSError, BrokenPipeError):
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
        for remote in self.remotes:
            remote.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PooledVecEnv(VecEnv):
    """The environments ``env_fns`` make, split over the pool's workers in contiguous slices (environment
    ``i`` on worker ``i * workers // n``): SB3's ``VecEnv`` interface."""

    def __init__(self, pool: WorkerPool, env_fns: Sequence[Callable[[], gym.Env]]):
        n = len(env_fns)
        if n < 1:
            raise ValueError("no environments")
        self.pool = pool
        used = min(pool.size, n)
        self.slices = [list(range(w * n // used, (w + 1) * n // used)) for w in range(used)]
        for w, indices in enumerate(self.slices):
            pool.send(w, "build", cloudpickle.dumps([env_fns[i] for i in indices]))
        spaces = pool.receive_all(range(used))
        self.waiting = False
        super().__init__(n, *spaces[0])

    def _split(self, values: Sequence) -> list[list]:
        return [[values[i] for i in indices] for indices in self.slices]

    def _gather(self) -> list:
        """Every worker's reply, in environment order (a worker's error raised after all have replied)."""
        return [out for part in self.pool.receive_all(range(len(self.slices))) for out in part]

    def step_async(self, actions: np.ndarray) -> None:
        for w, part in enumerate(self._split(list(actions))):
            self.pool.send(w, "step", part)
        self.waiting = True

    def step_wait(self):
        self.waiting = False
        results = self._gather()
        obs, rewards, dones, infos, self.reset_infos = zip(*results)
        return np.stack(obs), np.stack(rewards).astype(np.float32), np.stack(dones), list(infos)

    def reset(self):
        pairs = list(zip(self._seeds, self._options))
        for w, part in enumerate(self._split(pairs)):
            self.pool.send(w, "reset", part)
        results = self._gather()
        obs, self.reset_infos = zip(*results)
        self._reset_seeds()
        self._reset_options()
        return np.stack(obs)

    def _targets(self, indices) -> list[tuple[int, list[int]]]:
        """(worker, positions in its slice) of the environments ``indices`` names."""
        wanted = set(self._get_indices(indices))
        out = []
        for w, slice_ in enumerate(self.slices):
            local = [k for k, i in enumerate(slice_) if i in wanted]
            if local:
                out.append((w, local))
        return out

    def _each(self, cmd: str, make_data: Callable[[list[int]], Any], indices) -> list:
        targets = self._targets(indices)
        for w, local in targets:
            self.pool.send(w, cmd, make_data(local))
        parts = self.pool.receive_all([w for w, _ in targets])
        return [out for part in parts if part is not None for out in part]

    def env_method(self, method_name: str, *method_args, indices=None, **method_kwargs) -> list:
        return self._each("call", lambda local: (method_name, method_args, method_kwargs, local), indices)

    def get_attr(self, attr_name: str, indices=None) -> list:
        return self._each("get", lambda local: (attr_name, local), indices)

    def set_attr(self, attr_name: str, value: Any, indices=None) -> None:
        self._each("set", lambda local: (attr_name, value, local), indices)

    def env_is_wrapped(self, wrapper_class, indices=None) -> list[bool]:
        return [False] * len(self._get_indices(indices))  # the environments are built unwrapped

    def get_images(self):
        return [None] * self.num_envs

    def close(self) -> None:
        """Drops the environments; the pool (and its workers) stays for the next phase."""
        if self.waiting:
            self._gather()
            self.waiting = False
        for w in range(len(self.slices)):
            self.pool.send(w, "build", cloudpickle.dumps([]))
        self.pool.receive_all(range(len(self.slices)))
