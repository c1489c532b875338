"""Where Conveyor keeps what outlives a run: the user's data directory."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["data_dir"]


def data_dir() -> Path:
    """``$CONVEYOR_DATA``, else ``$XDG_DATA_HOME/conveyor``, else ``~/.local/share/conveyor``.

    Example:
        >>> os.environ["CONVEYOR_DATA"] = "/srv/conveyor"; str(data_dir())
        '/srv/conveyor'
        >>> del os.environ["CONVEYOR_DATA"]
    """
    root = os.environ.get("CONVEYOR_DATA")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")) / "conveyor"
