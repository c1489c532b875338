"""``conveyor train --batch-size auto --job NAME``: recurrences through the store, their cost, early stops."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import conveyor.job._train as train_module
from conveyor.cli import main
from conveyor.energy import JobSettings, RecurrenceStore, candidate_sizes, open_meter
from conveyor.job import TrainConfig, train

QUICK = ["train", "--workers", "1", "--epochs", "6", "--target-accuracy", "0.9", "--batch-size", "auto"]


def _replay(folder: Path, joules: float, rows: int = 12) -> str:
    """A Zeus log of ``rows`` windows of ``joules`` each, replayed by the run's one worker."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"{i}.0,epoch,1.0,{joules}\n" for i in range(rows))
    (folder / "energy.csv").write_text("start_time,window_name,elapsed_time,gpu0_energy\n" + lines)
    return f"replay:{folder}/energy.csv"


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.timeout(300)
def test_recurrences_explore_from_the_default_and_record_their_cost(tmp_path: Path) -> None:
    store = tmp_path / "store.sqlite"
    meter = _replay(tmp_path / "logs", 50.0)
    runs = []
    for i in range(2):
        run = tmp_path / f"r{i}"
        assert main([*QUICK, "--job", "digits", "--store", str(store), "--eta", "1", "--energy-meter", meter,
                     "--run-dir", str(run)]) == 0  # fmt: skip
        runs.append(_summary(run))
    first, second = (s["recurrence"] for s in runs)
    assert (first["batch_size"], first["phase"], first["number"], first["lr"]) == (64, "explore", 1, 0.05)
    assert (second["batch_size"], second["lr"]) == (32, 0.025)  # down from the default, lr scaled linearly (SGD)
    assert first["reached"] and runs[0]["accuracy"][-1] >= 0.9
    for summary in runs:  # eta 1: the cost is the energy, 50 J an epoch
        assert summary["cost"] == summary["energy_j"] == 50.0 * summary["epochs"]
    rows = RecurrenceStore(store).rows("digits")
    assert [(r["batch_size"], r["state"], r["cost"]) for r in rows] == [
        (64, "finished", runs[0]["cost"]), (32, "finished", runs[1]["cost"])]  # fmt: skip


@pytest.mark.timeout(180)
def test_a_recurrence_past_beta_times_the_least_cost_stops_early(tmp_path: Path) -> None:
    store = RecurrenceStore(tmp_path / "store.sqlite")
    settings = JobSettings(candidate_sizes(64, 1437), 64, 0.9, eta=1.0, beta=2.0)
    cheap = store.begin("digits", settings)  # an earlier recurrence that reached the target for 30 J
    store.finish(cheap.id, cost=30.0, energy_j=30.0, time_s=1.0, reached=True, epochs=3)
    run = tmp_path / "run"
    assert main([*QUICK, "--job", "digits", "--store", str(store.path), "--eta", "1", "--run-dir", str(run),
                 "--energy-meter", _replay(tmp_path / "logs", 40.0)]) == 0  # fmt: skip
    summary = _summary(run)
    # Threshold 2 x 30 = 60 J; after one 40 J epoch another would reach 80 J: it stops there, unreached.
    assert summary["stopped_by_cost"] and summary["epochs"] == 1 and summary["cost"] == 40.0
    assert not summary["recurrence"]["reached"] and summary["recurrence"]["stop_above"] == 60.0
    assert store.history("digits")[-1].reached is False


def test_a_failed_run_is_abandoned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a worker died")

    monkeypatch.setattr(train_module, "launch_emulated", broken)
    cfg = TrainConfig(workers=1, tune_batch_size=True, job="digits", target_accuracy=0.9, eta=0.0,
                      store=str(tmp_path / "s.sqlite"), run_dir=str(tmp_path / "run"))  # fmt: skip
    with pytest.raises(RuntimeError, match="a worker died"):
        train(cfg)
    assert [r["state"] for r in RecurrenceStore(tmp_path / "s.sqlite").rows("digits")] == ["abandoned"]


def test_bad_energy_options_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["--batch-size", "auto"], "give --job NAME and --target-accuracy"),
        (["--job", "x"], "--job names a recurring job whose batch size is tuned: add --batch-size auto"),
        (["--eta", "1.5"], r"--eta weighs energy against time and must be in [0, 1], got 1.5"),
        (["--power-limit", "250W"], "--power-limit must be 'auto', 'max' or a whole number of watts"),
        (["--power-limit", "auto"], "--power-limit needs NVIDIA GPUs (CUDA); this run has none"),
    ]
    for extra, message in cases:
        assert main(["train", "--workers", "1", "--epochs", "1", "--run-dir", str(tmp_path / "r"), *extra]) == 2
        assert message in capsys.readouterr().err, extra


def test_pricing_energy_needs_a_meter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open_meter("auto") as probe:
        if probe.available:
            pytest.skip("this machine has an energy meter: the no-meter error cannot happen here")
    argv = [*QUICK, "--job", "j", "--store", str(tmp_path / "s.sqlite"), "--run-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--batch-size auto with --eta 0.5 prices energy, but no energy meter readable here" in err
    assert math.isfinite(len(err)) and err.count("\n") == 1
