"""What a cost profile measurement measures (``ProfileConfig``: the grids, repetitions and the batch axis),
checked before any model loads; ``engine.costs.measure_costs`` measures it and gives it its flags."""

from __future__ import annotations

from dataclasses import dataclass

from engine.backends.attention import MAX_ROWWISE_ROWS, MAX_VERIFY_NODES
from engine.costs.speedup_model import MEASURED_SIZES
from engine.errors import InputError, is_int
from engine.tree import MAX_TREE_NODES


@dataclass(frozen=True)
class ProfileConfig:
    """What to measure (grids) and how often."""

    contexts: tuple[int, ...] = (128, 512, 1024, 2048)
    """Context lengths (committed tokens); also the prefill lengths."""
    widths: tuple[int, ...] = (1, 2, 4, 8)
    """Frontier widths of the later draft steps."""
    chunks: tuple[int, ...] = (1, 2, 3, 5, 9)
    """Pending-token counts of the first draft step (usually 1 or 2; more after autoregressive steps)."""
    sizes: tuple[int, ...] = MEASURED_SIZES
    """Verified-node counts (default: the root alone and the size ladder, ``speedup_model.MEASURED_SIZES``)."""
    reps: int = 5
    """Timed rounds (every cell is called once per round, in a fresh random order)."""
    warmup: int = 1
    """Untimed rounds before the timed ones."""
    prefill_reps: int = 2
    """Timed prefills per length (each also builds the cache the cells of that context use)."""
    overhead_cycles: int = 8
    """Engine cycles measured per overhead configuration."""
    overhead_prompt_len: int = 32
    """Prompt length of the overhead runs (short: overhead hardly depends on context, prefill is slow)."""
    seed: int = 0
    """Seeds the random token ids and the order in which the cells are timed."""
    batch_axis: bool = False
    """Also time batched forwards (``engine.batch_forward.forward_rows``: several sequences, each on its own
    cache, in one forward) by sequences and rows per sequence at ``batch_context``: the profile's ``batched``
    table. Off by default (the replay environments and training do not use it)."""
    batch_sequences: tuple[int, ...] = (1, 2, 4, 8)
    """Sequences of the batched forwards (with ``batch_axis``)."""
    batch_rows: tuple[int, ...] = (1, 2, 4, 8)
    """Rows per sequence of the batched forwards (with ``batch_axis``): the target verifies a root and a chain
    of rows - 1 nodes; the draft runs a frontier of that many nodes at one depth (a draft step)."""
    batch_context: int = 0
    """Context (committed tokens of every sequence) of the batched forwards: one of ``contexts``; 0: the
    median one, ``contexts[(len(contexts) - 1) // 2]``."""

    def __post_init__(self) -> None:
        """Ranges that hold for every pair (``check_fits`` adds the pair's context and vocabulary)."""
        for name, low, high in (
            ("contexts", 1, None),
            ("widths", 1, MAX_TREE_NODES),
            ("chunks", 1, None),
            ("sizes", 0, MAX_VERIFY_NODES),
            ("batch_sequences", 1, None),
            ("batch_rows", 1, MAX_ROWWISE_ROWS),
        ):
            grid = getattr(self, name)
            if (
                not isinstance(grid, (tuple, list))
                or not grid
                or not all(is_int(v) for v in grid)
                or list(grid) != sorted(set(grid))
                or grid[0] < low
                or (high is not None and grid[-1] > high)
            ):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{name} ({flag}) must be distinct ascending integers {bound}, got {grid!r}")
        for name, low in (
            ("reps", 1),
            ("warmup", 0),
            ("prefill_reps", 1),
            ("overhead_cycles", 1),
            ("overhead_prompt_len", 1),
            ("seed", 0),
        ):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{name} ({flag}) must be an integer >= {low}, got {value!r}")
        if not isinstance(self.batch_axis, bool):
            raise InputError(f"batch_axis (--batch-axis) must be True or False, got {self.batch_axis!r}")
        if not is_int(self.batch_context) or (self.batch_context and self.batch_context not in self.contexts):
            raise InputError(
                f"batch_context (--batch-context) must be 0 or one of the contexts {self.contexts}, got "
                f"{self.batch_context!r}"
            )
        if self.contexts[0] <= self.chunks[-1]:
            raise InputError(
                f"contexts (--contexts) must all exceed the largest chunk ({self.chunks[-1]}): the "
                f"first draft step runs the chunk on top of the context, got {self.contexts}"
            )

    def check_fits(self, max_context: int, vocab_size: int, where: str = "this pair") -> None:
        """The grids fit a pair with this context limit and vocabulary (``InputError`` otherwise)."""
        rows = max(self.sizes[-1] + 1, self.widths[-1], self.chunks[-1])
        if self.batch_axis:
            rows = max(rows, self.batch_rows[-1])
        if self.contexts[-1] + rows > max_context:
            raise InputError(
                f"contexts (--contexts) must lie in ({self.chunks[-1]}, {max_context - rows}] for "
                f"{where} (context limit {max_context}) and this grid, got {self.contexts}"
            )
        if self.widths[-1] > vocab_size:
            raise InputError(
                f"widths (--widths) must not exceed the vocabulary of {where} ({vocab_size} tokens), "
                f"got {self.widths}"
            )
        if self.overhead_prompt_len >= max_context:
            raise InputError(
                f"overhead_prompt_len (--overhead-prompt-len) must be below the context limit of "
                f"{where} ({max_context}), got {self.overhead_prompt_len}"
            )

    @property
    def batch_ctx(self) -> int:
        """The context of the batched forwards (``batch_context``, 0 resolved)."""
        return self.batch_context or self.contexts[(len(self.contexts) - 1) // 2]

    @classmethod
    def quick(cls) -> ProfileConfig:
        """Seconds on the tiny pair; a plumbing check elsewhere."""
        return cls(
            contexts=(64, 256),
            widths=(1, 2),
            chunks=(1, 2),
            sizes=(0, 1, 4, 16),
            reps=2,
            warmup=1,
            prefill_reps=1,
            overhead_cycles=3,
            overhead_prompt_len=16,
        )
