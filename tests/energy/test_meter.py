"""Energy meters (conveyor.energy._meter): the specs, Zeus' monitor where nothing is readable, replayed Zeus logs."""

import logging
import os
from pathlib import Path

import pytest
import zeus

from conveyor.config import check_meter_spec
from conveyor.energy._meter import MeterStatus, describe_meters, open_meter

HEADER = "start_time,window_name,elapsed_time,gpu0_energy,gpu1_energy\n"
VERSION = ".".join(zeus.__version__.split(".")[:2])


def _log(path: Path, rows: list[tuple[float, float]], header: str = HEADER) -> Path:
    """A Zeus CSV log (ZeusMonitor(log_file=...)'s format) of windows with these joules on GPU 0 and GPU 1."""
    path.write_text(header + "".join(f"{i}.0,epoch{i},1.5,{a},{b}\n" for i, (a, b) in enumerate(rows)))
    return path


@pytest.mark.parametrize("spec", ["", "on", "zeus", "replay", "replay:", "replay: ", "Auto", "off:now"])
def test_anything_but_auto_off_or_replay_is_a_one_line_error(spec: str) -> None:
    for check in (check_meter_spec, open_meter):
        with pytest.raises(ValueError, match=r"^--energy-meter .*: use auto, off or replay:PATH \(") as err:
            check(spec)
        assert "\n" not in str(err.value)


