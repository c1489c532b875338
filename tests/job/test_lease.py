"""``conveyor train --lease``: a run stops (and saves) before its lease ends, goes on while it is extended, resumes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import conveyor.runtime._checkpoint as checkpoint
from conveyor.cli import main
from conveyor.config import TrainConfig
from conveyor.job import lease_expires, read_lease, write_lease

pytestmark = pytest.mark.timeout(240)

BATCH = 8  # small batches: an epoch of the digits takes a few tenths of a second, long enough to watch
STEPS_PER_EPOCH = -(-1437 // BATCH)


class _Run(threading.Thread):
    """A real ``conveyor train`` of the default mlp on the digits, one worker, run by this process on a thread
    (a subprocess would spend ~11 s of CPU importing torch in itself and its worker server first)."""

    def __init__(self, tmp_path: Path, name: str, *args: str) -> None:
        super().__init__(daemon=True)
        self.run_dir = tmp_path / name
        self.argv = ["train", "--workers", "1", "--batch-size", str(BATCH), "--run-dir", str(self.run_dir), *args]
        self.code: int | None = None
        self.start()

    def run(self) -> None:
        self.code = main(self.argv)

    def finish(self) -> dict[str, Any]:
        self.join(timeout=150)
        assert not self.is_alive(), f"conveyor {' '.join(self.argv)} still runs after 150 s"
        assert self.code == 0, self.code
        summary: dict[str, Any] = json.loads((self.run_dir / "summary.json").read_text())
        return summary


def _metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def test_reading_and_judging_a_lease(tmp_path: Path) -> None:
    lease = tmp_path / "lease.json"
    write_lease(lease, 1234.5)
    assert read_lease(lease) == 1234.5 and [p.name for p in tmp_path.iterdir()] == ["lease.json"]
    assert not lease_expires(until=100.0, epoch_s=10.0, now=90.0)
    assert lease_expires(until=100.0, epoch_s=10.0, now=90.5)
    for text in ("{}", '{"until": "soon"}', "not json"):
        lease.write_text(text)
        with pytest.raises(ValueError, match=r"^--lease .*lease\.json: .*UNIX_SECONDS"):
            read_lease(lease)
    with pytest.raises(ValueError, match="drop --join"):
        TrainConfig.from_options(lease=str(lease), join="127.0.0.1:29500")
    assert TrainConfig.from_options(lease=str(lease), reliable=1).run.lease == str(lease)  # elastic jobs take one


def test_a_missing_lease_is_a_one_line_error_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.json"
    assert main(["train", "--lease", str(missing), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"conveyor: error: --lease {missing}: cannot read the lease") and "\n" not in err
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.slow
def test_an_expiring_lease_stops_the_run_which_resumes_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Start-up figures of its own: the other lease test runs the same job, and may keep its figures in between.
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path / "data"))
    lease, ckpt = tmp_path / "lease.json", tmp_path / "ckpt" / "job.pt"
    write_lease(lease, time.time() + 600)
    run = _Run(tmp_path, "a", "--epochs", "100", "--lease", str(lease), "--checkpoint", str(ckpt))
    deadline = time.monotonic() + 120
    while not (seen := _metrics(tmp_path / "a")) and run.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert seen, "no epoch finished"
    write_lease(lease, time.time() + 1.5 * seen[0]["seconds"])  # the scheduler cuts it to ~1.5 epochs from now
    first = run.finish()
    # Where it stops depends on how long each epoch takes (another process may slow some); well before 100.
    assert first["stopped_by_lease"] is True and first["epochs_before"] == 0
    assert len(seen) <= first["epochs"] < 100
    assert len(_metrics(tmp_path / "a")) == first["epochs"]
    assert checkpoint.load(ckpt)["steps"] == first["epochs"] * STEPS_PER_EPOCH
    assert not (tmp_path / "a" / "checkpoint.pt").exists()  # --checkpoint put it elsewhere

    # Restarted from its checkpoint, into the same file: 2 more epochs, no lease, carrying on from the weights.
    second = _Run(tmp_path, "b", "--resume", str(ckpt), "--checkpoint", str(ckpt), "--epochs", "2").finish()
    assert second["epochs"] == 2 and second["stopped_by_lease"] is False
    assert second["epochs_before"] == first["epochs"]
    assert checkpoint.load(ckpt)["steps"] == (first["epochs"] + 2) * STEPS_PER_EPOCH
    assert second["loss"][0] < first["loss"][0], (first["loss"], second["loss"])  # not from fresh weights
    assert second["accuracy"][0] > max(0.5, first["accuracy"][-1] - 0.1), (first["accuracy"], second["accuracy"])
    # The same job again: it plans from the start-up figures the first run measured and kept, to the same prediction.
    plans = [json.loads((tmp_path / run / "plan.json").read_text()) for run in "ab"]
    assert plans[0]["measured_at_start"]["source"] == "measured at start-up"
    assert plans[1]["measured_at_start"]["source"].startswith("kept from a run on ")
    assert plans[1]["measured_at_start"]["kept_at"] is not None
    assert plans[1]["measured_at_start"] == {
        **plans[0]["measured_at_start"],
        "source": plans[1]["measured_at_start"]["source"],
        "kept_at": plans[1]["measured_at_start"]["kept_at"],
    }
    assert plans[1]["predicted"] == plans[0]["predicted"]


@pytest.mark.slow
def test_a_lease_extended_while_running_lets_the_run_finish(tmp_path: Path) -> None:
    """Started with a lease already over, which alone would stop the run after its first epoch (the test above),
    and renewed to 30 s ahead every 0.02 s from the moment the run has planned (its plan file, written before its
    first epoch begins), as a scheduler extends a job's lease round after round: the run goes on to its last epoch.
    The renewal follows the run's progress, not a clock a fast start-up could beat."""
    lease, window, stop = tmp_path / "lease.json", 30.0, threading.Event()
    write_lease(lease, time.time() - 1.0)
    plan = tmp_path / "run" / "plan.json"

    def renew() -> None:
        while not plan.exists() and not stop.wait(0.005):
            pass
        while not stop.is_set():
            write_lease(lease, time.time() + window)
            stop.wait(0.02)

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        summary = _Run(tmp_path, "run", "--epochs", "6", "--lease", str(lease)).finish()
    finally:
        stop.set()
        renewer.join()
    assert summary["epochs"] == 6 and summary["stopped_by_lease"] is False
    assert checkpoint.load(tmp_path / "run" / "checkpoint.pt")["steps"] == 6 * STEPS_PER_EPOCH
