"""The user's data directory: CONVEYOR_DATA, then XDG_DATA_HOME, then ~/.local/share."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.paths import data_dir


def test_data_dir_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CONVEYOR_DATA", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_dir() == tmp_path / "xdg" / "conveyor"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_dir() == tmp_path / "home" / ".local" / "share" / "conveyor"
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path / "here"))
    assert data_dir() == tmp_path / "here"
