"""A step's work on one worker of a flexible pipeline, and the runs of its chunks on a replica of the first stage.

A run of a chunk on the first stage is its forward (with backups, each block first looks whether a peer has
committed the chunk: :mod:`conveyor.stragglers._backup`), then on data parallelism its loss and backward, in a
pipeline the activations sent on and, once the next stage returns their gradient, its backward (at most
``stages`` chunks are in flight). With backups the run then commits the chunk: only the run that commits it
counts. Its gradient joins the step's sums only then (kept apart until the commit, so a run that loses leaves
the sums as they were); with live reduction it is the chunk's own buffer, sent to every peer
(:mod:`conveyor.stragglers._live`), and the sums stay empty.

The step's buffer (:mod:`conveyor.stragglers._buffer`) is reduced among the replicas (an all-reduce, or the sum
of the chunks' buffers) or, on a later stage, its own.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.stragglers._backup import Backups, ChunkBackedUp, Watch
from conveyor.stragglers._buffer import BufferLayout
from conveyor.stragglers._live import LiveReduction
from conveyor.stragglers._records import StepRecord
from conveyor.stragglers._route import Router
from conveyor.stragglers._statistics import RunningStatistics

__all__ = ["ChunkRun", "FirstStage", "StepWork"]

Mixed = Callable[[], contextlib.AbstractContextManager[Any]]
Backward = Callable[[bool], None]  # back-propagate the run's chunk (True), or only read what it needs (False)


@dataclass(kw_only=True)
class StepWork:
    """One worker's step: what it ran and what its update needs."""

    index: int  # the run's step
    key: str  # its store keys' prefix
    chunks: list[int]  # the batch's non-empty chunks (a later stage: those it ran, each once)
    samples: int  # the batch's
    record: StepRecord
    layout: BufferLayout  # of its buffer and its chunks'
    loss: torch.Tensor  # the committed runs' loss sums (the last stage's; live: in the chunks' buffers)
    terms: torch.Tensor | None = None  # the committed runs' BatchNorm terms (live: in the chunks' buffers)
    owned: range = range(0)  # the first stage: the chunks its share held
    busy: float = 0.0  # seconds inside its runs
    ran: int = 0  # samples in its runs (used or not)
    buffer: torch.Tensor | None = None  # the step's buffer, once reduced
    work: Any = None  # the all-reduce in flight

    @classmethod
    def begin(
        cls, index: int, key: str, *, layout: BufferLayout, dtype: torch.dtype, device: torch.device, **fields: Any
    ) -> StepWork:
        """A step's work, its sums zero."""
        zeros = torch.zeros(layout.terms, dtype=dtype, device=device) if layout.terms else None
        loss = torch.zeros((), dtype=dtype, device=device)
        return cls(index=index, key=key, layout=layout, loss=loss, terms=zeros, **fields)

    @property
    def rate(self) -> float:
        """Samples a second inside its runs (0 without any)."""
        return self.ran / self.busy if self.busy > 0 else 0.0

    def add_term(self, term: torch.Tensor) -> None:
        assert self.terms is not None, "a BatchNorm term for a step begun without them"
        self.terms += term

    def reduce(self, params: Sequence[torch.Tensor], *, reduces: bool, group: Any, extra: Sequence[float]) -> None:
        """Pack the step's sums (``extra`` after them) and start their all-reduce where ``reduces``."""
        self.buffer = self.layout.pack(params, terms=self.terms, loss=self.loss, samples=self.samples, extra=extra)
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True) if reduces else None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()


@dataclass
class ChunkRun:
    """A run of one chunk on the first stage."""

    chunk: int
    count: int  # the batch's non-empty chunks
    start: int  # its first sample's place in the batch
    samples: int
    source: str  # own, taken (from a peer's share) or backup (of a peer's run)
    inputs: Any
    targets: Any  # data parallelism's (``None`` in a pipeline: the last stage has them)
    watch: Watch | None = None  # with backups: the commit it waits for
    out: Any = None  # in a pipeline: the activations sent on
    term: torch.Tensor | None = None  # its BatchNorm term
    seconds: float = field(default=0.0)  # inside its forward and backward


