"""The error Conveyor raises for bad input.

:class:`InputError` is what every deliberate check of an input raises: an option, a file, a spec, an argument
of the Python API. The ``conveyor`` command prints its message as one line (exit 2); any other exception,
a ``ValueError`` from PyTorch or NumPy included, is a bug and keeps its traceback.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

__all__ = ["InputError", "check_amounts"]


class InputError(ValueError):
    """Bad input, described in one line that says how to fix it (a ``ValueError``, so code that catches those
    catches it)."""


def check_amounts(values: Mapping[str, float], *, what: str, positive: Collection[str] = ()) -> None:
    """Refuse any of ``values`` (seconds, counts, rates: amounts by name) that is negative, infinite or NaN,
    and any named in ``positive`` that is 0; ``what`` names them in the message ("cost", "overhead")."""
    for name, value in values.items():
        if not (value >= 0 and math.isfinite(value)):
            raise InputError(f"{what} {name} must be a finite number >= 0, got {value}")
    if zero := [name for name in positive if values[name] == 0]:
        raise InputError(f"{what} {' and '.join(zero)} must be > 0")
