"""The straggler modes of ``conveyor train --stragglers``: which of slack and reassignment each turns on, and
the layouts they apply to."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.errors import InputError

__all__ = ["MODES", "flexible_layout", "mode_settings"]

MODES = ("flexrr", "slack", "reassign", "off")  # FlexRR is both (Harlap et al., SoCC 2016)


def mode_settings(mode: str, slack: int) -> tuple[int, bool]:
    """The slack and whether to reassign work, for ``mode`` with slack ``slack`` where it applies.

    Example:
        >>> [mode_settings(m, 2) for m in MODES]
        [(2, True), (2, False), (0, True), (0, False)]
    """
    if mode not in MODES:
        raise InputError(f"unknown straggler mode {mode!r}: use one of {', '.join(MODES)}")
    if slack < 1 and mode in ("flexrr", "slack"):
        raise InputError(f"--stragglers {mode} needs --slack of at least 1, got {slack}")
    return (slack if mode in ("flexrr", "slack") else 0), mode in ("flexrr", "reassign")


def flexible_layout(replicas: Sequence[int]) -> bool:
    """Whether a layout's replicas can share work: its first stage alone is replicated (data parallelism is one
    stage).

    Example:
        >>> [flexible_layout(r) for r in ([4], [2, 1], [2, 1, 1], [1, 2], [1])]
        [True, True, True, False, False]
    """
    return replicas[0] > 1 and max(replicas[1:], default=1) == 1
