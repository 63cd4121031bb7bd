"""What every command line shares: one ``error: ...`` line and exit status 2 for the project's deliberate errors
(``DraftpilotError``) and for files it cannot use (``OSError``), the checks of model and output arguments
that run before any model loads (a bad flag fails in a second, not after minutes of loading or measuring),
and flags generated from config dataclasses (every default and help text written once: a field's help is
the docstring written under it, ``field: int = 3`` then ``\"\"\"what it is\"\"\"``; the flag is ``--field-name``;
booleans get ``--flag`` / ``--no-flag``; ``X | None`` fields accept ``none``), with the config saved as JSON.

    @dataclass
    class ToolConfig(ModelConfig):                 # --pair, --dtype, ..., --device, --threads
        out: str = field(kw_only=True)
        \"\"\"Where to write the result.\"\"\"     # the help of --out

    def main(argv=None) -> int:
        ap = ArgumentParser(prog="python -m tool")
        add_dataclass_args(ap, ToolConfig)
        args = ap.parse_args(argv)                 # argparse errors: one line, exit 2 already
        try:
            config = from_args(ToolConfig, args)   # the dataclass checks its own ranges
            limits = config.check()                # pair, device, formats: before any model loads
            out = check_output_file(config.out)
            pair = config.load()
            ...
        except CLI_ERRORS as err:
            return report_error(err)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.backends.models import load_pair, resolve_device, resolve_dtype, resolve_weights, split_pair
from engine.backends.pair import ModelPair
from engine.backends.random_pair import RANDOM_PAIR_CONFIGS
from engine.backends.tiny import tiny_config
from engine.backends.weights import DEFAULT_PAIRS
from engine.errors import DraftpilotError, InputError, is_int

CLI_ERRORS = (DraftpilotError, OSError)
"""What a command line reports as one line: deliberate errors and unusable files; anything else is a bug and
keeps its traceback."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's failure shape: a bad flag (unknown, missing value, wrong type) prints one
    line ``error: <what is wrong>`` to stderr and exits 2, like every other refused input (``--help`` still
    prints the usage). The description is printed as written (``RawDescriptionHelpFormatter``): every command
    passes its module docstring, examples included."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D102 - argparse's hook
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)


def report_error(err: BaseException, stream=None) -> int:
    """Print ``error: <message>`` (one line) to stderr and return the exit status 2."""
    message = " ".join(str(err).split()) or type(err).__name__
    print(f"error: {message}", file=stream or sys.stderr)
    return 2


def warn(message: str, stream=None) -> None:
    """Print ``warning: <message>`` (one line) to stderr."""
    print("warning: " + " ".join(message.split()), file=stream or sys.stderr)


@dataclass(frozen=True)
class PairLimits:
    """What a named pair allows, known from its configuration without loading weights."""

    vocab_size: int
    max_context: int


def pair_limits(name: str) -> PairLimits:
    """Vocabulary and context limit of a named pair (``InputError`` for an unknown name)."""
    if name == "tiny":
        config = tiny_config()
        return PairLimits(config.vocab_size, config.max_position_embeddings)
    if name not in DEFAULT_PAIRS or name not in RANDOM_PAIR_CONFIGS:
        raise InputError(
            f"--pair {name!r} is not a known pair; known: tiny, {', '.join(sorted(DEFAULT_PAIRS))}"
        )
    target, draft = RANDOM_PAIR_CONFIGS[name]
    return PairLimits(
        min(target["vocab_size"], draft["vocab_size"]),
        min(target["max_position_embeddings"], draft["max_position_embeddings"]),
    )


