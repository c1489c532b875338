"""Worker cgroups: quotas, the freezer, and removal of a dead launcher's leftovers (root only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from emulation import needs_root

from conveyor.emulate._cgroups import WorkerCgroup, cgroup_roots, remove_job, remove_stale_jobs

pytestmark = [needs_root, pytest.mark.timeout(60)]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().split()[2]


def test_quota_freezer_and_removal() -> None:
    job = f"job-{os.getpid()}-test"
    group = WorkerCgroup(job, "w0")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        group.join(sleeper.pid)
        assert group.pids() == [sleeper.pid]
        group.set_cores(0.25)
        quota = (group.dirs[0] / ("cpu.max" if group.v2 else "cpu.cfs_quota_us")).read_text().split()[0]
        period = (group.dirs[0] / ("cpu.max" if group.v2 else "cpu.cfs_period_us")).read_text().split()[-1]
        assert int(quota) / int(period) == pytest.approx(0.25)
        group.freeze(True)
        state = (
            (group.dirs[0] / "cgroup.freeze").read_text() if group.v2 else (group.dirs[1] / "freezer.state").read_text()
        )
        assert state.strip() in ("1", "FROZEN", "FREEZING")
        group.signal(signal.SIGKILL)  # a frozen process is thawed so that it can die
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        remove_job(job)
    assert not any((root / job).exists() for root in cgroup_roots())


def test_the_next_job_removes_the_cgroups_of_a_dead_launcher() -> None:
    stale = f"job-{_dead_pid()}-0"
    WorkerCgroup(stale, "w0")
    live = f"job-{os.getpid()}-live"
    WorkerCgroup(live, "w0")
    try:
        assert stale in remove_stale_jobs()
        assert not any((root / stale).exists() for root in cgroup_roots())
        assert all((root / live).exists() for root in cgroup_roots())  # this process is alive: its job stays
    finally:
        remove_job(live)


@pytest.mark.parametrize(
    ("run_us", "cores", "quota", "period"), [(25_000, 0.25, 25_000, 100_000), (5_000, 0.15, 5_000, 33_333)]
)
def test_the_cpu_slice_is_the_run_between_stops(run_us: int, cores: float, quota: int, period: int) -> None:
    job = f"job-{os.getpid()}-slice"
    group = WorkerCgroup(job, "w0", run_us=run_us)
    try:
        group.set_cores(cores)
        if group.v2:
            assert (group.dirs[0] / "cpu.max").read_text().split() == [str(quota), str(period)]
        else:
            assert int((group.dirs[0] / "cpu.cfs_quota_us").read_text()) == quota
            assert int((group.dirs[0] / "cpu.cfs_period_us").read_text()) == period
    finally:
        remove_job(job)
