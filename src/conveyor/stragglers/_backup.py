"""Backup execution: a chunk that a stalled replica holds is run again by an idle peer; the first result counts.

Reassignment moves only chunks nobody has started; a replica stopped while it holds one (a quota's stop, a
pause, a busy neighbour) holds up the step. With backups, a replica out of work watches the step's chunks:
once one has been unfinished for ``factor`` times the median of this replica's recent chunk times since it
went idle, it runs the chunk too, on the same weights and data (every replica holds the same weights under
synchronous updates). Each run of chunk ``j`` ends with one atomic ``compare_set`` of the store key ``by/j``
from nothing to the run's name (its replica, and with live reduction its place among the replica's sends):
the run that sets it is the chunk's result and every other run's is dropped, so each chunk counts exactly
once whoever finishes first, and every replica can read who ran it:

    g(t) = (sum over chunks c: n_c grad l_c(W(t))) / (sum of n_c),    each c from the run that won it

which is the synchronous gradient of the batch (:mod:`conveyor.stragglers._trainer`). Where it is decided:
data parallelism commits a chunk after its backward (the gradient that arrives first is used); a pipeline's
first stage commits after the forward, before the activations are sent on, so the next stage receives each
chunk once and returns its gradient to the replica that won it; with live reduction
(:mod:`conveyor.stragglers._live`) every stage commits after its backward, the next stage answering a chunk's
second arrival with the first's gradient (:mod:`conveyor.stragglers._inbox`). One backup of a chunk runs per
round (a key ``backup/j`` names the round's claim, taken by ``compare_set`` from the claim seen before);
synchronous data parallelism has one
round, live reduction a round per peer, each a deadline after the last, so a backup stalled in turn is
backed up too.

A run that has gone past the deadline itself looks, before each of its blocks and before its backward,
whether the chunk was won meanwhile, and stops if so (:class:`ChunkBackedUp`; a pipeline's run still reads the
gradient the next stage returns, and skips only its backward): a slowed replica gives up work a peer has done
and reaches the reduction sooner. Before the deadline a run does no store round trip; a backup looks from
its start, as the run it backs up may end at any moment.

Random state: a chunk's backup draws its own random numbers (dropout's masks differ from the stalled
run's); the result is another draw from the same distribution, not the same tensor.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

__all__ = ["Backups", "ChunkBackedUp", "Watch"]


class ChunkBackedUp(Exception):
    """The chunk running here was finished by a peer: its run stops and is dropped."""


@dataclass(frozen=True)
class Watch:
    """A run of a chunk, watched for a peer's commit of the same chunk."""

    key: str  # the chunk's commit key in the store
    started: float  # perf_counter at its start
    deadline: float  # seconds from the start after which it looks whether a peer committed the chunk


class Backups:
    """One replica's backups of chunks its peers hold, and its watch over the chunks it runs.

    Args:
        store: the job's c10d store.
        replica: this replica (its claims on backups are told apart by it).
        factor: a chunk is backed up once unfinished ``factor`` x the median chunk time after going idle.
        rounds: backups of one chunk, each a deadline after the last.
        poll_s: how often an idle replica looks whether the step's chunks are finished.
        history: how many recent chunk times the median is over.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        replica: int,
        factor: float = 2.0,
        rounds: int = 1,
        poll_s: float = 0.001,
        history: int = 32,
    ) -> None:
        self.store, self.replica, self.factor, self.rounds, self.poll_s = store, replica, factor, rounds, poll_s
        self.times: deque[float] = deque(maxlen=history)
        self.prefix = ""  # the current step's store keys
        self.watching: Watch | None = None  # the run whose forward is running here (its blocks look)

    def deadline_s(self) -> float:
        """How long a chunk may stay unfinished, after this replica went idle, before it is backed up."""
        return self.factor * statistics.median(self.times) if self.times else float("inf")

    def attach(self, module: nn.Module) -> None:
        """Look before each of ``module``'s blocks whether the chunk whose forward runs has been won by a peer."""
        for block in module.children():
            block.register_forward_pre_hook(lambda *_: self.check())

    def begin(self, chunk: int, backup: bool = False) -> Watch:
        """A run of ``chunk`` begins here (``backup``: of a peer's run, watched from its start); its forward is
        the one watched."""
        self.watching = Watch(self._key(chunk), time.perf_counter(), 0.0 if backup else self.deadline_s())
        return self.watching

    def _key(self, chunk: int, prefix: str | None = None) -> str:
        return f"{self.prefix if prefix is None else prefix}/by/{chunk}"

    def check(self) -> None:
        """Raise :class:`ChunkBackedUp` if the run whose forward is running has been committed by a peer."""
        if self.watching is not None and self.lost(self.watching):
            raise ChunkBackedUp(self.watching.key)

    def lost(self, watch: Watch) -> bool:
        """Whether ``watch``'s run is past its deadline and a peer has committed its chunk (before the deadline it
        asks the store nothing)."""
        return time.perf_counter() - watch.started >= watch.deadline and bool(self.store.check([watch.key]))

    def commit(self, watch: Watch, name: str) -> bool:
        """End ``watch``'s run as ``name``: whether its result is the one used (the first to commit)."""
        self.times.append(time.perf_counter() - watch.started)
        if self.watching is watch:
            self.watching = None
        return bool(self.store.compare_set(watch.key, "", name).decode() == name)

    def runner(self, chunk: int) -> str:
        """The name of the run of ``chunk`` that was used (waits for its commit)."""
        return bytes(self.store.get(self._key(chunk))).decode()

    def keys(self, prefix: str, chunks: Iterable[int]) -> list[str]:
        """The store keys of ``chunks`` in the step of ``prefix``."""
        return [key for j in chunks for key in (self._key(j, prefix), f"{prefix}/backup/{j}")]

    def release(self, prefix: str, chunks: Iterable[int]) -> None:
        """Delete the keys of ``chunks`` in the step of ``prefix``, once every replica is past it (every run of its
        chunks has ended)."""
        for key in self.keys(prefix, chunks):
            self.store.delete_key(key)

    def takeovers(self, chunks: Sequence[int]) -> Iterator[int]:
        """Once idle: the chunks of ``chunks`` this replica backs up, each still unfinished at a deadline after
        the last (one backup a chunk a round, :attr:`rounds` rounds); ends once every chunk is finished or the
        rounds are done."""
        deadline = self.deadline_s()
        if deadline == float("inf"):
            return
        keys = {j: self._key(j) for j in chunks}
        seen = dict.fromkeys(chunks, "")  # each chunk's backup claim as last seen here (none: "")
        for round_ in range(1, self.rounds + 1):
            until = time.perf_counter() + deadline
            while not self.store.check(list(keys.values())) and time.perf_counter() < until:
                time.sleep(self.poll_s)
            if self.store.check(list(keys.values())):
                return
            for j, key in keys.items():  # one at a time: the next is claimed once this one's backup has run
                if self.store.check([key]):
                    continue
                mine = f"{round_}@{self.replica}"  # unique to this replica: a claim that returns it is ours
                seen[j] = bytes(self.store.compare_set(f"{self.prefix}/backup/{j}", seen[j], mine)).decode()
                if seen[j] == mine:
                    yield j
