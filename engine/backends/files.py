"""Writing files so that a kill never leaves a truncated one, and locking a directory against a second
writer.

``atomic_write`` writes through a uniquely named temporary file in the destination's directory, flushes it
to disk and renames it over the destination: a reader sees the old file or the new one, never part of one,
and two concurrent writers never share a temporary name. ``DirectoryLock`` takes an exclusive advisory
lock (``fcntl.flock``) on the directory itself; the operating system drops it when the process dies, so a
killed run never leaves a stale lock behind, and taking it writes no file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.errors import DraftpilotError


def cache_dir() -> Path:
    """Root of the project's cache (weights, converted formats, compiled kernels, the signing key):
    `$DRAFTPILOT_CACHE`, else `~/.cache/draftpilot`."""
    env = os.environ.get("DRAFTPILOT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draftpilot"


class DirectoryBusyError(DraftpilotError, RuntimeError):
    """Another process holds the directory's lock, or the directory cannot be made or written at all."""


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary path next to ``path``; when the block ends without an error, the file written
    there is flushed to disk and renamed to ``path``; on an error it is removed and ``path`` is untouched.
    For writers that want a file name (``torch.save``, ``savefig``, ``np.savez``, a zip writer)."""
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the result is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str, encoding: str = "utf-8") -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring)."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding=encoding)
        else:
            tmp.write_bytes(data)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1, **dumps: Any) -> Path:
    """``json.dumps(obj)`` written atomically, with a final newline."""
    return atomic_write(path, json.dumps(obj, indent=indent, **dumps) + "\n")


def atomic_save(path: str | os.PathLike, writer: Callable[[Path], object]) -> Path:
    """Call ``writer(tmp_path)`` and move the result to ``path`` atomically."""
    with atomic_path(path) as tmp:
        writer(tmp)
    return Path(path)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes (read in chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def load_plain(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain types only, nothing unpickled that could run
    code. Raises ``ValueError`` with a one-line reason for a file that is not such a torch file (torch's own
    errors are many lines, and its weights-only unpickler warns on any foreign pickle before refusing it,
    which would print a warning ahead of the caller's error line: that warning is silenced here)."""
    import pickle
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            text = str(err)
            why = (
                "it holds objects other than tensors and plain types, which are never unpickled"
                if "GLOBAL" in text or "allowed global" in text
                else "not a file saved by torch.save (unreadable pickle data)"
            )
            raise ValueError(why) from err
        except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError) as err:
            raise ValueError(f"not a torch file ({type(err).__name__}: {_first_line(str(err))})") from err


def _first_line(text: str, limit: int = 120) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class DirectoryLock:
    """An exclusive lock on a directory (``fcntl.flock`` on the directory itself): ``with DirectoryLock(run):``.
    A second holder fails at once with ``DirectoryBusyError`` naming the directory (no waiting: two runs
    into one directory are a mistake to report, not to serialise). Taking the lock writes nothing into the
    directory; a directory it had to create is removed again on release if the run left it empty, so a
    refused command leaves no trace."""

    def __init__(self, directory: str | os.PathLike, what: str = "directory"):
        self.directory = Path(directory)
        self.what = what
        self._fd: int | None = None
        self._created: list[Path] = []

    def acquire(self) -> DirectoryLock:
        missing = [d for d in (self.directory, *self.directory.parents) if not d.exists()]
        for _ in range(8):  # retried only if the directory is removed and made again while we lock it
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            except OSError as err:
                raise DirectoryBusyError(
                    f"{self.what} {self.directory} cannot be created or written ({err.strerror or err})"
                ) from err
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DirectoryBusyError(
                    f"{self.what} {self.directory} is in use by another process; wait for it or choose another"
                ) from None
            if _same_file(fd, self.directory):
                break
            os.close(fd)  # locked a directory that a previous holder removed: lock the current one
        else:
            raise DirectoryBusyError(f"{self.what} {self.directory} keeps being removed and made again")
        self._fd = fd
        self._created = [d for d in missing if d.is_dir()]
        return self

    def release(self) -> None:
        if self._fd is not None:
            for directory in self._created:  # leaf first; only what this lock made, only if empty
                try:
                    directory.rmdir()
                except OSError:
                    break
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


KEY_ENV = "DRAFTPILOT_KEY_FILE"


def user_key_path() -> Path:
    """The per-user secret that signs what this project will later unpickle (``$DRAFTPILOT_KEY_FILE``, else
    ``<cache>/secret/signing.key``)."""
    env = os.environ.get(KEY_ENV)
    if env:
        return Path(env).expanduser()
    return cache_dir() / "secret" / "signing.key"


def user_hmac(data: bytes) -> str:
    """HMAC-SHA256 of ``data`` under this user's key (created on first use, readable by the owner only): a
    file signed with it was written by this user's runs, which a file planted by someone else cannot be."""
    import hashlib
    import hmac
    import secrets

    path = user_key_path()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    key = path.read_bytes()
    return hmac.new(key, data, hashlib.sha256).hexdigest()
