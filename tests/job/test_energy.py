"""``conveyor train --energy-meter``: each epoch's energy, summed over the workers' meters, in the run folder.

The runs replay Zeus CSV logs (``replay:PATH``, ``{rank}`` in PATH: one log per worker), so the joules are
known: each worker's meter reads one row per epoch (training and evaluation), the sum of its ``gpuN_energy``
columns, and the job records the sum over the workers.
"""

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import zeus

import conveyor.cli._common as cli_common
from conveyor.cli import main
from conveyor.config import TrainConfig
from conveyor.energy._meter import open_meter
from conveyor.job import train

HEADER = "start_time,window_name,elapsed_time,gpu0_energy,gpu1_energy\n"
# Rows (GPU 0 J, GPU 1 J) per epoch, for worker 0 and worker 1: epochs of 101 + 10, 202 + 20, 303 + 30.5 J.
VERSION = ".".join(zeus.__version__.split(".")[:2])
LOGS = {0: [(100.0, 1.0), (200.0, 2.0), (300.0, 3.0), (400.0, 4.0)], 1: [(10.0, 0.0), (20.0, 0.0), (30.0, 0.5)]}


def _write_logs(folder: Path, ranks: list[int]) -> str:
    """Zeus logs for these workers' meters; the ``--energy-meter`` value that replays them."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        rows = "".join(f"{i}.0,epoch,1.0,{a},{b}\n" for i, (a, b) in enumerate(LOGS[rank]))
        (folder / f"energy-{rank}.csv").write_text(HEADER + rows)
    return f"replay:{folder}/energy-{{rank}}.csv"


def _metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _png_width(path: Path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width: int = struct.unpack(">I", data[16:20])[0]
    return width


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_epochs_energy_is_the_sum_of_the_workers_replayed_windows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_common.console, "_width", 300)  # the table's cells on one line each
    spec, run = _write_logs(tmp_path / "logs", [0, 1]), tmp_path / "run"
    argv = ["train", "--stages", "1", "--replicas", "2", "--epochs", "3", "--energy-meter", spec, "--run-dir", str(run)]
    assert main(argv) == 0
    lines = _metrics(run)
    assert [m["energy_j"] for m in lines] == [111.0, 222.0, 333.5]
    assert [m["energy_total_j"] for m in lines] == [111.0, 333.0, 666.5]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["energy_j"] == 666.5 and summary["epoch_energy_j"] == [111.0, 222.0, 333.5]
    assert summary["energy_note"] is None
    logs = tmp_path / "logs"
    assert summary["energy_meter"] == (
        f"worker 0: zeus {VERSION}: replay of {logs}/energy-0.csv (GPU 0, 1); "
        f"worker 1: zeus {VERSION}: replay of {logs}/energy-1.csv (GPU 0, 1)"
    )
    assert summary["time_to_accuracy_s"] is None and summary["energy_to_accuracy_j"] is None  # no target
    assert _png_width(run / "accuracy.png") == 2016  # three panels: accuracy and loss by time, accuracy by energy
    out = capsys.readouterr().out
    assert "energy" in out and "0.7 kJ" in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_without_a_meter_is_left_out_and_said_so_and_the_target_has_its_time_and_energy(
    tmp_path: Path,
) -> None:
    spec = _write_logs(tmp_path / "logs", [0])  # worker 1 has no log, hence no meter
    cfg = TrainConfig.from_options(
        stages=1, replicas="2", epochs=3, target_accuracy=0.05, energy_meter=spec, run_dir=str(tmp_path / "run")
    )
    summary = train(cfg)
    assert summary.epochs == 1  # any model beats 5% after an epoch
    assert summary.energy_j == 101.0 and summary.epoch_energy_j == [101.0]
    assert summary.energy_note == (
        f"energy is the sum over 1 of 2 workers' meters: worker 1 has no meter (no replay log at {tmp_path}/logs/"
        "energy-1.csv: energy is not recorded)"
    )
    assert summary.time_to_accuracy_s == summary.epoch_seconds[0] > 0
    assert summary.energy_to_accuracy_j == 101.0
    assert [(m["energy_j"], m["energy_total_j"]) for m in _metrics(tmp_path / "run")] == [(101.0, 101.0)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_auto_where_nothing_is_readable_records_null_energy_and_the_reason_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = open_meter("auto", gpu_index=0)
    if probe.available:
        probe.close()
        pytest.skip(f"this machine has a readable energy meter ({probe.describe()}): auto records real energy")
    monkeypatch.setattr(cli_common.console, "_width", 300)
    run = tmp_path / "run"
    argv = ["train", "--workers", "1", "--epochs", "1", "--target-accuracy", "0.05", "--run-dir", str(run)]
    assert main(argv) == 0  # --energy-meter auto is the default
    summary = json.loads((run / "summary.json").read_text())
    assert summary["energy_j"] is None and summary["epoch_energy_j"] == [None] and summary["energy_meter"] is None
    note = summary["energy_note"]
    assert note.startswith("no energy meter readable here (") and note.endswith("): energy is not recorded")
    assert summary["time_to_accuracy_s"] > 0 and summary["energy_to_accuracy_j"] is None
    assert [(m["energy_j"], m["energy_total_j"]) for m in _metrics(run)] == [(None, None)]
    assert _png_width(run / "accuracy.png") == 1392  # accuracy and loss against time, no energy panel
    out = capsys.readouterr().out
    assert "n/a" in out and out.count(note) == 1


def test_a_bad_energy_meter_is_a_one_line_error_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=r"^--energy-meter 'joules': use auto, off or replay:PATH"):
        TrainConfig.from_options(energy_meter="joules")
    missing = tmp_path / "none.csv"
    assert main(["train", "--energy-meter", f"replay:{missing}", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"conveyor: error: --energy-meter replay:{missing}: no replay log at {missing}"
    assert not (tmp_path / "run").exists()  # nothing started
