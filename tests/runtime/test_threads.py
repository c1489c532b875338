"""A CPU worker's threads follow the cores other processes leave it."""

import multiprocessing
import multiprocessing.synchronize
import os
import time

import pytest
import torch

import conveyor.runtime._threads as threads
from conveyor.runtime import CoreShare


@pytest.fixture
def two_threads() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_equation_on_given_readings(monkeypatch: pytest.MonkeyPatch, two_threads: None) -> None:
    """4 cores; one worker of two on the machine: busy = 4 x busy jiffies / all jiffies; external = busy -
    2 x own; threads = floor((4 - external) / 2 + 0.2), between 1 and the 2 it started with."""
    readings = iter([(0, 0), (300, 400), (900, 800)])  # busy 3.0 cores, then 6.0 / 1.0 = 4 x 600 / 400 = 6.0
    monkeypatch.setattr(threads, "_jiffies", lambda cpus: next(readings))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    clock = iter([0.0, 1.0, 2.0, 2.0])  # the readings at start and after the sample; update's look, its reading
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    cpu = iter([0.0, 0.5, 0.5])  # own: 0.5 cores, then 0
    monkeypatch.setattr(time, "process_time", lambda: next(cpu))
    monkeypatch.setattr(time, "sleep", lambda s: None)
    share = CoreShare(workers=2)  # external = 3.0 - 2 x 0.5 = 2.0: free 2.0, 1 thread each (1.0 + 0.2)
    assert share.free == pytest.approx(2.0) and share.threads == 1 == torch.get_num_threads()
    share.update()  # external = 6.0 - 0 = 6.0, more than the 4 cores: free -2.0, still at least 1
    assert share.free == pytest.approx(-2.0) and share.threads == 1


def _spin(spinning: multiprocessing.synchronize.Event) -> None:
    spinning.set()
    while True:
        pass


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="measured on a 2-core machine (CI's and ours)")
@pytest.mark.serial  # a busy process's share of the cores: alone
def test_a_busy_process_beside_takes_a_thread_away(two_threads: None) -> None:
    """On two cores, one process that never sleeps leaves one: one thread (two would wait for each other at
    every operator). Once it is gone, about a core more is free again."""
    spawn = multiprocessing.get_context("spawn")
    spinning = spawn.Event()
    busy = spawn.Process(target=_spin, args=(spinning,), daemon=True)
    busy.start()
    try:
        # Spinning before the sample starts: a spawned process imports this module (and torch) first, which took
        # over a second on a slow machine, and a sample of it starting saw 1.76 cores free.
        assert spinning.wait(timeout=60), "the busy process did not start"
        time.sleep(0.5)
        share = CoreShare(workers=1, period_s=0.0, sample_s=0.5)
        assert share.threads == 1 == torch.get_num_threads(), share.free
        contended = share.free
    finally:
        busy.terminate()
        busy.join()
    share.update()  # the window the process ended in
    time.sleep(1.0)
    share.update()
    assert share.free > contended + 0.5, (contended, share.free)
