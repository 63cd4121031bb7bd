"""The recording's settings and files (``envs.record_traces``): the checks every recording setting passes
(``check_record_settings``: in range, and fitting the trace format), the prompt files it reads
(``read_prompts``), where each trace lives (``trace_path``), which traces an output directory already holds
with other settings (``mismatched_traces``), and the traces of a directory (``load_traces``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from engine.errors import DraftpilotError, InputError, is_int
from engine.inputs import MAX_SEED
from envs.trace import Trace, TraceError

DEFAULT_CHUNK = 64
"""Positions whose frontiers share each draft forward (at most chunk * tree_width queries). Larger chunks
batch better and share more nodes; memory grows with them (kept logits rows: about 12 per position on
real text at depth 8, width 4). 64 beat 16 and 32 on the 2-core CPU by 1.3-1.9x."""
MATCH_KEYS = ("pair", "dtype", "sampling", "tree_width", "max_depth", "max_new_tokens", "seed", "prompt_ids")
"""An existing trace is kept on resume only if these meta entries equal the requested ones."""
SETTING_KEYS = ("pair", "sampling", "tree_width", "max_depth", "max_new_tokens", "seed")
"""The ``MATCH_KEYS`` the command line knows before any model loads (dtype and prompt ids need the pair)."""
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_TRACE_DEPTH = 127
"""Depths are stored as int8 and parents as int16: max_depth <= 127, tree_width^2 * max_depth <= 32767."""


class RecordError(DraftpilotError, ValueError):
    """A prompt file or recording request that cannot be recorded as asked (bad prompts, settings that do not
    fit the trace format, an --out holding traces recorded with other settings)."""


def check_record_settings(
    *,
    max_depth: int,
    tree_width: int,
    max_new_tokens: int = 1,
    seed: int = 0,
    samples_per_prompt: int = 1,
    chunk: int = DEFAULT_CHUNK,
) -> None:
    """Every recording setting in range (``InputError`` naming it, with its command-line flag)."""
    for name, value, low in (
        ("max_depth", max_depth, 1),
        ("tree_width", tree_width, 1),
        ("max_new_tokens", max_new_tokens, 1),
        ("seed", seed, 0),
        ("samples_per_prompt", samples_per_prompt, 1),
        ("chunk", chunk, 1),
    ):
        if not is_int(value) or value < low:
            raise InputError(
                f"{name} (--{name.replace('_', '-')}) must be an integer >= {low}, got {value!r}"
            )
    if seed + samples_per_prompt - 1 > MAX_SEED:
        raise InputError(f"seed (--seed) + samples_per_prompt - 1 must stay below 2**64, got seed {seed}")
    if max_depth > MAX_TRACE_DEPTH or tree_width * tree_width * max_depth > 32767:
        raise InputError(
            f"--max-depth {max_depth}, --tree-width {tree_width} do not fit the trace format (max_depth "
            f"<= {MAX_TRACE_DEPTH} and tree_width^2 * max_depth <= 32767)"
        )


def read_prompts(path: str | Path) -> list[dict]:
    """Prompts from JSONL: ``{"id": ..., "prompt": ..., optional "language", "task"}`` per line (errors name
    ``--prompts``, the flag of every command line that reads such a file)."""
    prompts = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or err
        raise RecordError(f"prompt file {path} (--prompts) cannot be read: {reason}") from err
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise RecordError(f"--prompts {path}:{lineno}: not JSON ({err})") from err
        if not isinstance(item, dict) or "id" not in item or not isinstance(item.get("prompt"), str):
            raise RecordError(f"--prompts {path}:{lineno}: each line needs an 'id' and a string 'prompt'")
        prompts.append(item)
    return check_prompts(prompts, f"--prompts {path}")


def check_prompts(prompts: list[dict], where: str) -> list[dict]:
    """Every prompt has a string 'prompt' and an id (a string or an integer) usable in a file name, once."""
    seen = set()
    for item in prompts:
        if not isinstance(item, dict):
            raise RecordError(
                f"{where}: each prompt must be a dict with 'id' and 'prompt', got {type(item).__name__}"
            )
        raw = item.get("id")
        if not (isinstance(raw, str) or is_int(raw)):
            raise RecordError(f"{where}: prompt id must be a string or an integer, got {raw!r}")
        pid = str(raw)
        if not ID_RE.fullmatch(pid) or pid in seen or not isinstance(item.get("prompt"), str):
            raise RecordError(
                f"{where}: prompt id {pid!r} is duplicate, not usable in a file name "
                "([A-Za-z0-9._-]) or has no string 'prompt'"
            )
        seen.add(pid)
    if not prompts:
        raise RecordError(f"{where}: no prompts")
    return prompts


def trace_path(out_dir: str | Path, prompt_id: object, sample: int) -> Path:
    """Where the trace of one prompt and sample lives: ``DIR/<id>__s<sample>.npz``."""
    return Path(out_dir) / f"{prompt_id}__s{sample}.npz"


def mismatched_traces(
    out_dir: str | Path,
    wants: Iterable[tuple[Path, dict]],
    keys: Sequence[str] = MATCH_KEYS,
) -> list[tuple[Path, list[str]]]:
    """(path, differing keys) of every readable trace among ``wants`` ((path, wanted meta)) whose meta differs
    from the wanted one in ``keys``; missing and unreadable files are not listed (recording them loses nothing)."""
    found = []
    for path, want in wants:
        if not path.is_file():
            continue
        try:
            meta = Trace.load(path).meta
        except TraceError:
            continue
        differ = [key for key in keys if meta.get(key) != want[key]]
        if differ:
            found.append((path, differ))
    return found


def refuse_mismatched(found: list[tuple[Path, list[str]]], out_dir: Path) -> None:
    """A ``RecordError`` naming the first of ``found`` (``mismatched_traces``), if there are any."""
    if found:
        path, differ = found[0]
        raise RecordError(
            f"--out {out_dir} already holds {len(found)} trace(s) recorded with other settings "
            f"(e.g. {path.name}: {', '.join(differ)} differ) that this run would record over; use "
            "another --out, or --overwrite (replace_mismatched=True) to record them again"
        )


def trace_matches(path: Path, want: dict) -> bool:
    """Whether ``path`` holds a readable trace whose ``MATCH_KEYS`` equal ``want``'s (kept on resume)."""
    if not path.is_file():
        return False
    try:
        meta = Trace.load(path).meta
    except TraceError:
        return False  # corrupt or old format: record it again
    return all(meta.get(key) == want[key] for key in MATCH_KEYS)


def load_traces(directory: str | Path) -> list[Trace]:
    """Every trace in ``directory`` (sorted by file name); ``TraceError`` if there are none or one is bad."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TraceError(f"trace directory not found: {directory}")
    paths = sorted(
        p for p in directory.glob("*.npz") if not p.name.endswith(".tmp.npz")
    )  # .tmp: crashed save
    if not paths:
        raise TraceError(
            f"no trace files (*.npz) in {directory}: record some with python -m envs.record_traces"
        )
    return [Trace.load(p) for p in paths]