def check_device(device: str) -> torch.device:
    """``--device``: auto, cpu, cuda or cuda:N, and present on this machine."""
    try:
        dev = resolve_device(device)
    except (RuntimeError, ValueError) as err:
        raise InputError(
            f"--device {device!r} is not a device ({err}); use auto, cpu, cuda or cuda:N"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r}: only cpu and cuda are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(
                f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


def check_pair_args(
    pair: str | None,
    device: str = "auto",
    *,
    dtype: str = "auto",
    weights: str | None = "auto",
    draft_weights: str | None = "auto",
    draft_vocab: int | None = 0,
    custom: bool = False,
) -> PairLimits | None:
    """Check the arguments of ``load_pair`` that can be checked without loading anything: the pair name
    (unless ``custom``: --target/--draft were given), device, dtype, weight formats and --draft-vocab.
    Returns the named pair's limits (None for a custom pair)."""
    limits = None if custom else pair_limits(str(pair))
    dev = check_device(device)
    for flag, call in (
        ("--dtype", lambda: resolve_dtype(dtype, dev)),
        ("--weights", lambda: resolve_weights(weights, dtype, dev)),
        (
            "--draft-weights",
            lambda: draft_weights in (None, "auto") or resolve_weights(draft_weights, "auto", dev),
        ),
    ):
        if flag == "--dtype" and dtype == "auto":
            continue
        try:
            call()
        except ValueError as err:
            raise InputError(f"{flag}: {err}") from None
    if draft_vocab is not None and (
        not is_int(draft_vocab) or draft_vocab < 0 or (limits is not None and draft_vocab > limits.vocab_size)
    ):
        bound = f" in [1, {limits.vocab_size}]" if limits is not None else " >= 1"
        raise InputError(
            f"--draft-vocab: the draft vocabulary size must be 0 (all tokens) or an integer{bound}, "
            f"got {draft_vocab!r}"
        )
    return limits


def check_model_path(value: str | os.PathLike, flag: str) -> None:
    """A model given by local directory or Hugging Face hub id (``--target``, ``--draft``, either side of
    ``--pair TARGET::DRAFT``), checked before anything loads: an existing path must be a readable model
    directory (one with a config.json); a path that does not exist must at least be a valid hub id (not a
    local-looking path such as ``/models/x`` or ``./x``), and be in the local cache when the hub is offline."""
    text = str(value)
    if not text.strip():
        raise InputError(f"{flag}: the model path is empty")
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputError(
                f"{flag} {text}: not a model directory (a file; give the directory with config.json)"
            )
        config = path / "config.json"
        if not config.is_file():
            raise InputError(f"{flag} {text}: not a model directory (no config.json in it)")
        if not os.access(config, os.R_OK) or not os.access(path, os.R_OK | os.X_OK):
            raise InputError(f"{flag} {text}: the model directory cannot be read (permission denied)")
        return
    if text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text:
        raise InputError(f"{flag} {text}: no such model directory")
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        raise InputError(
            f"{flag} {text!r}: no such model directory, and not a Hugging Face hub id (org/name)"
        ) from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline and not isinstance(try_to_load_from_cache(text, "config.json"), str):
        raise InputError(
            f"{flag} {text}: no such model directory, and the hub id is not in the local Hugging Face "
            "cache (HF_HUB_OFFLINE is set)"
        )


def check_pair_spec(
    pair: str,
    device: str = "auto",
    *,
    dtype: str = "auto",
    weights: str | None = "auto",
    draft_weights: str | None = "auto",
    draft_vocab: int | None = 0,
) -> PairLimits | None:
    """``check_pair_args`` for a run config's ``pair``: a named pair, or ``TARGET::DRAFT`` (model paths or hub
    ids, each checked by ``check_model_path``); errors name ``--pair``."""
    paths = split_pair(str(pair))
    custom = paths is not None
    if custom:
        target, draft = paths
        check_model_path(target, "--pair (target)")
        check_model_path(draft, "--pair (draft)")
    return check_pair_args(
        pair,
        device,
        dtype=dtype,
        weights=weights,
        draft_weights=draft_weights,
        draft_vocab=draft_vocab,
        custom=custom,
    )


def check_positive(**values: object) -> None:
    """Each named value must be an integer >= 1 (``check_positive(reps=3)``); the flag is named in the error."""
    for name, value in values.items():
        if not is_int(value) or value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")


def check_output_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """A file the command will write at the end: not a directory, and its directory exists or can be made and
    takes new files (checked by creating and removing a temporary file there, so it holds for root and for
    read-only file systems alike). The directory is created if missing."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{flag} {path} is a directory; give a file name")
    _check_writable_dir(path.parent, f"{flag} {path}")
    return path


def check_output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """A directory the command will write files into: created if missing, must take new files."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path} exists and is not a directory")
    _check_writable_dir(path, f"{flag} {path}")
    return path


def _check_writable_dir(directory: Path, what: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"{what}: cannot create the directory {directory} ({err.strerror or err})") from None
    try:
        fd, name = tempfile.mkstemp(prefix=".write-check.", dir=directory)
    except OSError as err:
        raise InputError(f"{what}: cannot write in {directory} ({err.strerror or err})") from None
    os.close(fd)
    os.unlink(name)


@dataclass
class ModelConfig:
    """The model pair and where it runs: the fields of every command line that loads a pair (``train.py``,
    ``evaluate.py``, ``generate.py``, ``python -m engine.costs.measure_costs``, ``python -m envs.record_traces``),
    each of whose configs extends this one."""

    pair: str = "qwen2.5-coder"
    """Model pair: a named pair (qwen2.5-coder, tiny) or "TARGET::DRAFT" paths / hub ids."""
    dtype: str = "auto"
    """Dense model dtype when no integer weight format is asked for (float32, bfloat16, ...)."""
    weights: str = "auto"
    """Weight format of the target's linears (auto: kquant on CPU -- int4 where the compiled kernels cannot be
    built -- bfloat16 on CUDA, or the --dtype named; float32, bfloat16, int8, int4, int4-strict, kquant,
    kquant-strict)."""
    draft_weights: str = "auto"
    """Weight format of the draft's linears (auto: kquant-strict when --weights is auto on CPU, else as --weights)."""
    draft_vocab: int = 0
    """Tokens the draft's LM head keeps (0: the whole vocabulary); a cheaper draft step, exact either way."""
    device: str = "auto"
    """auto (CUDA when present), cpu, cuda, cuda:N."""
    threads: int = 0
    """torch intra-op threads for the models (0: torch's default)."""

    def __post_init__(self) -> None:
        if not is_int(self.threads) or self.threads < 0:
            raise InputError(
                f"threads (--threads) must be an integer >= 0 (0: torch's default), got {self.threads!r}"
            )

    def format_kwargs(self) -> dict[str, Any]:
        """The weight-format arguments of ``load_pair``."""
        return dict(
            dtype=self.dtype,
            weights=self.weights,
            draft_weights=self.draft_weights,
            draft_vocab=self.draft_vocab,
        )

    def check(self) -> PairLimits | None:
        """Everything about the pair that can be checked before a model loads (``check_pair_spec``); the
        named pair's limits, None for TARGET::DRAFT."""
        return check_pair_spec(self.pair, self.device, **self.format_kwargs())

    def load(self, **kwargs: Any) -> ModelPair:
        """Set torch's threads (when > 0), then ``load_pair`` (extra ``kwargs``: e.g. ``random_weights``)."""
        if self.threads:
            torch.set_num_threads(self.threads)
        return load_pair(self.pair, device=self.device, **self.format_kwargs(), **kwargs)
