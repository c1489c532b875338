"""Where Conveyor keeps what outlives a run: the user's data directory."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "data_dir"]


def data_dir() -> Path:
    """``$CONVEYOR_DATA``, else ``$XDG_DATA_HOME/conveyor``, else ``~/.local/share/conveyor``.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"CONVEYOR_DATA": "/srv/conveyor"}):
        ...     str(data_dir())
        '/srv/conveyor'
    """
    root = os.environ.get("CONVEYOR_DATA")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")) / "conveyor"


def cache_dir() -> Path:
    """What Conveyor may measure again at will: ``$CONVEYOR_DATA/cache``, else ``$XDG_CACHE_HOME/conveyor``, else
    ``~/.cache/conveyor``.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"CONVEYOR_DATA": "/srv/conveyor"}):
        ...     str(cache_dir())
        '/srv/conveyor/cache'
    """
    root = os.environ.get("CONVEYOR_DATA")
    if root:
        return Path(root) / "cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "conveyor"
