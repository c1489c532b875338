"""Backup execution: a chunk that a stalled replica holds is run again by an idle peer; the first result counts.

Reassignment moves only chunks nobody has started; a replica stopped while it holds one (a quota's stop, a
pause, a busy neighbour) holds up the step. With backups, a replica out of work watches the step's chunks:
once one has been unfinished for ``factor`` times the median of this replica's recent chunk times since it
went idle, it runs the chunk too, on the same weights and data (every replica holds the same weights under
synchronous updates). Each run of chunk ``j`` ends with one atomic ``add`` to the store key ``won/j``; the
run whose ``add`` returns 1 is the chunk's result and every other run's is dropped, so each chunk counts
exactly once whoever finishes first:

    g(t) = (sum over chunks c: n_c grad l_c(W(t))) / (sum of n_c),    each c from the run that won it

which is the synchronous gradient of the batch (:mod:`conveyor.stragglers._trainer`). Where it is decided:
data parallelism commits a chunk after its backward (the gradient that arrives first is used); a pipeline's
first stage commits after the forward, before the activations are sent on, so the next stage receives each
chunk once and returns its gradient to the replica that won it. At most one backup runs per chunk (a second
key ``backup/j``, taken by one ``add`` too).

A run that has gone past the deadline itself looks, before each of its blocks and before its backward,
whether the chunk was won meanwhile, and stops if so (:class:`ChunkBackedUp`): a slowed replica gives up work
a peer has done and reaches the all-reduce sooner. Before the deadline a run does no store round trip; a
backup looks from its start, as the run it backs up may end at any moment.

Random state: a chunk's backup draws its own random numbers (dropout's masks differ from the stalled
run's); the result is another draw from the same distribution, not the same tensor.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Backups", "ChunkBackedUp"]


class ChunkBackedUp(Exception):
    """The chunk running here was finished by a peer: its run stops and is dropped."""


class Backups:
    """One replica's backups of chunks its peers hold, and its watch over the chunks it runs.

    Args:
        store: the job's c10d store.
        factor: a chunk is backed up once unfinished ``factor`` x the median chunk time after going idle.
        poll_s: how often an idle replica looks whether the step's chunks are finished.
        history: how many recent chunk times the median is over.
    """

    def __init__(self, store: dist.Store, *, factor: float = 2.0, poll_s: float = 0.001, history: int = 32) -> None:
        self.store, self.factor, self.poll_s = store, factor, poll_s
        self.times: deque[float] = deque(maxlen=history)
        self.prefix = ""  # the current step's store keys
        self._watched: tuple[str, float, float] | None = None  # the running chunk's key, start and deadline

    def deadline_s(self) -> float:
        """How long a chunk may stay unfinished, after this replica went idle, before it is backed up."""
        return self.factor * statistics.median(self.times) if self.times else float("inf")

    def attach(self, module: nn.Module) -> None:
        """Look before each of ``module``'s blocks whether the chunk running has been won by a peer."""
        for block in module.children():
            block.register_forward_pre_hook(lambda *_: self.check())

    def start(self, chunk: int, backup: bool = False) -> None:
        """A run of ``chunk`` begins here (``backup``: of a peer's run, watched from its start)."""
        self._watched = (f"{self.prefix}/won/{chunk}", time.perf_counter(), 0.0 if backup else self.deadline_s())

    def check(self) -> None:
        """Raise :class:`ChunkBackedUp` if the running chunk is past the deadline and a peer has won it."""
        if self._watched is None:
            return
        key, started, deadline = self._watched
        if time.perf_counter() - started >= deadline and self.store.check([key]):
            raise ChunkBackedUp(key)

    def commit(self, chunk: int) -> bool:
        """End the run of ``chunk``: whether its result is the one used (the first to commit)."""
        assert self._watched is not None, "commit() without start()"
        self.times.append(time.perf_counter() - self._watched[1])
        self._watched = None
        return int(self.store.add(f"{self.prefix}/won/{chunk}", 1)) == 1

    def abandon(self) -> None:
        """The running chunk stopped (:class:`ChunkBackedUp`): nothing is watched."""
        self._watched = None

    def run(
        self,
        chunk: int,
        params: Sequence[torch.Tensor],
        compute: Callable[[Callable[[], None]], Any],
        *,
        backup: bool = False,
    ) -> tuple[bool, Any]:
        """Run ``compute(check)`` as a run of ``chunk``: whether it won, and what ``compute`` returned.

        The run's gradients are kept apart from the sums ``params`` hold until it wins, then added; a run
        that loses, or stops because a peer won, leaves the sums as they were. ``compute`` calls ``check``
        where it may stop (before a backward); the blocks of an attached module look by themselves.
        """
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.start(chunk, backup)
        try:
            out = compute(self.check)
            won = self.commit(chunk)
        except ChunkBackedUp:
            self.abandon()
            out, won = None, False
        for p, g in zip(params, kept, strict=True):
            if not won or p.grad is None:
                p.grad = g
            elif g is not None:
                p.grad += g
        return won, out

    def release(self, prefix: str, chunks: Iterable[int]) -> None:
        """Delete the keys of ``chunks`` in the step of ``prefix``, once every replica is past it (its
        all-reduce is done: every run of its chunks has ended)."""
        for j in chunks:
            self.store.delete_key(f"{prefix}/won/{j}")
            self.store.delete_key(f"{prefix}/backup/{j}")

    def takeovers(self, chunks: Sequence[int]) -> Iterator[int]:
        """Once idle: the chunks of ``chunks`` still unfinished at the deadline that this replica backs up."""
        deadline = self.deadline_s()
        if deadline == float("inf"):
            return
        keys = {j: f"{self.prefix}/won/{j}" for j in chunks}
        until = time.perf_counter() + deadline
        while not self.store.check(list(keys.values())):
            if time.perf_counter() < until:
                time.sleep(self.poll_s)
                continue
            for j, key in keys.items():
                if not self.store.check([key]) and int(self.store.add(f"{self.prefix}/backup/{j}", 1)) == 1:
                    yield j
            return
