"""Each worker's actions, generated as the run goes, so a run of any length needs no list of them all.

A run is a stream of batches, each cut into ``m`` microbatches numbered in order (microbatch ``k`` is
part ``k % m`` of batch ``k // m``). Its length may only be known at its end (a generator of batches), so
generation asks a :class:`BatchCount` whether batch ``b`` exists as it goes; every question concerns a
batch at most ``3 x workers`` microbatches ahead of the last one the worker's actions named (a stage's
warm-up and a round of replicas: the tests check the bound). :func:`worker_actions` with
:class:`Batches` (a known count) gives the lists a :class:`~conveyor.schedule.Schedule` holds; the executor
runs the same generator on a count it learns from the first worker.

Microbatch ``k`` runs on replica ``k % r`` of a stage with ``r`` replicas, so counts need not divide each
other: in a batch or a round a replica may have no microbatch, and then only reduces (contributing no
sample) and steps with its peers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count, islice, takewhile
from typing import Protocol

from conveyor.schedule._actions import Action, Op
from conveyor.schedule._kinds import Kind, warmup
from conveyor.schedule._layout import stage_workers, worker_stages

__all__ = ["BatchCount", "Batches", "with_communication", "worker_actions"]

_REDUCE_STEP = (Action(Op.REDUCE_GRAD), Action(Op.STEP))


class BatchCount(Protocol):
    """How many batches a run has, as far as generation needs to know."""

    def has(self, batch: int) -> bool:
        """Whether the run has batch ``batch`` (may wait until that is known)."""
        ...


@dataclass(frozen=True)
class Batches:
    """A run of a known number of batches."""

    count: int

    def has(self, batch: int) -> bool:
        return batch < self.count


def worker_actions(
    kind: Kind, worker: int, replicas: Sequence[int], microbatches: int, batches: BatchCount
) -> Iterator[Action]:
    """Worker ``worker``'s actions for a run: its compute order with the receives it needs and the sends it owes.

    Example:
        >>> from conveyor.schedule._kinds import KINDS
        >>> " ".join(map(str, worker_actions(KINDS["flush"], 1, [1, 1], 2, Batches(1))))
        'RECV_F0<0 F0 B0 SEND_B0>0 RECV_F1<0 F1 B1 SEND_B1>0 REDUCE STEP'
    """
    return with_communication(_compute(kind, worker, replicas, microbatches, batches), worker, replicas)


def _compute(kind: Kind, worker: int, replicas: Sequence[int], m: int, batches: BatchCount) -> Iterator[Action]:
    stage = worker_stages(replicas)[worker]
    r = replicas[stage]
    replica = worker - stage_workers(replicas)[stage][0]
    ahead = int(warmup(r, sum(replicas[stage:])))
    if kind.synchronous:
        for b in _batch_numbers(batches):
            mine = [k for k in range(b * m, (b + 1) * m) if k % r == replica]
            if kind.all_forwards_first:
                yield from (Action(Op.FORWARD, k) for k in mine)
                yield from (Action(Op.BACKWARD, k) for k in mine)
                yield from _REDUCE_STEP
            else:
                yield from _one_f_one_b(mine, ahead, lambda k: 0, lambda: 1, lambda k: None)
        return
    own = takewhile(lambda k: batches.has(k // m), count(replica, r))

    def updates() -> int:
        return kind.updates(_total(batches), m, r)

    yield from _one_f_one_b(
        own, ahead, lambda k: kind.update_of(k, m, r), updates, lambda k: kind.version(stage, k, replicas, m)
    )


def _batch_numbers(batches: BatchCount) -> Iterator[int]:
    b = 0
    while batches.has(b):
        yield b
        b += 1


def _total(batches: BatchCount) -> int:
    """The number of batches (asked once the worker's own microbatches have run out, so the end is near)."""
    return sum(1 for _ in _batch_numbers(batches))


def _one_f_one_b(
    own: Iterable[int],
    ahead: int,
    update_of: Callable[[int], int],
    updates: Callable[[], int],
    version: Callable[[int], int | None],
) -> Iterator[Action]:
    """``ahead`` forwards, then one backward and one forward in turn, then the remaining backwards.

    A reduce and an optimizer step follow the worker's last backward of each update; an update this worker
    has no microbatch of gets its reduce and step before the next backward (or at the end), so every
    replica of a stage makes ``updates()`` of them.
    """
    mine = iter(own)
    flight: deque[int] = deque(islice(mine, ahead))
    yield from (Action(Op.FORWARD, k, version=version(k)) for k in flight)
    stepped = 0
    while flight:
        k = flight.popleft()
        update = update_of(k)
        for _ in range(stepped, update):
            yield from _REDUCE_STEP
        stepped = update
        yield Action(Op.BACKWARD, k)
        following = next(mine, None)
        after = flight[0] if flight else following
        if after is None or update_of(after) != update:
            yield from _REDUCE_STEP
            stepped = update + 1
        if following is not None:
            flight.append(following)
            yield Action(Op.FORWARD, following, version=version(following))
    for _ in range(stepped, updates()):
        yield from _REDUCE_STEP


def with_communication(
    compute: Iterable[Action], worker: int, replicas: Sequence[int], route: Callable[[int, int], int] | None = None
) -> Iterator[Action]:
    """Wrap a worker's compute order with the receives it needs and the sends it owes.

    Microbatch ``k`` runs on replica ``k % replicas[s]`` of stage ``s`` (unless ``route(stage, k)`` says
    otherwise), so its backward returns to the replica that ran its forward. A forward on a stage after the
    first receives its input from the previous stage; one before the last sends its output on; backwards
    do the same for gradients in the other direction. Receives sit right before their use, so the
    executor blocks only on data it needs next; sends are asynchronous. One stage communicates nothing: its
    compute order is returned as it is.
    """
    if len(replicas) == 1:
        return iter(compute)
    return _communicating(compute, worker, replicas, route)


def _communicating(
    compute: Iterable[Action], worker: int, replicas: Sequence[int], route: Callable[[int, int], int] | None
) -> Iterator[Action]:
    workers = stage_workers(replicas)
    stage, last = worker_stages(replicas)[worker], len(replicas) - 1

    def round_robin(s: int, k: int) -> int:
        return workers[s][k % replicas[s]]

    peer = route or round_robin
    for a in compute:
        if a.op is Op.FORWARD:
            k = a.mb
            if stage > 0:
                yield Action(Op.RECV_ACTIVATION, k, peer(stage - 1, k))
            yield a
            if stage < last:
                yield Action(Op.SEND_ACTIVATION, k, peer(stage + 1, k))
        elif a.op is Op.BACKWARD:
            k = a.mb
            if stage < last:
                yield Action(Op.RECV_GRAD, k, peer(stage + 1, k))
            yield a
            if stage > 0:
                yield Action(Op.SEND_GRAD, k, peer(stage - 1, k))
        else:
            yield a
