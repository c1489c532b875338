"""One cgroup per emulated worker: a CPU quota (its device speed) and a freezer (pauses), v1 or v2.

Cgroups are directories and outlive a killed job, so each job's live under ``conveyor/job-PID-N`` (PID the
launcher's): a watcher process removes them when the launcher dies, and the next job removes any whose
launcher is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from conveyor.config import EmulationConfig
from conveyor.processes import process_alive

__all__ = [
    "MAX_PERIOD_US",
    "MIN_RUN_US",
    "RUN_US",
    "CgroupError",
    "WorkerCgroup",
    "cgroup_roots",
    "job_name",
    "remove_job",
    "remove_stale_jobs",
]

_ROOT = Path("/sys/fs/cgroup")
# Each period lets a worker run this long (the default of ``--cpu-slice``), then stops it until the next.
# Every stop costs work (on the VM this was measured on, about 1.3 ms of CPU per stop: cold caches, a vCPU
# waking), so the runs must be long for the rate to hold (a 5 ms run made a 0.1-core device 13% slow, a
# 25 ms run within 6%); a slower device then has a longer period, and stops as long, relative to its speed,
# as a faster one. A shorter run slows a device more evenly, at that cost.
RUN_US = round(EmulationConfig.cpu_slice * 1e6)  # --cpu-slice's default: 25 ms
MIN_RUN_US = 1_000  # the kernel's shortest quota and period
MAX_PERIOD_US = 1_000_000  # the kernel's longest period


class CgroupError(RuntimeError):
    """Cgroups cannot be used here (not mounted, or not writable)."""


def cgroup_roots() -> tuple[Path, ...]:
    """Where this job's cgroups go: the v1 ``cpu`` and ``freezer`` hierarchies, or the one v2 hierarchy."""
    if (_ROOT / "cpu" / "cpu.cfs_quota_us").exists() and (_ROOT / "freezer").is_dir():
        return (_ROOT / "cpu" / "conveyor", _ROOT / "freezer" / "conveyor")
    if "cpu" in _read(_ROOT / "cgroup.controllers").split():
        return (_ROOT / "conveyor",)
    raise CgroupError(
        "no cgroup CPU controller found (neither v1 /sys/fs/cgroup/cpu with /sys/fs/cgroup/freezer nor v2 with "
        "'cpu' in /sys/fs/cgroup/cgroup.controllers): --devices and pauses need one"
    )


def job_name(counter: int) -> str:
    """The folder name of a job started by this process."""
    return f"job-{os.getpid()}-{counter}"


class WorkerCgroup:
    """The cgroup(s) named ``name`` (``w0``, ``w1``, ...) of job ``job``, made unless ``create`` is false; a
    quota lets the worker run ``run_us`` microseconds at a time."""

    def __init__(self, job: str, name: str, create: bool = True, run_us: int = RUN_US) -> None:
        self.run_us = run_us
        self.roots = cgroup_roots()
        self.v2 = len(self.roots) == 1
        self.dirs = tuple(root / job / name for root in self.roots)
        if create:
            self._create(job)

    def _create(self, job: str) -> None:
        for root in self.roots:
            root.mkdir(exist_ok=True)
            if self.v2:  # v2 hands a controller down only where every parent enables it for its children
                _write(root.parent / "cgroup.subtree_control", "+cpu")
                _write(root / "cgroup.subtree_control", "+cpu")
            (root / job).mkdir(parents=True, exist_ok=True)  # parents: another job may just have removed root
            if self.v2:
                _write(root / job / "cgroup.subtree_control", "+cpu")
        for d in self.dirs:
            d.mkdir(exist_ok=True)

    def set_cores(self, cores: float) -> None:
        """Let the worker use ``cores`` CPU cores' worth of time (``inf``: no limit)."""
        if cores == float("inf"):
            quota, period = -1, self.run_us
        else:
            period = min(MAX_PERIOD_US, max(self.run_us, round(self.run_us / cores)))
            quota = round(cores * period)
        if self.v2:
            _write(self.dirs[0] / "cpu.max", f"{'max' if quota < 0 else quota} {period}")
        else:
            _write(self.dirs[0] / "cpu.cfs_period_us", str(period))
            _write(self.dirs[0] / "cpu.cfs_quota_us", str(quota))

    def join(self, pid: int) -> None:
        """Put process ``pid`` (all its threads) in this worker's cgroup(s)."""
        for d in self.dirs:
            _write(d / "cgroup.procs", str(pid))

    def freeze(self, frozen: bool) -> None:
        """Pause (``True``) or resume every process of the worker."""
        if self.v2:
            _write(self.dirs[0] / "cgroup.freeze", "1" if frozen else "0")
        else:
            _write(self.dirs[1] / "freezer.state", "FROZEN" if frozen else "THAWED")

    def pids(self) -> list[int]:
        """The processes in the worker's cgroup."""
        return [int(p) for p in _read(self.dirs[0] / "cgroup.procs").split()]

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process of the worker (a frozen worker is thawed first, so it can die)."""
        if sig == signal.SIGKILL:
            self.freeze(False)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def remove_job(job: str, wait_s: float = 10.0) -> None:
    """Kill whatever still runs in job ``job``'s cgroups and remove them (and ``conveyor/`` once empty)."""
    roots = cgroup_roots()
    workers = sorted({d.name for root in roots if (root / job).is_dir() for d in (root / job).iterdir() if d.is_dir()})
    for name in workers:
        with contextlib.suppress(OSError):
            WorkerCgroup(job, name, create=False).signal(signal.SIGKILL)
    end = time.monotonic() + wait_s
    for root in roots:
        for d in [*(root / job).glob("w*"), root / job]:
            while d.is_dir():  # rmdir fails while a killed process is still exiting
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.01)
        with contextlib.suppress(OSError):  # the last job out removes the shared folder; others' jobs keep it
            root.rmdir()


def remove_stale_jobs() -> list[str]:
    """Remove the cgroups of jobs whose launcher has died (killed before it could clean up); return them."""
    try:
        roots = cgroup_roots()
    except CgroupError:
        return []
    stale = set()
    for root in roots:
        for d in root.glob("job-*-*") if root.is_dir() else ():
            pid = int(d.name.split("-")[1])
            if not process_alive(pid):
                stale.add(d.name)
    for job in sorted(stale):
        remove_job(job)
    return sorted(stale)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise CgroupError(f"cannot write {text!r} to {path}: {exc.strerror}") from exc
