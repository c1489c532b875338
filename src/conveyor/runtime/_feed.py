"""A run's batches, read as the run goes: how many there are, and each worker's share of them.

Only the workers that need a batch read it: the first stage its inputs, the last stage its targets,
each from its own copy of the same iterable (the same batches in the same order on every worker). The
other workers never touch the data; they learn the run's length from the first worker through the c10d
store. A run whose batches have a ``len()`` announces it at once; a generator's length is only known
at its end, so the first worker reads a window of batches ahead and announces, window by window, how
many it found. Generation asks about a batch at most ``3 x workers`` microbatches ahead of the work,
so the window covers that (:func:`read_ahead`) and memory stays bounded however long the run is. The store
stays bounded too: the last of the other workers to read an announcement deletes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist

from conveyor.errors import InputError
from conveyor.runtime._microbatch import batch_size, split

__all__ = ["BatchSource", "RunLength", "cut_batch", "read_ahead"]


def read_ahead(workers: int, microbatches: int) -> int:
    """Batches the first worker reads beyond the one asked about: generation on any worker asks at most a
    stage's warm-up and a round of replicas (both at most ``workers`` microbatches) plus an update beyond
    the work it runs, which is never more than that ahead of the first worker's."""
    return 2 + -(-3 * workers // microbatches)


class BatchSource:
    """One worker's view of the batches: the inputs and/or targets of each microbatch, read on demand.

    Batches are read in order and dropped once a later batch is asked for, so a worker holds at most the
    batches it has read ahead.

    Args:
        batches: the ``(inputs, targets)`` batches.
        microbatches: the parts each batch is cut into (:func:`~conveyor.runtime._microbatch.split`).
        inputs, targets: which parts this worker needs (the other is dropped on reading).
        worker: this worker's rank, for error messages.
    """

    def __init__(
        self, batches: Iterable[tuple[Any, Any]], microbatches: int, inputs: bool, targets: bool, worker: int
    ) -> None:
        self._iter: Iterator[tuple[Any, Any]] = iter(batches)
        self._m, self._inputs, self._targets, self._worker = microbatches, inputs, targets, worker
        self._parts: dict[int, tuple[list[Any] | None, list[Any] | None, list[int]]] = {}
        self.read = 0  # batches read so far
        self.ended = False
        self.fill(0)  # a batch this worker cannot use fails here, before any worker waits on another

    def fill(self, batch: int) -> bool:
        """Read up to batch ``batch``; whether it exists."""
        while self.read <= batch and not self.ended:
            item = next(self._iter, None)
            if item is None:
                self.ended = True
                break
            self._parts[self.read] = cut_batch(
                item, self._m, inputs=self._inputs, targets=self._targets, worker=self._worker, index=self.read
            )
            self.read += 1
        return batch < self.read

    def microbatch(self, k: int) -> tuple[Any, Any, int]:
        """Inputs (or ``None``), targets (or ``None``) and sample count of microbatch ``k``.

        Raises:
            ValueError: the batches ran out before microbatch ``k``'s.
        """
        b = k // self._m
        if not self.fill(b):
            raise InputError(
                f"worker {self._worker}'s batches end after {self.read}, but the run has at least {b + 1}: give every "
                "worker the same batches in the same order"
            )
        for old in [x for x in self._parts if x < b]:
            del self._parts[old]
        inputs, targets, sizes = self._parts[b]
        i = k % self._m
        return (None if inputs is None else inputs[i]), (None if targets is None else targets[i]), sizes[i]

    def batch_samples(self, k: int) -> int:
        """The samples of the batch microbatch ``k`` belongs to (it must have been read: ask after its
        :meth:`microbatch`)."""
        return sum(self._parts[k // self._m][2])


def cut_batch(
    item: Any, microbatches: int, *, inputs: bool, targets: bool, worker: int, index: int
) -> tuple[list[Any] | None, list[Any] | None, list[int]]:
    """Batch ``index``'s microbatches: the parts of its inputs (or ``None`` where not ``inputs``), of its targets
    (likewise) and their sample counts.

    Raises:
        InputError: the batch is not an ``(inputs, targets)`` pair, lacks a part wanted, or has no samples.
    """
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise InputError(f"a batch must be an (inputs, targets) pair, got {type(item).__name__}")
    parts = []
    for wanted, value, what in ((inputs, item[0], "inputs"), (targets, item[1], "targets")):
        if wanted and value is None:
            raise InputError(f"worker {worker} needs the batches' {what}: pass them on this worker")
        parts.append(None if not wanted else [value] if microbatches == 1 else split(value, microbatches))
    sizes = [batch_size(p) for p in (parts[0] or parts[1] or [])]
    if not sum(sizes):
        raise InputError(f"batch {index} has no samples: leave empty batches out")
    return parts[0], parts[1], sizes


class RunLength:
    """The number of batches in a run, as every worker learns it (a :class:`~conveyor.schedule.BatchCount`).

    Worker 0 announces it through the c10d ``store`` under ``prefix`` to the ``readers`` other workers: the
    length at once when its batches have a ``len()``, else window by window (``window`` batches each, read
    ahead by its :class:`BatchSource`). A worker whose own batches have a ``len()`` checks it against
    worker 0's.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        *,
        window: int,
        readers: int,
        batches: Iterable[Any] | None,
        source: BatchSource | None = None,
    ) -> None:
        self._store, self._prefix, self._window, self._source = store, prefix, window, source
        self._readers = readers
        self._known: int | None = None  # the exact length, once known
        self._seen = 0  # batches known to exist
        self._announced = 0  # windows announced (worker 0)
        own = _length(batches)
        if source is not None:  # worker 0
            self._announce("length", -1 if own is None else own)
            self._known = own
            return
        announced = self._read("length")
        self._known = None if announced < 0 else announced
        if own is not None and announced >= 0 and own != announced:
            raise InputError(
                f"this worker's batches have len() {own} but worker 0's have {announced}: give every worker the "
                "same batches"
            )

    def has(self, batch: int) -> bool:
        """Whether the run has batch ``batch`` (on workers other than worker 0, waits until it is known)."""
        while self._known is None and batch >= self._seen:
            self._learn_window(self._seen // self._window)
        return batch < (self._known if self._known is not None else self._seen)

    def known(self, batch: int) -> bool | None:
        """Whether the run has batch ``batch``, or ``None`` if that is not known yet (never waits)."""
        if self._known is not None:
            return batch < self._known
        return True if batch < self._seen else None

    @property
    def total(self) -> int:
        """The run's length (learning it to the end if need be)."""
        while self._known is None:
            self._learn_window(self._seen // self._window)
        return self._known

    def _learn_window(self, j: int) -> None:
        if self._source is not None:
            # Announce the next window too: another worker's question runs at most a window ahead of worker
            # 0's, so it never waits on worker 0 reaching a batch that worker 0 does not yet need.
            self._source.fill((j + 2) * self._window - 1)
            last = min(j + 2, self._source.read // self._window + 1)  # none past the first short one: unread
            for w in range(self._announced, last):
                self._announce(str(w), self._count(w))
            self._announced = max(self._announced, last)
            count = self._count(j)
        else:
            count = self._read(str(j))
        self._seen = j * self._window + count
        if count < self._window:
            self._known = self._seen

    def _announce(self, name: str, value: int) -> None:
        if self._readers:  # alone, nobody would read (or delete) it
            self._store.set(f"{self._prefix}/{name}", str(value))

    def _read(self, name: str) -> int:
        """An announcement's value, waiting for it; the last reader deletes it (every reader reads each once)."""
        key = f"{self._prefix}/{name}"
        value = int(self._store.get(key))
        if int(self._store.add(f"{key}/reads", 1)) == self._readers:
            self._store.delete_key(key)
            self._store.delete_key(f"{key}/reads")
        return value

    def _count(self, j: int) -> int:
        assert self._source is not None
        return max(0, min(self._window, self._source.read - j * self._window))


def _length(batches: Iterable[Any] | None) -> int | None:
    try:
        return None if batches is None else len(batches)  # type: ignore[arg-type]
    except TypeError:
        return None
