"""How a job's start-up times a training loop: warm first, then for long enough, over what the run will read.

A small model's rate still rises after its first batches (the MLP's first epoch ran at a third of its later rate),
so each loop runs :data:`WARM_S` untimed, then at least :data:`LEAST_S` timed, within a budget that bounds a large
model's start-up.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from conveyor.runtime.parts import Alone, synchronize

__all__ = ["LEAST_S", "WARM_S", "batch_times", "fed_batch_s"]

WARM_S = 0.1  # untimed before a start-up loop is timed: a small model's rate still rises after its first batches
LEAST_S = 0.2  # a start-up loop's timed seconds at least (within its budget)


def batch_times(
    step: Callable[[Any, torch.Tensor], object],
    batches: list[tuple[Any, torch.Tensor]],
    device: torch.device,
    least: int = 20,
    budget_s: float = 1.0,
) -> list[float]:
    """The seconds of ``step`` on each batch, after :data:`WARM_S` of untimed ones (at least one), the batches run
    again until ``least`` are timed and :data:`LEAST_S` has passed, or ``budget_s`` (each at least once; on CUDA
    each ends when the device is done)."""
    for x, y in _for(WARM_S, itertools.cycle(batches)):
        step(x, y)
    synchronize(device)
    times: list[float] = []
    given, began = len(batches), time.perf_counter()
    while len(times) < given or (
        (len(times) < least or time.perf_counter() - began < LEAST_S) and time.perf_counter() - began < budget_s
    ):
        x, y = batches[len(times) % given]
        start = time.perf_counter()
        step(x, y)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def fed_batch_s(
    alone: Alone, feed: Callable[[], Iterable[tuple[Any, Any]]], device: torch.device, budget_s: float = 1.0
) -> float:
    """A batch's mean seconds as ``alone`` trains ``feed``'s epochs as the job's run does (each epoch's order and
    gathers, its losses read at its end), after :data:`WARM_S` untimed: whole epochs until :data:`LEAST_S` has
    passed, cut short at ``budget_s``. A small model's epoch is a few milliseconds, so what an epoch costs beyond
    its batches (a new order, the first batches after it) is a share of its rate that batches timed one by one
    miss; a large model's is cut short, where that share is small."""
    alone.run(_for(WARM_S, _epochs(feed)))
    synchronize(device)
    seconds, count, began = 0.0, 0, time.perf_counter()
    while seconds < LEAST_S and time.perf_counter() - began < budget_s:
        start = time.perf_counter()
        out, trained = alone.run(_for(budget_s - (start - began), feed()))
        out.loss_values()
        synchronize(device)
        seconds, count = seconds + time.perf_counter() - start, count + trained
        if not trained:
            raise ValueError("the job's feed gave no batch to time")
    return seconds / count


def _epochs(feed: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    """``feed``'s epochs one after another, until one gives nothing.

    Example:
        >>> from itertools import islice
        >>> list(islice(_epochs(lambda: "ab"), 5)), list(_epochs(lambda: ""))
        (['a', 'b', 'a', 'b', 'a'], [])
    """
    while True:
        empty = True
        for item in feed():
            empty = False
            yield item
        if empty:
            return


def _for(seconds: float, items: Iterable[Any]) -> Iterator[Any]:
    """``items`` until ``seconds`` have passed, the first whatever the time.

    Example:
        >>> list(_for(0.0, "abc")), list(_for(60.0, "abc"))
        (['a'], ['a', 'b', 'c'])
    """
    end = time.perf_counter() + seconds
    for i, item in enumerate(items):
        if i and time.perf_counter() >= end:
            return
        yield item
