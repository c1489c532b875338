"""Leases for ``conveyor train --lease FILE``: a JSON file ``{"until": UNIX_SECONDS}`` a scheduler rewrites."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from conveyor.errors import InputError

__all__ = ["lease_expires", "read_lease", "write_lease"]


def read_lease(path: str | os.PathLike[str]) -> float:
    """The ``until`` (UNIX seconds) of the lease file at ``path``.

    Raises:
        ValueError: the file is missing, unreadable, or holds no number ``until`` (one line, naming the option).
    """
    try:
        until = json.loads(Path(path).read_text())["until"]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        raise InputError(
            f'--lease {path}: cannot read the lease ({why}): write JSON {{"until": UNIX_SECONDS}}'
        ) from None
    if isinstance(until, bool) or not isinstance(until, int | float):
        raise InputError(f'--lease {path}: "until" is {until!r}, not a number: write JSON {{"until": UNIX_SECONDS}}')
    return float(until)


def write_lease(path: str | os.PathLike[str], until: float) -> None:
    """Atomically (a temporary file beside it, then a rename) write a lease ending at ``until`` to ``path``.

    A running job reads either the old lease or the new one, never a torn file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"until": until}, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def lease_expires(until: float, epoch_s: float, now: float) -> bool:
    """Whether another epoch as long as the last (``epoch_s``, evaluation included) would end past ``until``.

    Example:
        >>> lease_expires(until=100.0, epoch_s=5.0, now=90.0), lease_expires(until=100.0, epoch_s=5.0, now=96.0)
        (False, True)
    """
    return now + epoch_s > until
