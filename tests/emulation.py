"""Helpers for emulation tests: skip where the machine cannot emulate, and the worker functions they run."""

from __future__ import annotations

import time
from collections.abc import Callable
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


def loop_times(iterations: int, seconds: float) -> list[tuple[float, float]]:
    """Run a fixed CPU loop again and again for ``seconds``; the wall-clock and CPU seconds of each."""
    from conveyor.emulate import cpu_loop

    end, times = time.monotonic() + seconds, []
    while time.monotonic() < end:
        times.append(cpu_loop(iterations))
    return times


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
