"""Flags generated from config dataclasses, and the config saved as JSON (every command line imports them from
here): every default and help text written once. A field's help is the docstring written under it
(``field: int = 3`` then ``\"\"\"what it is\"\"\"``); the flag is ``--field-name``; booleans get ``--flag`` /
``--no-flag``; ``X | None`` fields accept ``none``; ``tuple[int, ...]`` fields take comma-separated integers; a
field without a default is a required flag. Presets (``--quick``) go through ``apply_preset``: explicit flags win."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from engine.backends.files import atomic_write_json
from engine.errors import DraftpilotError


class ConfigFileError(DraftpilotError, ValueError):
    """A saved config file that cannot be read back (not JSON, not an object, fields this code does not know)."""


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal right after each annotated field)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:] + [None]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(scalar type, accepts None) of a field annotation such as ``int``, ``str | None``,
    ``tuple[int, ...]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def int_tuple(text: str) -> tuple[int, ...]:
    """A ``tuple[int, ...]`` field's flag value: comma-separated integers (``--contexts 128,512``)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def _parser_for(kind: Any, optional: bool):
    convert = int_tuple if typing.get_origin(kind) is tuple else kind

    def parse(text: str):
        if optional and text.lower() in ("none", ""):
            return None
        return convert(text)

    parse.__name__ = "int_list" if convert is int_tuple else kind.__name__  # argparse names it in errors
    return parse


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, group: str | None = None) -> None:
    """One flag per field of ``cls`` (a dataclass with string-evaluable annotations); a field without a
    default (``field(kw_only=True)``) is a required flag, a ``tuple[int, ...]`` one takes comma-separated
    integers."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    target = parser.add_argument_group(group) if group else parser
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required:
            default, help_text = None, f"{docs.get(f.name, '')} (required)".replace("%", "%%")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            help_text = f"{docs.get(f.name, '')} (default: {_show(default)})".replace("%", "%%")
        kind, optional = _base_type(hints[f.name])
        if dataclasses.is_dataclass(kind):  # nested config: its own flags, added by the caller
            continue
        if kind is bool:
            target.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=docs.get(f.name, "").replace("%", "%%"),
            )
        else:
            target.add_argument(
                flag,
                dest=f.name,
                type=_parser_for(kind, optional),
                default=default,
                required=required,
                metavar="INTS" if typing.get_origin(kind) is tuple else kind.__name__.upper(),
                help=help_text,
            )


def apply_preset(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str], preset: dict[str, Any]
) -> None:
    """Set ``preset`` values on ``args`` for every flag not given explicitly in ``argv`` (``--flag v`` or
    ``--flag=v``): a preset such as ``--quick`` replaces defaults, never the user's flags."""
    given = given_flags(parser, argv)
    for key, value in preset.items():
        if key not in given:
            setattr(args, key, value)


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The ``dest`` of every option written in ``argv`` (``--flag v``, ``--flag=v``, ``--no-flag``)."""
    return {
        a.dest
        for a in parser._actions
        if any(opt in argv or any(x.startswith(opt + "=") for x in argv) for opt in a.option_strings)
    }


def from_args(cls: type, args: argparse.Namespace, **overrides: Any):
    """Build ``cls`` from parsed flags (fields missing in ``args`` keep their defaults)."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)


def save_config(config: Any, path: str | Path) -> Path:
    """The config as JSON (saved next to every checkpoint and report), written atomically: a kill leaves the
    previous file or the new one, never part of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(path, dataclasses.asdict(config), indent=1, default=str)


def load_config(cls: type, path: str | Path):
    """Read a config saved by ``save_config``; unknown keys are an error (a config from other code).
    Raises ``ConfigFileError`` for a file that is not such a config (``FileNotFoundError`` if missing)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ConfigFileError(f"{path} is not a readable config file ({err})") from err
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path} is not a {cls.__name__} config (top level is {type(data).__name__})")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigFileError(f"{path}: unknown {cls.__name__} fields {unknown}")
    try:
        return cls(**data)
    except TypeError as err:
        raise ConfigFileError(f"{path} is not a valid {cls.__name__} config ({err})") from err
