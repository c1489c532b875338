"""Helpers for emulation tests: skip where the machine cannot emulate, and the worker functions they run."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import torch.distributed as dist

from conveyor.emulate import EmulationError
from conveyor.emulate._privileges import require_cgroups, require_network


def _reason() -> str | None:
    try:
        require_network()
        require_cgroups()
    except EmulationError as exc:
        return str(exc)
    return None


REASON = _reason()
needs_root = pytest.mark.root  # skipped, saying why, where REASON is not None (conftest.py)


T = TypeVar("T")


def measured_within(measure: Callable[[], T], within: Callable[[T], bool], tries: int = 3) -> T:
    """``measure()`` again, up to ``tries`` times, until ``within`` holds of it; the last measurement.

    For speeds against wall-clock time, which the host's noise moves (on CI's VM a whole core once read 0.43
    cores for seconds): a fault in the emulation fails every try, a burst of noise rarely all three.
    """
    result = measure()
    for _ in range(tries - 1):
        if within(result):
            break
        result = measure()
    return result


def send_seconds(nbytes: int) -> float:
    """Worker 0 sends ``nbytes`` to worker 1; the seconds until worker 1 confirms it has them all."""
    small, big = torch.zeros(1), torch.zeros(nbytes // 4)
    if dist.get_rank() == 0:  # open the connection first
        dist.send(small, 1)
    else:
        dist.recv(small, 0)
    dist.barrier()
    start = time.perf_counter()
    if dist.get_rank() == 0:
        dist.send(big, 1)
        dist.recv(small, 1)
    else:
        dist.recv(big, 0)
        dist.send(small, 0)
    return time.perf_counter() - start


def longest_send(nbytes: int, seconds: float) -> float:
    """Send ``nbytes`` from worker 0 to worker 1 again and again for ``seconds``; the longest one took."""
    end, longest = time.monotonic() + seconds, 0.0
    while True:
        longest = max(longest, send_seconds(nbytes))
        done = torch.tensor([float(time.monotonic() > end)])
        dist.broadcast(done, 0)
        if done.item():
            return longest


def loop_seconds(iterations: int, repeats: int = 3) -> tuple[float, float]:
    """This worker's median wall-clock and CPU seconds for a fixed CPU loop, measured alone (the others wait):
    the median, as one loop can meet a burst of the host's own work."""
    import statistics

    from conveyor.emulate import cpu_loop

    times = [(0.0, 0.0)]
    for worker in range(dist.get_world_size()):
        dist.barrier()
        if worker == dist.get_rank():
            times = [cpu_loop(iterations) for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def own_cpu_cgroup() -> Path:
    """This process's cgroup in the CPU controller's hierarchy (v1's ``cpu``, or v2's one tree)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return Path("/sys/fs/cgroup", controllers, path.lstrip("/"))
    v2 = next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    return Path("/sys/fs/cgroup", v2[3:].lstrip("/"))


def cgroup_state(group: Path) -> tuple[float, int]:
    """The cgroup's CPU quota in cores (``inf``: none) and how many processes it holds."""
    if (group / "cpu.max").exists():
        quota, period = (group / "cpu.max").read_text().split()
    else:
        quota, period = ((group / f"cpu.cfs_{f}_us").read_text().strip() for f in ("quota", "period"))
    cores = float("inf") if quota in ("max", "-1") else int(quota) / int(period)
    return cores, len((group / "cgroup.procs").read_text().split())


def cgroup_samples(rank: int, iterations: int, guard_s: float) -> list[tuple[float, float, float, float, int]]:
    """On worker ``rank`` (the others return at once), run a fixed CPU loop again and again until this worker's
    cgroup has changed and come back (or for ``guard_s``); per loop, the wall-clock time after it, its wall-clock
    and CPU seconds, then the cgroup's quota in cores and its number of processes. The end follows the fault,
    not a clock the work could beat."""
    from conveyor.emulate import cpu_loop

    group, end = own_cpu_cgroup(), time.monotonic() + guard_s
    first, changed, samples = cgroup_state(group), False, []
    if dist.get_rank() != rank:
        return samples
    while time.monotonic() < end:
        wall, cpu = cpu_loop(iterations)
        state = cgroup_state(group)
        samples.append((time.time(), wall, cpu, *state))
        changed = changed or state != first
        if changed and state == first:
            break
    return samples


def gaps(seconds: float) -> float:
    """Run short steps for ``seconds``; the longest wall-clock gap between two steps (a pause shows as one)."""
    end, last, longest = time.monotonic() + seconds, time.monotonic(), 0.0
    while time.monotonic() < end:
        time.sleep(0.01)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    return longest


def barriers_forever() -> None:
    """Keep in step with the other workers until someone stops the job."""
    while True:
        dist.barrier()
        time.sleep(0.05)


def pid_then_barriers(folder: str) -> None:
    """Say which process this worker is (a file ``pid-RANK``), then keep in step until stopped."""
    import os
    from pathlib import Path

    (Path(folder) / f"pid-{dist.get_rank()}").write_text(str(os.getpid()))
    barriers_forever()


def routes() -> str:
    """This worker's routing table, as ``ip route`` prints it."""
    import subprocess

    return subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
