"""``conveyor train --batch-size auto --job NAME``: recurrences through the store, their cost, early stops."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch

import conveyor.job._train as train_module
from conveyor.cli import main
from conveyor.config import TrainConfig
from conveyor.energy import RecurrenceStore, open_meter
from conveyor.job import train
from conveyor.job._energy import guarded_power_limits, start_recurrence

QUICK = ["train", "--workers", "1", "--epochs", "6", "--target-accuracy", "0.9", "--batch-size", "auto"]


def _replay(folder: Path, joules: float, rows: int = 12) -> str:
    """A Zeus log of ``rows`` windows of ``joules`` each, replayed by the run's one worker."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"{i}.0,epoch,1.0,{joules}\n" for i in range(rows))
    (folder / "energy.csv").write_text("start_time,window_name,elapsed_time,gpu0_energy\n" + lines)
    return f"replay:{folder}/energy.csv"


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_recurrences_explore_from_the_default_and_record_their_cost(tmp_path: Path) -> None:
    store = tmp_path / "store.sqlite"
    meter = _replay(tmp_path / "logs", 50.0)
    runs = []
    for i in range(2):
        run = tmp_path / f"r{i}"
        assert (
            main(
                [
                    *QUICK,
                    "--job",
                    "digits",
                    "--recurrences",
                    str(store),
                    "--eta",
                    "1",
                    "--energy-meter",
                    meter,
                    "--run-dir",
                    str(run),
                ]
            )
            == 0
        )
        runs.append(_summary(run))
    first, second = (s["recurrence"] for s in runs)
    assert (first["batch_size"], first["phase"], first["number"], first["lr"]) == (64, "explore", 1, 0.05)
    assert (second["batch_size"], second["lr"]) == (32, 0.025)  # down from the default, lr scaled linearly (SGD)
    assert first["reached"] and runs[0]["accuracy"][-1] >= 0.9
    for summary in runs:  # eta 1: the cost is the energy, 50 J an epoch
        assert summary["cost"] == summary["energy_j"] == 50.0 * summary["epochs"]
    rows = RecurrenceStore(store).rows("digits")
    assert [(r["batch_size"], r["state"], r["cost"]) for r in rows] == [
        (64, "finished", runs[0]["cost"]),
        (32, "finished", runs[1]["cost"]),
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_recurrence_past_beta_times_the_least_cost_stops_early(tmp_path: Path) -> None:
    # Two workers (data parallel), each replaying its own meter: both must decide to stop at the same epoch.
    store, two = tmp_path / "store.sqlite", ["--stages", "1", "--replicas", "2"]
    common = [*QUICK[:2], "2", *QUICK[3:], *two, "--job", "digits", "--recurrences", str(store), "--eta", "1"]
    for rank in (0, 1):
        _replay(tmp_path / f"cheap{rank}", 5.0)
    assert (
        main(
            [
                *common,
                "--run-dir",
                str(tmp_path / "r0"),
                "--energy-meter",
                f"replay:{tmp_path}/cheap{{rank}}/energy.csv",
            ]
        )
        == 0
    )
    first = _summary(tmp_path / "r0")
    assert first["recurrence"]["reached"] and first["cost"] == 10.0 * first["epochs"]
    threshold = 2 * first["cost"]  # beta x the least cost that reached
    per_epoch = threshold / 1.5  # one epoch fits under it, two do not
    for rank in (0, 1):
        _replay(tmp_path / f"dear{rank}", per_epoch / 2)
    assert (
        main(
            [*common, "--run-dir", str(tmp_path / "r1"), "--energy-meter", f"replay:{tmp_path}/dear{{rank}}/energy.csv"]
        )
        == 0
    )
    summary = _summary(tmp_path / "r1")
    assert summary["stopped_by_cost"] and summary["epochs"] == 1 and summary["cost"] == pytest.approx(per_epoch)
    assert not summary["recurrence"]["reached"] and summary["recurrence"]["stop_above"] == threshold
    assert RecurrenceStore(store).history("digits")[-1].reached is False


@pytest.mark.parametrize(
    ("error", "state"), [(RuntimeError("out of memory"), "failed"), (KeyboardInterrupt(), "abandoned")]
)
def test_a_failed_run_counts_as_a_miss_and_an_interrupted_one_as_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException, state: str
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(train_module, "launch_emulated", broken)
    cfg = TrainConfig.from_options(
        workers=1,
        tune_batch_size=True,
        job="digits",
        target_accuracy=0.9,
        eta=0.0,
        recurrences=str(tmp_path / "s.sqlite"),
        run_dir=str(tmp_path / "run"),
    )
    with pytest.raises(type(error)):
        train(cfg)
    assert [r["state"] for r in RecurrenceStore(tmp_path / "s.sqlite").rows("digits")] == [state]


def test_not_under_torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import conveyor.runtime as runtime

    monkeypatch.setattr(runtime, "under_torchrun", lambda: True)  # every process would begin a recurrence
    cfg = TrainConfig.from_options(
        workers=1,
        tune_batch_size=True,
        job="digits",
        target_accuracy=0.9,
        eta=0.0,
        recurrences=str(tmp_path / "s.sqlite"),
    )
    with pytest.raises(ValueError, match="--batch-size auto runs on the local launcher, not under torchrun"):
        start_recurrence(cfg, lambda: 1437, 1)  # the run's config, the recurrence and its stopping cost
    assert not (tmp_path / "s.sqlite").exists() or not RecurrenceStore(tmp_path / "s.sqlite").rows("digits")


class _FakeGpus:
    """Two GPUs at 280 W whose limits a run changes (zeus' GPU interface, the calls the guard makes)."""

    def __init__(self) -> None:
        self.limits = [280_000, 280_000]

    def __len__(self) -> int:
        return len(self.limits)

    def get_power_management_limit(self, index: int) -> int:
        return self.limits[index]

    def set_power_management_limit(self, index: int, limit: int) -> None:
        self.limits[index] = limit


@pytest.mark.parametrize("ending", ["normally", "by SIGTERM"])
def test_the_launcher_restores_every_gpus_limit(monkeypatch: pytest.MonkeyPatch, ending: str) -> None:
    import os
    import signal

    import zeus.device

    gpus = _FakeGpus()
    monkeypatch.setattr(zeus.device, "get_gpus", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = TrainConfig.from_options(workers=1, power_limit="auto")
    stopped = pytest.raises(SystemExit) if ending == "by SIGTERM" else contextlib.nullcontext()
    with stopped, guarded_power_limits(cfg.energy):
        gpus.limits = [300_000, 150_000]  # what the workers left (a worker killed mid-profile)
        if ending == "by SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher is stopped: its guard still runs
    assert gpus.limits == [280_000, 280_000]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_bad_energy_options_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lease = tmp_path / "lease.json"
    lease.write_text('{"until": 4102444800}')
    cases = [
        (["--batch-size", "auto"], "give --job NAME and --target-accuracy"),
        (["--job", "x"], "--job names a recurring job whose batch size is tuned: add --batch-size auto"),
        (["--eta", "1.5"], r"--eta weighs energy against time and must be in [0, 1], got 1.5"),
        (["--power-limit", "250W"], "--power-limit must be 'auto', 'max' or a whole number of watts"),
        (["--power-limit", "auto"], "--power-limit needs NVIDIA GPUs (CUDA); this run has none"),
        (
            ["--batch-size", "auto", "--job", "j", "--target-accuracy", "0.9", "--lease", str(lease)],
            "a recurrence of --batch-size auto runs whole, from scratch: drop --lease and --resume",
        ),
    ]
    for extra, message in cases:
        assert main(["train", "--workers", "1", "--epochs", "1", "--run-dir", str(tmp_path / "r"), *extra]) == 2
        assert message in capsys.readouterr().err, extra


def test_pricing_energy_needs_a_meter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open_meter("auto") as probe:
        if probe.available:
            pytest.skip("this machine has an energy meter: the no-meter error cannot happen here")
    argv = [*QUICK, "--job", "j", "--recurrences", str(tmp_path / "s.sqlite"), "--run-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--batch-size auto with --eta 0.5 prices energy, but no energy meter readable here" in err
    assert math.isfinite(len(err)) and err.count("\n") == 1
