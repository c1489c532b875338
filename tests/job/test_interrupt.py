"""Ctrl-C and SIGTERM lose nothing: ``conveyor train`` finishes the epoch it is in, saves the checkpoint, summary
and plot, and says how to go on; a second Ctrl-C stops it at once, with the periodic checkpoint kept."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import conveyor.runtime._checkpoint as checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = -(-1437 // 64)  # batches per epoch of the digits at batch 64


def _start(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "conveyor.cli", "train", "--workers", "2", "--stages", "2", "--epochs", "500"]
    cmd += ["--energy-meter", "off", "--run-dir", str(run_dir), *extra]
    # A session of its own, so that a signal to its group is what a terminal's Ctrl-C sends.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_epochs(run_dir: Path, proc: subprocess.Popen[str], epochs: int) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 150
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= epochs):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no epoch finished in 150 s"
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupt_finishes_the_epoch_and_saves_everything(tmp_path: Path, how: str) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_epochs(run_dir, proc, 1)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # every process of the job, as a terminal does
    else:
        proc.send_signal(signal.SIGTERM)  # the launcher alone, as a scheduler does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "stopping at the end of this epoch" in err and "Traceback" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    epochs = summary["epochs"]
    assert summary["interrupted"] and 1 <= epochs < 500
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == epochs
    assert checkpoint.load(run_dir / "checkpoint.pt")["steps"] == epochs * STEPS  # the last epoch, whole
    assert (run_dir / "accuracy.png").stat().st_size > 0
    said = " ".join(out.split())
    assert f"interrupted after {epochs} epochs" in said
    assert f"--resume {run_dir / 'checkpoint.pt'} --epochs {500 - epochs}" in said


def test_a_second_ctrl_c_stops_at_once_and_the_periodic_checkpoint_is_kept(tmp_path: Path) -> None:
    run_dir, steps_per_epoch = tmp_path / "run", -(-1437 // 4)
    proc = _start(run_dir, "--checkpoint-every", "1", "--batch-size", "4")  # epochs of seconds: the 2nd lands in one
    _wait_for_epochs(run_dir, proc, 2)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.rstrip().endswith("conveyor: interrupted"), err[-2000:]
    assert not (run_dir / "summary.json").exists()  # stopped at once: the epoch it was in is lost
    steps = checkpoint.load(run_dir / "checkpoint.pt")["steps"]
    assert steps >= 2 * steps_per_epoch and steps % steps_per_epoch == 0  # whole epochs, saved on the way
    deadline = time.monotonic() + 10  # the worker server and resource tracker follow the launcher out
    with pytest.raises(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)  # no process of the job left behind
            time.sleep(0.1)


def test_an_interrupted_recurrence_counts_for_nothing_and_registers_nothing(tmp_path: Path) -> None:
    from conveyor.energy import RecurrenceStore
    from conveyor.warmstart import ModelStore

    run_dir, recurrences, models = tmp_path / "run", tmp_path / "recurrences.sqlite", tmp_path / "models"
    proc = _start(
        run_dir,
        *("--batch-size", "auto", "--job", "nightly", "--target-accuracy", "0.999", "--eta", "0"),
        *("--recurrences", str(recurrences), "--register", "--store", str(models)),
    )
    _wait_for_epochs(run_dir, proc, 1)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "This recurrence counts for nothing" in " ".join(out.split()) and "--resume" not in out
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"]
    assert [row["state"] for row in RecurrenceStore(recurrences).rows("nightly")] == ["abandoned"]
    assert ModelStore(models).list() == []