class FirstStage:
    """Runs one step's chunks on a replica of the first stage: forward, backward and, with backups, commit.

    Args:
        step: the step's work, which each committed run adds to.
        router: a pipeline's (``None``: data parallelism, which runs the loss and backward itself).
        depth: chunks in flight at most (a pipeline: its stages).
        live: live reduction's side on this replica, or ``None`` (an all-reduce).
    """

    def __init__(
        self,
        *,
        step: StepWork,
        module: nn.Module,
        params: Sequence[torch.Tensor],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        mixed: Mixed,
        statistics: RunningStatistics | None,
        backups: Backups | None,
        live: LiveReduction | None,
        router: Router | None,
        queue: str,
        next_rank: int,
        depth: int,
        replica: int,
    ) -> None:
        self.step, self.module, self.params, self.loss_fn, self.mixed = step, module, list(params), loss_fn, mixed
        self.statistics, self.backups, self.live, self.router = statistics, backups, live, router
        self.queue, self.next_rank, self.depth, self.replica = queue, next_rank, depth, replica
        self._in_flight: deque[ChunkRun] = deque()

    def run(self, run: ChunkRun) -> None:
        """Run ``run``'s forward; on data parallelism its backward and commit, in a pipeline those of the oldest
        chunk in flight once ``depth`` are."""
        began = time.perf_counter()
        if self.backups is not None:
            run.watch = self.backups.begin(run.chunk, backup=run.source == "backup")
        try:
            with self.mixed():
                out = self.module(run.inputs)
        except ChunkBackedUp:  # a peer committed it first: the run stops
            self._end_forward(run)
            self._dropped(run, began)
            return
        self._end_forward(run)
        if self.router is None:
            with self.mixed():
                loss = self.loss_fn(out, run.targets)
            n = run.samples

            def backward(go: bool) -> None:
                if go:
                    (loss * n).backward()  # a sum over the chunk's samples

            self._finish(run, backward, loss.detach() * n, began)
            return
        run.out = out
        index, dst = self.step.index, self.next_rank
        self.router.send(self.queue, out, step=index, chunk=run.chunk, count=run.count, start=run.start, dst=dst)
        run.seconds += time.perf_counter() - began
        self._in_flight.append(run)
        if len(self._in_flight) >= self.depth:
            self._backward(self._in_flight.popleft())

    def drain(self) -> None:
        """Back-propagate the chunks still in flight."""
        while self._in_flight:
            self._backward(self._in_flight.popleft())

    def _end_forward(self, run: ChunkRun) -> None:
        """The forward ended (or stopped): take its BatchNorm term, and put the layers' statistics back."""
        if self.backups is not None:
            self.backups.watching = None
        if self.statistics is not None:
            run.term = self.statistics.end_chunk(run.chunk, run.count)

    def _backward(self, run: ChunkRun) -> None:
        """A pipeline's chunk: read the gradient the next stage returns, back-propagate and commit it."""
        router = self.router
        assert router is not None

        def backward(go: bool) -> None:
            router.backward(run.out, self.next_rank, run=go)  # read even where the run is dropped

        self._finish(run, backward, None, time.perf_counter())

    def _finish(self, run: ChunkRun, backward: Backward, loss: torch.Tensor | None, began: float) -> None:
        """Back-propagate ``run``'s chunk and, with backups, commit it: its gradient counts only if its run is the
        one used."""
        if self.backups is None:
            backward(True)
            run.seconds += time.perf_counter() - began
            self._counted(run, loss)
            return
        assert run.watch is not None
        kept = [p.grad for p in self.params]  # the step's sums so far, apart from this run's gradient
        for p in self.params:
            p.grad = None
        lost = self.backups.lost(run.watch)
        backward(not lost)
        name = self.live.name() if self.live is not None else str(self.replica)
        won = not lost and self.backups.commit(run.watch, name)
        run.seconds += time.perf_counter() - began
        if won and self.live is not None:
            self._deliver(run, loss)
        for p, g in zip(self.params, kept, strict=True):
            if won and self.live is None and p.grad is not None and g is not None:
                p.grad += g
            elif not won or self.live is not None:
                p.grad = g
        if won:
            self._counted(run, loss if self.live is None else None)
        else:
            self._dropped(run, None)

    def _deliver(self, run: ChunkRun, loss: torch.Tensor | None) -> None:
        """Live reduction: the committed run's buffer, sent to every peer."""
        assert self.live is not None
        loss_sum = loss if loss is not None else self.step.loss.new_zeros(())
        buffer = self.step.layout.pack(
            self.params, terms=run.term, loss=loss_sum, samples=run.samples, extra=[run.seconds]
        )
        self.live.deliver(run.chunk, buffer, self.step.key)

    def _counted(self, run: ChunkRun, loss: torch.Tensor | None) -> None:
        """A run whose result is used: recorded, and its loss and term added to the step's (all-reduce)."""
        step, record = self.step, self.step.record
        step.ran, step.busy = step.ran + run.samples, step.busy + run.seconds
        record.samples, record.chunks = record.samples + run.samples, record.chunks + 1
        record.taken += run.samples if run.source == "taken" else 0
        record.backups += run.samples if run.source == "backup" else 0
        if self.live is None:
            if loss is not None:
                step.loss += loss
            if run.term is not None:
                step.add_term(run.term)

    def _dropped(self, run: ChunkRun, began: float | None) -> None:
        """A run a peer's replaced: its samples recorded as dropped."""
        if began is not None:
            run.seconds += time.perf_counter() - began
        self.step.ran, self.step.busy = self.step.ran + run.samples, self.step.busy + run.seconds
        self.step.record.dropped += run.samples
