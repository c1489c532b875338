"""A CPU worker's intra-op threads, matched to the cores other processes leave it.

PyTorch's CPU operators split their work over a pool of threads that wait for each other at every operator
(OpenMP's barriers, spinning). On cores another process keeps busy, a descheduled thread holds all the others
at each barrier: on this project's 2-core machine, a plain loop on two threads beside one busy process ran the
digits MLP at 0.27x its speed on one thread (11,888 against 43,471 samples/s) and VGG-16 at 0.6x (258 against
427), while on a quiet machine two threads were 1.7x faster on VGG-16 (726 against 417). No fixed count is
right on a shared machine, so :class:`CoreShare` measures:

    external = busy(cores) - workers x own          (cores' worth, over the last period)
    threads  = clamp(floor((cores - external) / workers + 0.2), 1, most)

where ``busy`` is the time the worker's cores were busy (``/proc/stat``: user, nice, system, irq, softirq and
steal), ``own`` this process's CPU time (its siblings, the job's other local workers, are taken to use as
much), ``cores`` the CPUs this process may run on, and ``most`` the threads it started with (the launcher's
share of the cores, or an emulated device's). The 0.2 keeps a machine that is idle but for noise at full
count. It looks once per ``period_s`` (a look costs a read of ``/proc/stat``); where there is no
``/proc/stat`` it keeps ``most``. Before training, :meth:`CoreShare.choose` times a step of the worker's at one
thread and at its count, and lowers ``most`` to one where that is faster (a small model's operators).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["CoreShare"]

_STAT = Path("/proc/stat")
_BUSY = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (idle and iowait are 3 and 4)


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _jiffies(cpus: set[int]) -> tuple[int, int] | None:
    """Busy and total jiffies of ``cpus`` since boot (``None`` where ``/proc/stat`` is not there)."""
    try:
        lines = _STAT.read_text().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]]
        busy += sum(values[i] for i in _BUSY)
        total += sum(values)
    return busy, total


class CoreShare:
    """Sets ``torch``'s intra-op threads for this worker to the cores others leave it (see the module docstring).

    Args:
        workers: the job's workers on this machine (each is taken to use what this one does).
        period_s: how often :meth:`update` looks again.
        sample_s: the first look, made at once: how long it watches the cores before the worker starts.

    Attributes:
        threads: the intra-op threads set now.
        free: the cores (of this process's CPUs) that other processes left free at the last look.
    """

    def __init__(self, workers: int = 1, period_s: float = 1.0, sample_s: float = 0.2) -> None:
        self.cpus = os.sched_getaffinity(0)
        self.workers, self.period_s = max(1, workers), period_s
        self.most = torch.get_num_threads()
        self.threads = self.most
        self.free = float(len(self.cpus))  # cores others left, at the last look
        self._last = self._reading()
        if self.most > 1 and self._last is not None:
            time.sleep(sample_s)
            self._adjust()

    def _reading(self) -> tuple[tuple[int, int], float, float] | None:
        jiffies = _jiffies(self.cpus)
        return None if jiffies is None else (jiffies, time.process_time(), time.monotonic())

    def choose(self, work: Callable[[], object], budget_s: float = 1.0) -> None:
        """Keep the faster of one thread and the count now for ``work`` (a training step of this worker's, say),
        and never go above it: the threads split each operator, and on a small model's operators they cost more
        in waiting for each other than they save (the digits MLP: a plain loop 4% slower on two threads than
        on one, a pipeline worker 6%). Each count is timed over a few runs (the median) within ``budget_s``."""
        if self.threads <= 1:
            return
        seconds: dict[int, float] = {}
        for count in (self.threads, 1):
            torch.set_num_threads(count)
            work()  # warm-up
            first = time.perf_counter()
            work()
            once = time.perf_counter() - first
            repeats = max(1, min(50, int(budget_s / 2 / max(once, 1e-6))))
            seconds[count] = statistics.median([once, *(_timed(work) for _ in range(repeats - 1))])
        best = min(seconds, key=lambda count: seconds[count])
        torch.set_num_threads(best)
        self.threads = self.most = best

    def update(self) -> None:
        """Look again if a period has passed since the last look (cheap otherwise: call it at every step)."""
        if self.most > 1 and self._last is not None and time.monotonic() - self._last[2] >= self.period_s:
            self._adjust()

    def _adjust(self) -> None:
        now = self._reading()
        assert now is not None and self._last is not None
        ((busy0, total0), own0, wall0), ((busy1, total1), own1, wall1) = self._last, now
        self._last = now
        if total1 <= total0 or wall1 <= wall0:
            return
        cores = len(self.cpus)
        busy = cores * (busy1 - busy0) / (total1 - total0)  # cores' worth of busy time on our CPUs
        own = (own1 - own0) / (wall1 - wall0)
        external = max(0.0, busy - self.workers * own)
        self.free = cores - external
        threads = min(self.most, max(1, math.floor(self.free / self.workers + 0.2)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
