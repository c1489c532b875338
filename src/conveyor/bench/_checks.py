"""Checks shared by the benchmarks' configurations."""

from __future__ import annotations

from collections.abc import Iterable

from conveyor.errors import InputError

__all__ = ["require_known"]


def require_known(what: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Refuse names in ``given`` that ``known`` lacks, in one line that lists the choices.

    Example:
        >>> require_known("modes", ["off", "fast"], ["off", "flexrr"])
        Traceback (most recent call last):
        ...
        conveyor.errors.InputError: unknown modes ['fast']: choose from off, flexrr
    """
    choices = list(known)
    if unknown := set(given) - set(choices):
        raise InputError(f"unknown {what} {sorted(unknown)}: choose from {', '.join(choices)}")
