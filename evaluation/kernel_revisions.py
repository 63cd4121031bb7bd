"""The compiled kernels' sources of another git revision, for the A/B benchmarks that build it next to this
checkout's (``benchmarks/decoder_ab.py``, ``benchmarks/roof.py``, ``benchmarks/step_breakdown.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from engine.backends import native

ROOT = Path(__file__).resolve().parents[1]
"""The repository the revisions are read from (this checkout's)."""


def revision_sources(rev: str, directory: Path) -> Path:
    """The revision's engine/backends/csrc written under ``directory`` (``git show REV:PATH`` of each source and
    header ``native`` builds from); a revision git cannot show stops with its message."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in native.SOURCES + native.HEADERS:
        rel = path.relative_to(ROOT).as_posix()
        try:
            text = subprocess.run(
                ["git", "show", f"{rev}:{rel}"], cwd=ROOT, check=True, capture_output=True
            ).stdout
        except subprocess.CalledProcessError as err:
            raise SystemExit(f"git show {rev}:{rel} failed: {err.stderr.decode().strip()}") from err
        (directory / path.name).write_bytes(text)
    return directory
