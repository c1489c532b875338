"""A later stage's chunks of a run: read from its queue in the order they were announced, each chunk of a step
run once, whoever sent it.

A stage after the first has one worker. Its queue (:mod:`conveyor.stragglers._route`) carries, per step, each
chunk the stage before sent on, then the run's end (with the run's step count: a replica of the first stage
with slack may still be sending its last steps' chunks after the end is announced). A chunk announced for a
later step than this stage's (a replica running ahead under slack) waits in a backlog, its payload unread
until the stage reaches that step; a sender's payloads are still read in the order it sent them, since each
sender sends its steps in order.

With live reduction (:mod:`conveyor.stragglers._live`) a chunk may arrive twice: a backup of a stalled
replica's run sends it again, maybe steps later, once the stalled replica thaws. The first arrival runs, the
gradient of its inputs is kept, and a later arrival of the chunk is answered with that gradient, its payload
read and dropped, without running it again: a backup runs on the same weights and data, so its activations
are the first run's (a model that draws random numbers, dropout, is the exception: there the backup's own
masks meet the first run's gradient). A step's kept gradients are dropped once the first stage releases it
(every replica is past the step, so none of its chunks comes again).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator

import torch

from conveyor.stragglers._route import END, RELEASE, Entry, Router

__all__ = ["Inbox"]

Key = tuple[int, int]  # (step, chunk)


class Inbox:
    """The chunks of one run on a later stage.

    Args:
        router: this worker's router.
        queue: the run's queue of this stage.
        onward: the next stage's queue, where releases and the end are passed on (``None`` on the last stage).
        keep: keep each chunk's input gradients until its step is released, to answer duplicates (live
            reduction); without it a duplicate cannot come.
    """

    def __init__(self, router: Router, queue: str, onward: str | None, *, keep: bool) -> None:
        self.router, self.queue, self.onward, self.keep = router, queue, onward, keep
        self.steps: int | None = None  # the run's step count, once its end is read
        self._backlog: dict[int, deque[Entry]] = defaultdict(deque)  # chunks of steps ahead, unread
        self._grads: dict[Key, list[torch.Tensor]] = {}  # input gradients sent back, for duplicates (keep)
        self._waiting: dict[Key, list[Entry]] = defaultdict(list)  # duplicates of chunks not back-propagated yet
        self._seen: set[Key] = set()  # chunks of unreleased steps that arrived once (keep)

    def has(self, step: int) -> bool:
        """Whether the run has step ``step`` (a stage that reads no batches asks): waits for its first chunk, or
        the run's end."""
        entry = self._next(step)
        if entry is not None:
            self._backlog[step].appendleft(entry)
        return entry is not None

    def arrivals(self, step: int) -> Iterator[Entry]:
        """Step ``step``'s chunks, each once, with its payload, in the order announced."""
        ran, count = 0, None
        while count is None or ran < count:
            entry = self._next(step)
            if entry is None:
                raise RuntimeError(f"the run ended before step {step} of {self.queue} had all its chunks")
            count, ran = entry.count, ran + 1
            yield self.router.receive(entry)

    def answer(self, entry: Entry) -> None:
        """Send the gradient of ``entry``'s inputs (after its backward) to its sender, and to any duplicate's."""
        grads = self.router.input_grads(entry)
        self.router.send_grads(grads, entry.sender)
        if not self.keep:
            return
        key = (entry.step, entry.chunk)
        self._grads[key] = [g.detach() for g in grads]
        for duplicate in self._waiting.pop(key, []):
            self.router.send_grads(self._grads[key], duplicate.sender)

    def finish(self) -> None:
        """After this stage's last step: read the queue to the run's end (answering duplicates of the run's chunks),
        pass the end on and delete the queue's counter."""
        while self.steps is None:
            if (entry := self._read()) is not None:
                raise RuntimeError(f"chunk {entry.chunk} of step {entry.step} came after the last step on {self.queue}")
        self.router.close(self.queue)
        if self.onward is not None:
            self.router.notify(self.onward, END, self.steps)

    def _next(self, step: int) -> Entry | None:
        """The next unrun chunk of ``step``: from the backlog, else the queue; ``None`` where the run has no such
        step."""
        if self._backlog.get(step):
            return self._backlog[step].popleft()
        while self.steps is None or step < self.steps:
            entry = self._read()
            if entry is not None and entry.step != step:
                self._backlog[entry.step].append(entry)
            elif entry is not None:
                return entry
        return None

    def _read(self) -> Entry | None:
        """Read the queue's next place: a chunk's first arrival is returned (its payload unread); the run's end,
        a release and a duplicate are handled here (``None``)."""
        entry = self.router.next(self.queue)
        if entry.kind == END:
            self.steps = entry.step
            return None
        if entry.kind == RELEASE:
            self._release(entry.step)
            return None
        key = (entry.step, entry.chunk)
        if key in self._seen:
            self._duplicate(entry)
            return None
        if self.keep:
            self._seen.add(key)
        return entry

    def _duplicate(self, entry: Entry) -> None:
        """Another run of a chunk that arrived before: its payload read and dropped, its sender answered with
        the first arrival's gradient (once it is known)."""
        self.router.receive(entry, training=False)
        key = (entry.step, entry.chunk)
        if key in self._grads:
            self.router.send_grads(self._grads[key], entry.sender)
        else:
            self._waiting[key].append(entry)

    def _release(self, step: int) -> None:
        """Every replica of the first stage is past ``step``: drop what was kept for it, and pass it on."""
        for key in [k for k in self._seen if k[0] == step]:
            self._seen.discard(key)
            self._grads.pop(key, None)
        if self.onward is not None:
            self.router.notify(self.onward, RELEASE, step)
