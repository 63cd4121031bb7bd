"""One reading of ``--policy`` for the three commands that take it: ``parse_policy`` tells what a value names
(a ``PolicyChoice``), ``check_policy`` checks it before any model loads, ``select_controller`` builds it (a
``Selection``: a fresh controller per call, its description, the context lookup the policy was trained with).

What a value means, per command (the parameters say where they differ; "static" is the command's
``--depth``/``--verify``/``--tree-width`` setting):

* absent: ``serve.py`` has none (its default is ``auto``); ``generate.py``: static; ``evaluate.py``: the
  newest ``runs/*/policy.pt``. ``generate.py`` and ``evaluate.py`` read ``none`` (any case) and an empty
  value as absent (``engine.config_flags``: their flag is optional).
* ``none``: ``serve.py``: static (``none`` only: ``None`` is a file name there).
* ``auto``: ``serve.py``: ``runs/main/policy.pt`` when it exists and was trained for the pair, else static.
* ``analytic`` / ``analytic:FILE``, ``goodput`` / ``goodput:FILE``: ``serve.py``: ``AnalyticController`` /
  ``GoodputController`` given the load (below).
* ``table:FILE``: ``serve.py``: ``BatchSizeTableController`` of a per-batch-size table file (vLLM's format).
* any other value, and at ``generate.py`` and ``evaluate.py`` every value: a policy file (``load_policy``).

``serve.py`` reads the keywords ``SERVE_KEYWORDS``; ``generate.py`` and ``evaluate.py`` read none.
``evaluate.py`` finds the newest policy itself (``evaluation.config.find_policy``) and its learned row loads
the file itself (``evaluation.eval_setup``: with the device's cost profile); its analytic and goodput rows
are ``--controllers`` names, not ``--policy`` values.

``analytic`` and ``goodput`` cost their choices with ``--profile``, else with the cost profile of the policy
file ``FILE`` (``analytic:FILE``), else of ``runs/main/policy.pt`` (``DEFAULT_POLICY``), and take that
policy's settings (tree width, depth cap, trained lookup), as the main job's analytic baseline ran.
Every refusal is an ``InputError`` naming ``--policy`` (the command lines print it as one line, exit 2)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.cli import CLI_ERRORS, warn
from engine.costs.cost_profile import CostProfile, load_profile_arg
from engine.errors import InputError
from engine.lookup import LookupConfig
from policies.analytic import AnalyticController
from policies.goodput import GoodputController
from policies.learned import load_policy
from policies.learned_controller import LearnedController, stored_profile
from policies.static import BatchSizeTableController, read_table

if TYPE_CHECKING:
    import torch

    from engine.backends.pair import ModelPair

DEFAULT_POLICY = Path("runs/main/policy.pt")
"""Where ``train.py`` exports the main job's policy: ``auto`` uses it when it exists; ``analytic`` and
``goodput`` without a file or ``--profile`` take its cost profile."""
SERVE_KEYWORDS = ("auto", "none", "analytic", "goodput", "table")
"""The keyword values ``serve.py`` reads (every other value is a policy file)."""
PROFILED = ("analytic", "goodput")
"""The kinds costed with a cost profile (``--profile`` or a policy file's)."""
KINDS = ("auto", "none", "analytic", "goodput", "table", "file", "newest")


@dataclass(frozen=True)
class PolicyChoice:
    """What a ``--policy`` value names: ``kind`` (``KINDS``: "none" is the static setting, "file" a policy
    file, "newest" the newest ``runs/*/policy.pt``), its file (``path``: ``FILE`` of ``kind:FILE``, the
    policy file; else None) and the value as given (``value``, for the messages)."""

    kind: str
    path: str | None = None
    value: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


def parse_policy(value: str | None, keywords: Collection[str] = (), absent: str = "none") -> PolicyChoice:
    """What ``value`` names. ``keywords``: the keyword values the command reads (``SERVE_KEYWORDS`` for
    ``serve.py``; none for ``generate.py`` and ``evaluate.py``, where every value is a policy file);
    ``absent``: the kind of no value (None), "none" (the static setting, ``generate.py``) or "newest"
    (``evaluate.py``). A keyword that needs a file and has none is an ``InputError``."""
    if absent not in ("none", "newest"):
        raise ValueError(f"absent must be none or newest, got {absent!r}")
    unknown = set(keywords) - set(SERVE_KEYWORDS)
    if unknown:
        raise ValueError(f"unknown keywords {sorted(unknown)}; known: {', '.join(SERVE_KEYWORDS)}")
    if value is None:
        return PolicyChoice(absent)
    if value in keywords and value in ("auto", "none", *PROFILED):
        return PolicyChoice(value, None, value)
    kind, colon, path = value.partition(":")
    if kind in keywords and kind in (*PROFILED, "table") and colon:
        if not path:
            raise InputError(f"--policy {kind}:FILE needs its file, got {value!r}")
        return PolicyChoice(kind, path, value)
    if value == "table" and "table" in keywords:
        raise InputError("--policy table needs its file: table:FILE (a per-batch-size table JSON)")
    return PolicyChoice("file", value, value)


def read_policy_table(choice: PolicyChoice) -> dict[int, int]:
    """``table:FILE``'s table, checked as vLLM checks it (``policies.static.read_table``): the first batch
    size of each range -> its depth (a gap or the sizes past the last range keep the previous depth)."""
    try:
        return read_table(choice.path)
    except ValueError as err:
        raise InputError(f"--policy {choice.value}: {err}") from None


def policy_profile(
    choice: PolicyChoice, profile: str | None = None, default_policy: str | Path = DEFAULT_POLICY
) -> tuple[CostProfile, str, LearnedController | None]:
    """The cost profile ``analytic`` and ``goodput`` cost their choices with: ``profile`` (a ``--profile``
    file), else the one the policy file carries (``FILE``, else ``default_policy``). (profile, where it comes
    from, that policy or None)."""
    path = choice.path
    if profile is not None:
        if path is not None:
            raise InputError(f"--policy {choice.value} and --profile both give the cost profile: give one")
        return load_profile_arg(profile), profile, None
    if path is None:
        if not Path(default_policy).is_file():
            raise InputError(
                f"--policy {choice.kind} needs a cost profile: --profile FILE (python -m "
                "engine.costs.measure_costs --batch-axis --out FILE), "
                f"--policy {choice.kind}:POLICY_FILE, or a trained {default_policy}"
            )
        path = str(default_policy)
    try:
        template = load_policy(path)
    except CLI_ERRORS as err:
        raise InputError(f"--policy {choice.value}: {err}") from None
    loaded = stored_profile(template.meta.get("profile"))
    if loaded is None:
        raise InputError(
            f"--policy {choice.value}: {path} carries no cost profile this code reads; give --profile FILE"
        )
    return loaded, path, template


def check_policy(
    choice: PolicyChoice, profile: str | None = None, default_policy: str | Path = DEFAULT_POLICY
) -> None:
    """What can be checked of ``choice`` before any model loads: the policy file is there, the table file
    reads, the cost profile of ``analytic``/``goodput`` loads; ``profile`` (``--profile``) only with those."""
    if choice.kind == "file" and not os.path.isfile(choice.path):
        raise InputError(f"--policy: no file {choice.path}")
    if choice.kind == "table":
        read_policy_table(choice)
    if choice.kind in PROFILED:
        policy_profile(choice, profile, default_policy)
    elif profile is not None:
        raise InputError(
            f"--profile is the cost profile of --policy analytic or goodput; --policy {choice.value} uses none"
        )


class Selection(NamedTuple):
    """What ``select_controller`` builds: ``make()`` gives a fresh controller (None: autoregressive) at each
    call, ``description`` says which, ``trained_lookup`` is the context lookup the policy was trained with
    (None: none or no policy)."""

    make: Callable[[], Any]
    description: str
    trained_lookup: LookupConfig | None


def select_controller(
    choice: PolicyChoice,
    static: Callable[[], Any],
    *,
    autoregressive: bool = False,
    tree_width: int = 1,
    profile: str | None = None,
    default_policy: str | Path = DEFAULT_POLICY,
    pair: ModelPair | None = None,
    device: str | torch.device = "cpu",
) -> Selection:
    """The controllers ``choice`` names. ``static()``: the command's static controller (``none``, and
    ``auto`` without a usable main policy); ``autoregressive``: no controller whatever ``choice`` says;
    ``tree_width``: the width of ``table`` and of ``analytic`` costed with ``profile`` (``--profile``);
    ``pair``: the loaded pair (a policy trained for another pair: a warning, and ``auto`` falls back to the
    static setting) or None (not loaded yet: no pair check); ``device``: where a policy file's networks run.
    Raises ``InputError`` for what cannot be built (``--policy: ...``)."""
    if autoregressive:
        return Selection(lambda: None, "autoregressive", None)
    kind, path = choice.kind, choice.path
    if kind in PROFILED:
        loaded, source, template = policy_profile(choice, profile, default_policy)
        if kind == "analytic":
            options, trained = {"tree_width": tree_width}, None
            if template is not None:  # the settings the policy's own analytic baseline ran with
                options = {"tree_width": template.tree_width, "max_depth": template.max_depth}
                trained = template.trained_lookup
                if pair is not None and (message := template.pair_warning(pair)):
                    warn(f"--policy {choice.value}: its cost profile comes from {source}: {message}")
            controller, built = AnalyticController, AnalyticController(loaded, **options)
        else:
            options = {"max_depth": template.max_depth} if template is not None else {}
            trained = template.trained_lookup if template is not None else None
            controller, built = GoodputController, GoodputController(loaded, **options)
        if not built.loads.available:
            warn(
                f"--policy {choice.value}: the cost profile ({source}) has no batch axis, so the {kind} "
                "controller costs every choice as alone (measure one with --batch-axis)"
            )
        return Selection(lambda: controller(loaded, **options), f"{built!r} profile={source}", trained)
    if kind == "table":
        table = BatchSizeTableController(read_policy_table(choice), tree_width=tree_width)
        return Selection(lambda: copy.deepcopy(table), f"{table!r} from {path}", None)
    if kind == "newest":
        raise ValueError("the newest runs/*/policy.pt is the evaluation's to find (evaluation.config)")
    auto = kind == "auto"
    path = str(default_policy) if auto else path
    if path is not None and (not auto or Path(default_policy).is_file()):
        try:
            template = load_policy(path, device=device, pair=None if auto else pair)
        except CLI_ERRORS as err:
            raise InputError(f"--policy: {err}") from None
        message = template.pair_warning(pair) if auto and pair is not None else None
        if message:  # the main job's policy is for another pair: the static setting instead
            warn(f"--policy auto: not using {path}: {message}")
        else:
            return Selection(lambda: copy.deepcopy(template), f"policy {path}", template.trained_lookup)
    built = static()
    return Selection(lambda: copy.deepcopy(built), repr(built), None)
