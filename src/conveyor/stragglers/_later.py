"""A later stage's step: the chunks the stage before sends, each run once as it arrives and answered with the
gradient of its inputs.

A stage after the first has one worker, so its sums are the batch's and it reduces nothing. It runs each
chunk's forward as the chunk arrives (:mod:`conveyor.stragglers._inbox` gives each chunk of the step once);
the last stage takes the chunk's targets from the batch at the chunk's start (the chunks' sizes follow the
first stage's measured speeds), and runs the loss and backward; a stage between sends the activations on
(at most ``depth`` in flight) and back-propagates the gradient the next stage returns. Either way the
gradient of the chunk's inputs goes back to the replica that sent it, and to any that sent it again.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.runtime import batch_size, split_batch, to_device
from conveyor.stragglers._chunks import StepWork
from conveyor.stragglers._inbox import Inbox
from conveyor.stragglers._route import Entry, Router
from conveyor.stragglers._statistics import RunningStatistics

__all__ = ["LaterStage"]


@dataclass(frozen=True, kw_only=True)
class LaterStage:
    """The parts of a later stage's worker that run its steps."""

    module: nn.Module
    loss_fn: Callable[[Any, Any], torch.Tensor]
    mixed: Callable[[], contextlib.AbstractContextManager[Any]]
    statistics: RunningStatistics | None
    router: Router
    next_rank: int  # the next stage's worker (a stage between)
    depth: int  # chunks in flight at most (a stage between: the stages after it)
    last: bool

    def run(self, step: StepWork, inbox: Inbox, targets: Any, onward: str) -> None:
        """Run step ``step.index``'s chunks as they arrive on ``inbox``; ``onward``: the next stage's queue."""
        in_flight: deque[tuple[Any, Entry]] = deque()
        for entry in inbox.arrivals(step.index):
            n = batch_size(entry.inputs)
            with self.mixed():
                out = self.module(entry.inputs)
            if self.statistics is not None:
                step.add_term(self.statistics.end_chunk(entry.chunk, entry.count))
            step.chunks.append(entry.chunk)
            record = step.record
            step.samples, record.samples, record.chunks = step.samples + n, record.samples + n, record.chunks + 1
            if self.last:
                y = split_batch(targets, [entry.start, n, batch_size(targets) - entry.start - n])[1]
                with self.mixed():
                    loss = self.loss_fn(out, to_device(y, step.loss.device))
                (loss * n).backward()  # a sum over the chunk's samples
                step.loss += loss.detach() * n
                inbox.answer(entry)
                continue
            chunk, count, start = entry.chunk, entry.count, entry.start
            self.router.send(onward, out, step=step.index, chunk=chunk, count=count, start=start, dst=self.next_rank)
            in_flight.append((out, entry))
            if len(in_flight) >= self.depth:
                self._answer(inbox, *in_flight.popleft())
        while in_flight:
            self._answer(inbox, *in_flight.popleft())

    def _answer(self, inbox: Inbox, out: Any, entry: Entry) -> None:
        """Back-propagate the gradient the next stage returns for ``out``; answer ``entry``'s sender."""
        self.router.backward(out, self.next_rank)
        inbox.answer(entry)
