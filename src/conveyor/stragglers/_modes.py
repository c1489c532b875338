"""The straggler modes of ``conveyor train --stragglers``: which of slack, reassignment and backups each turns
on, and the layouts they apply to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from conveyor.errors import InputError

__all__ = ["MODES", "ModeSettings", "flexible_layout", "mode_settings"]

# FlexRR is slack and reassignment (Harlap et al., SoCC 2016); backup is reassignment and backups, synchronous.
MODES = ("flexrr", "slack", "reassign", "backup", "off")


class ModeSettings(NamedTuple):
    """What a straggler mode turns on."""

    slack: int
    reassign: bool
    backup: bool


def mode_settings(mode: str, slack: int) -> ModeSettings:
    """The settings of ``mode``, with slack ``slack`` where it applies.

    Example:
        >>> [tuple(mode_settings(m, 2)) for m in MODES]
        [(2, True, False), (2, False, False), (0, True, False), (0, True, True), (0, False, False)]
    """
    if mode not in MODES:
        raise InputError(f"unknown straggler mode {mode!r}: use one of {', '.join(MODES)}")
    if slack < 1 and mode in ("flexrr", "slack"):
        raise InputError(f"--stragglers {mode} needs --slack of at least 1, got {slack}")
    return ModeSettings(
        slack=slack if mode in ("flexrr", "slack") else 0,
        reassign=mode in ("flexrr", "reassign", "backup"),
        backup=mode == "backup",
    )


def flexible_layout(replicas: Sequence[int]) -> bool:
    """Whether a layout's replicas can share work: its first stage alone is replicated (data parallelism is one
    stage).

    Example:
        >>> [flexible_layout(r) for r in ([4], [2, 1], [2, 1, 1], [1, 2], [1])]
        [True, True, True, False, False]
    """
    return replicas[0] > 1 and max(replicas[1:], default=1) == 1
