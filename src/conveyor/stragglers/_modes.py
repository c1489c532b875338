"""The layouts the straggler modes of ``conveyor train --stragglers`` apply to (the modes themselves, and what
each turns on: :func:`conveyor.config.mode_settings`)."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.config import Chunks, check_chunks
from conveyor.errors import InputError
from conveyor.runtime import WorldSizeError

__all__ = ["check_flexible", "flexible_layout"]


def flexible_layout(replicas: Sequence[int]) -> bool:
    """Whether a layout's replicas can share work: its first stage alone is replicated (data parallelism is one
    stage).

    Example:
        >>> [flexible_layout(r) for r in ([4], [2, 1], [2, 1, 1], [1, 2], [1])]
        [True, True, True, False, False]
    """
    return replicas[0] > 1 and max(replicas[1:], default=1) == 1


def check_flexible(counts: tuple[int, ...], *, world: int, chunks: Chunks, slack: int, backup: bool) -> tuple[int, ...]:
    """``counts`` (replicas per stage), once a flexible pipeline can run them on ``world`` workers with these
    settings; else a one-line error that says what to change.

    Example:
        >>> check_flexible((2, 1), world=3, chunks="auto", slack=0, backup=True)
        (2, 1)
        >>> check_flexible((1, 2), world=3, chunks=2, slack=1, backup=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        conveyor.errors.InputError: only the first stage may be replicated here, got 1-2: put the replicas on ...
    """
    check_chunks(chunks)
    if slack < 0:
        raise InputError(f"slack must be at least 0, got {slack}")
    if backup and slack:  # a replica running ahead does not wait for a stalled peer's chunk to back it up
        raise InputError(f"backups need synchronous updates (slack 0), got slack={slack}")
    layout = "-".join(map(str, counts))
    if max(counts[1:], default=1) > 1:
        raise InputError(
            f"only the first stage may be replicated here, got {layout}: put the replicas on "
            "stage 0 (e.g. 2-1), or run the layout with --stragglers off"
        )
    if sum(counts) != world:
        raise WorldSizeError(
            f"replicas {layout} need {sum(counts)} workers but {world} were started: start "
            f"{sum(counts)} or change the replicas"
        )
    return counts