def test_a_replay_log_without_rank_must_exist_one_with_rank_need_not(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--energy-meter replay:\S+none\.csv: no replay log at \S+none\.csv$"):
        check_meter_spec(f"replay:{tmp_path / 'none.csv'}")
    check_meter_spec(f"replay:{tmp_path / 'energy-{rank}.csv'}")  # a worker whose log is missing has no meter
    check_meter_spec(f"replay:{_log(tmp_path / 'e.csv', [(1, 2)])}")
    check_meter_spec("auto")
    check_meter_spec("off")


def test_off_measures_nothing_and_says_so() -> None:
    with open_meter("off") as meter:
        meter.begin()
        assert meter.end() is None and not meter.available
        assert meter.reason == "energy metering is off (--energy-meter off)"
        assert meter.describe() == f"no meter: {meter.reason}"
        assert meter.status() == MeterStatus(False, None, meter.reason)


def test_auto_where_no_gpu_nor_rapl_is_readable_is_no_meter_with_its_reason(capfd: pytest.CaptureFixture[str]) -> None:
    meter = open_meter("auto", gpu_index=0, measure_host=True)
    if meter.available:
        meter.close()
        pytest.skip(f"this machine has a readable energy meter ({meter.describe()}): nothing to check here")
    out, err = capfd.readouterr()
    assert out == "" and err == "", "zeus' probing is quiet"
    assert logging.getLogger("zeus").getEffectiveLevel() >= logging.ERROR
    reason = meter.reason
    assert reason is not None and "\n" not in reason
    assert reason.startswith("no energy meter readable here (") and reason.endswith("): energy is not recorded")
    if not os.path.exists("/sys/class/powercap"):  # this project's CI machines: no GPU, no powercap at all
        assert reason == (
            "no energy meter readable here (no NVIDIA GPU through NVML, no RAPL under /sys/class/powercap): "
            "energy is not recorded"
        )
    meter.begin()
    assert meter.end() is None and meter.status().available is False


def test_a_worker_without_a_gpu_on_a_host_without_rapl_does_not_load_zeus(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import conveyor.energy._meter as meter_module

    monkeypatch.setattr(meter_module, "POWERCAP", "/nonexistent/powercap")
    monkeypatch.setitem(sys.modules, "zeus.monitor", None)  # an import of Zeus' monitor would raise here
    meter = open_meter("auto", gpu_index=None, measure_host=True)
    assert not meter.available and not meter.delegated
    assert meter.reason == (
        "no energy meter readable here (this worker uses no GPU, no RAPL under /nonexistent/powercap): "
        "energy is not recorded"
    )


def test_a_worker_that_leaves_its_host_to_local_rank_0_has_nothing_to_measure_without_a_gpu() -> None:
    meter = open_meter("auto", gpu_index=None, measure_host=False)
    assert not meter.available and meter.delegated and "measured by local rank 0" in (meter.reason or "")
    # Its lack of a meter is no gap: the job's note is about the workers that have something to measure.
    ok = MeterStatus(True, "zeus 0.16: CPU 0 (RAPL)", None)
    assert describe_meters([ok, meter.status(), meter.status()]) == ("worker 0: zeus 0.16: CPU 0 (RAPL)", None)


def test_replayed_windows_give_the_logged_joules_in_order(tmp_path: Path) -> None:
    log = _log(tmp_path / "energy.csv", [(100.0, 1.0), (200.5, 2.0), (300.0, 3.25)])
    with open_meter(f"replay:{log}") as meter:
        assert meter.available and meter.reason is None
        assert meter.describe() == f"zeus {VERSION}: replay of {log} (GPU 0, 1)"
        joules = []
        for _ in range(3):
            meter.begin()
            joules.append(meter.end())
        assert joules == [101.0, 202.5, 303.25]
        meter.begin()  # a fourth window: the log has no row for it, so the meter stops, with its reason
        assert meter.end() is None and not meter.available
        assert meter.reason == f"zeus {VERSION}: replay of {log} (GPU 0, 1) stopped reading at window 4: " + (
            "No more lines in the log file."
        )
        meter.begin()
        assert meter.end() is None


def test_rank_in_a_replay_path_gives_each_worker_its_own_log(tmp_path: Path) -> None:
    _log(tmp_path / "energy-0.csv", [(10.0, 0.0)])
    _log(tmp_path / "energy-1.csv", [(20.0, 0.5)])
    spec = f"replay:{tmp_path}/energy-{{rank}}.csv"
    for rank, expected in ((0, 10.0), (1, 20.5)):
        with open_meter(spec, rank=rank) as meter:
            meter.begin()
            assert meter.end() == expected
    missing = open_meter(spec, rank=2)
    assert not missing.available
    assert missing.reason == f"no replay log at {tmp_path}/energy-2.csv: energy is not recorded"


def test_a_replay_log_without_energy_columns_is_no_meter(tmp_path: Path) -> None:
    log = tmp_path / "bare.csv"
    log.write_text("start_time,window_name,elapsed_time\n0,epoch,1.0\n")
    meter = open_meter(f"replay:{log}")
    assert not meter.available and meter.reason == f"replay log {log} has no gpuN_energy column: energy is not recorded"


def test_closing_a_replay_meter_closes_its_log(tmp_path: Path) -> None:
    meter = open_meter(f"replay:{_log(tmp_path / 'e.csv', [(1.0, 1.0)])}")
    handle = meter._monitor.log_file
    with meter:
        pass
    assert handle.closed
    meter.begin()
    assert meter.end() is None  # a closed meter reads nothing more; what it was still stands
    assert meter.available and meter.status() == MeterStatus(True, meter.describe(), None)


def test_the_jobs_note_names_the_workers_without_a_meter() -> None:
    gpu = [MeterStatus(True, f"zeus 0.16: GPU {i} (NVML)", None) for i in range(2)]
    gone = MeterStatus(False, None, "no energy meter readable here (no NVIDIA GPU through NVML)")
    assert describe_meters(gpu) == ("worker 0: zeus 0.16: GPU 0 (NVML); worker 1: zeus 0.16: GPU 1 (NVML)", None)
    assert describe_meters(gpu[:1]) == ("zeus 0.16: GPU 0 (NVML)", None)
    description, note = describe_meters([gpu[0], gone, gpu[1], gone])
    assert description == "worker 0: zeus 0.16: GPU 0 (NVML); worker 2: zeus 0.16: GPU 1 (NVML)"
    assert note == (
        "energy is the sum over 2 of 4 workers' meters: workers 1, 3 have no meter (no energy meter readable here "
        "(no NVIDIA GPU through NVML))"
    )
    assert describe_meters([gone, gone]) == (None, gone.reason)
    off = MeterStatus(False, None, "energy metering is off (--energy-meter off)")
    delegated = MeterStatus(False, None, "its host's CPU is measured by local rank 0", delegated=True)
    assert describe_meters([off, delegated]) == (None, off.reason)
