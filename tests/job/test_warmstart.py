"""``conveyor train --register`` and ``--warm-start auto|CHECKPOINT``: a wider model starts from a trained one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.warmstart import ModelStore

pytestmark = pytest.mark.slow

BASE = ["train", "--workers", "1", "--energy-meter", "off"]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.timeout(300)
def test_a_wider_model_warm_starts_from_the_stored_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = ["--store", str(tmp_path / "models")]
    assert main([*BASE, "--width", "16", "--epochs", "8", "--register", *store, "--run-dir", str(tmp_path / "p")]) == 0
    parent = _summary(tmp_path / "p")
    [entry] = ModelStore(tmp_path / "models").list()
    assert parent["registered"] == entry.id and entry.accuracy == parent["accuracy"][-1] > 0.85
    slow = ["--width", "32", "--epochs", "1", "--lr", "0.01"]  # one epoch at a small rate: far from trained alone
    assert main([*BASE, *slow, "--warm-start", "auto", *store, "--run-dir", str(tmp_path / "c")]) == 0
    assert f"warm start from {entry.id} (mlp, accuracy" in capsys.readouterr().out
    child = _summary(tmp_path / "c")
    assert child["warm_start"]["parent"] == entry.id and child["warm_start"]["coverage"] == 1.0  # widened: all set
    assert "widened" in child["warm_start"]["layers"].values()
    assert 0 <= child["warm_start"]["match_s"] <= child["warm_start"]["seconds"] < 60  # what the launcher spent
    assert main([*BASE, *slow, "--run-dir", str(tmp_path / "s")]) == 0
    scratch = _summary(tmp_path / "s")
    # Net2Net widening keeps the parent's function: the child starts where the parent ended
    assert child["accuracy"][0] >= parent["accuracy"][-1] - 0.05 and child["accuracy"][0] > scratch["accuracy"][0] + 0.3
    checkpoint = str(tmp_path / "p" / "checkpoint.pt")  # a given checkpoint: its layers pair with the child's by name
    assert main([*BASE, *slow, "--warm-start", checkpoint, "--run-dir", str(tmp_path / "k")]) == 0
    assert _summary(tmp_path / "k")["warm_start"]["parent"] == checkpoint


@pytest.mark.timeout(120)
def test_an_empty_store_trains_from_scratch_and_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r"
    assert (
        main([*BASE, "--epochs", "1", "--warm-start", "auto", "--store", str(tmp_path / "none"), "--run-dir", str(run)])
        == 0
    )
    assert "no warm start: " in capsys.readouterr().out and _summary(run)["warm_start"]["parent"] is None
    bad = tmp_path / "bad"  # a new folder: the run's own is refused without --overwrite
    assert main([*BASE, "--warm-start", "auto", "--resume", str(tmp_path / "x.pt"), "--run-dir", str(bad)]) == 2
    assert "conveyor: error:" in capsys.readouterr().err
    assert main([*BASE, "--warm-start", str(tmp_path / "missing.pt"), "--run-dir", str(bad)]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert not bad.exists()  # a run that failed while starting leaves no folder
