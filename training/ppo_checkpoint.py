"""Training checkpoints' files (training only; ``training.ppo.CoTrainer.save`` writes them, ``load`` reads them):
the manifest's signature and sha256 checks (``verify_checkpoint``), whether a directory holds a checkpoint
(``has_checkpoint``), the trainer state read as plain tensors and numbers (``read_trainer_state``). Trusted-only:
see ``training.ppo``."""

from __future__ import annotations

import hmac
import json
from pathlib import Path

from engine.backends.files import load_plain, sha256_file, user_hmac, user_key_path
from engine.errors import DraftpilotError

CHECKPOINT_FORMAT, CHECKPOINT_VERSION = "draftpilot-checkpoint", 1
MANIFEST = "manifest.json"
CHECKPOINT_ENTRIES = ("trainer.pt", "size.zip", "depth.zip")
"""The files of a checkpoint by role; on disk each is ``<stem>.<phases>-<random><ext>`` (a new name per save,
so a kill between two files leaves the previous manifest and the files it names untouched)."""


class CheckpointError(DraftpilotError, ValueError):
    """A training checkpoint that is not loaded: no manifest, a file that does not match it, or trainer state
    that is not plain tensors and numbers."""


def is_checkpoint_file(name: str) -> bool:
    """A file ``save`` writes (any generation), or one an older version wrote (``trainer.pt``, ``size.zip``, ...)."""
    if name in CHECKPOINT_ENTRIES:
        return True
    stem, _, ext = name.rpartition(".")
    return any(
        stem.startswith(role.rpartition(".")[0] + ".") and ext == role.rpartition(".")[2]
        for role in CHECKPOINT_ENTRIES
    )


def has_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` holds anything of a checkpoint (a manifest or checkpoint files; temporary files
    of an interrupted write do not count)."""
    directory = Path(directory)
    return directory.is_dir() and any(
        p.name == MANIFEST or is_checkpoint_file(p.name) for p in directory.iterdir()
    )


def verify_checkpoint(directory: str | Path) -> dict[str, Path] | None:
    """The checkpoint's files by role (``trainer.pt``, ``size.zip``, ``depth.zip``) after checking each one's
    sha256 against ``manifest.json``; None when ``directory`` holds no checkpoint at all. Raises
    ``CheckpointError`` (naming the file) for a missing or unreadable manifest or a file that does not match
    it. Reads no file but the manifest as anything other than bytes."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        if has_checkpoint(directory):
            raise CheckpointError(
                f"{directory} has no {MANIFEST}, so its files cannot be checked and are not loaded "
                "(a checkpoint this code did not write, or an older version's); delete the "
                "directory to train from the start"
            )
        return None
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        ok = data.get("format") == CHECKPOINT_FORMAT and isinstance(data.get("files"), dict)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{manifest} is not a readable checkpoint manifest ({err})") from err
    if not ok or data.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{manifest} is not a draftpilot checkpoint manifest (version {CHECKPOINT_VERSION})"
        )
    signature = data.get("hmac")
    if not isinstance(signature, str) or not hmac.compare_digest(signature, user_hmac(manifest_bytes(data))):
        raise CheckpointError(
            f"{manifest} is not signed with this user's key ({user_key_path()}): written by another user or "
            "machine, or edited; its files are not unpickled"
        )
    files: dict[str, Path] = {}
    for role, entry in data["files"].items():
        name = entry.get("file") if isinstance(entry, dict) else None
        if (
            role not in CHECKPOINT_ENTRIES
            or not isinstance(name, str)
            or Path(name).name != name
            or name.startswith(".")
            or not is_checkpoint_file(name)
        ):
            raise CheckpointError(
                f"{manifest}: entry {role!r} -> {name!r} is not a checkpoint file of this directory"
            )
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: {manifest} lists it")
        if sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(
                f"{path} does not match its sha256 in {manifest}: modified or not written by this "
                "run; refusing to load it"
            )
        files[role] = path
    if "trainer.pt" not in files:
        raise CheckpointError(f"{manifest} lists no trainer state")
    return files


def manifest_bytes(manifest: dict) -> bytes:
    """The signed part of a manifest (everything but its signature), canonically encoded."""
    return json.dumps({k: v for k, v in manifest.items() if k != "hmac"}, sort_keys=True).encode()


def read_trainer_state(path: str | Path) -> dict:
    """The trainer state ``CoTrainer.save`` wrote, read with ``weights_only=True`` (tensors and plain types
    only: anything else is refused unexecuted)."""
    path = Path(path)
    try:
        state = load_plain(path)
    except ValueError as err:
        raise CheckpointError(f"{path} is not a plain trainer state, refusing to load it: {err}") from err
    keys = ("rho", "total_steps", "best_tps", "best_depth", "best_size", "obs_rms", "history")
    if (
        not isinstance(state, dict)
        or state.get("format") != CHECKPOINT_FORMAT
        or state.get("version") != CHECKPOINT_VERSION
        or any(k not in state for k in keys)
    ):
        raise CheckpointError(f"{path} is not a draftpilot trainer state (version {CHECKPOINT_VERSION})")
    return state
