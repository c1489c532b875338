"""The error Conveyor raises for bad input.

:class:`InputError` is what every deliberate check of an input raises: an option, a file, a spec, an argument
of the Python API. The ``conveyor`` command prints its message as one line (exit 2); any other exception,
a ``ValueError`` from PyTorch or NumPy included, is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """Bad input, described in one line that says how to fix it (a ``ValueError``, so code that catches those
    catches it)."""
