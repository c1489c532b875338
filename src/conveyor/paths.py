"""Where Conveyor keeps what outlives a run: the user's data directory, and a cache of what it may measure again."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "data_dir"]


def _xdg(variable: str, fallback: str) -> Path:
    """``conveyor`` in the XDG base directory ``variable`` names, else in ``fallback``."""
    return Path(os.environ.get(variable) or os.path.expanduser(fallback)) / "conveyor"


def data_dir() -> Path:
    """``$CONVEYOR_DATA``, else ``$XDG_DATA_HOME/conveyor``, else ``~/.local/share/conveyor``.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"CONVEYOR_DATA": "/srv/conveyor"}):
        ...     str(data_dir())
        '/srv/conveyor'
    """
    root = os.environ.get("CONVEYOR_DATA")
    return Path(root) if root else _xdg("XDG_DATA_HOME", "~/.local/share")


def cache_dir() -> Path:
    """What Conveyor may measure again at will: ``$CONVEYOR_DATA/cache``, else ``$XDG_CACHE_HOME/conveyor``, else
    ``~/.cache/conveyor``.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"XDG_CACHE_HOME": "/var/cache"}, clear=True):
        ...     str(cache_dir())
        '/var/cache/conveyor'
    """
    root = os.environ.get("CONVEYOR_DATA")
    return Path(root) / "cache" if root else _xdg("XDG_CACHE_HOME", "~/.cache")
