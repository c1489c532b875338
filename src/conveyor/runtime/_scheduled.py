"""One worker among others: a run of the schedule's action lists through the executor.

Per :meth:`~conveyor.runtime.Pipeline.train` call, worker 0 announces the run's length through the job's c10d store
as it reads the batches (:class:`~conveyor.runtime._feed.RunLength`), every worker generates its own action list
from the schedule as the length becomes known, and the executor runs it. Where the schedule's forwards name
the weight version they use (PipeDream's stashing), this runner also tells the executor which versions a forward
still to run will need, so the others can be dropped as soon as they are done with. A pipeline of one worker
needs none of this (:mod:`conveyor.runtime._solo`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from conveyor.errors import InputError
from conveyor.runtime._executor import Executor, RunOutput
from conveyor.runtime._feed import BatchSource, RunLength, read_ahead
from conveyor.schedule import Kind, worker_actions

__all__ = ["Scheduled"]

_PIPELINES = itertools.count()  # every worker builds its pipelines in the same order, so the ids agree


class Scheduled:
    """Runs this worker's actions of each run of a pipeline's schedule.

    Args:
        kind: the schedule.
        executor: this worker's executor.
        worker: this worker's rank.
        first_replica: the rank of its stage's first replica.
        stage, replicas, microbatches: its stage, the replicas of every stage, microbatches per batch.
        stashing: whether this worker stashes weight versions.
        predict: the staleness its published weights are extrapolated over (0: none).
    """

    def __init__(
        self,
        *,
        kind: Kind,
        executor: Executor,
        worker: int,
        first_replica: int,
        stage: int,
        replicas: tuple[int, ...],
        microbatches: int,
        stashing: bool,
        predict: int,
    ) -> None:
        self.kind, self.executor, self.worker, self.first_replica = kind, executor, worker, first_replica
        self.stage, self.replicas, self.microbatches = stage, replicas, microbatches
        self.stashing, self.predict = stashing, predict
        self.workers = sum(replicas)
        self._id, self._runs = next(_PIPELINES), 0

    def run(self, batches: Iterable[Any] | None, stepped: Callable[[], None]) -> tuple[RunOutput, int]:
        """One run over ``batches`` (read by the first and last stages only): its output and the batches it had."""
        first, last = self.stage == 0, self.stage == len(self.replicas) - 1
        source = None
        if batches is not None and (first or last):
            source = BatchSource(batches, self.microbatches, first, last, self.worker)
        self._runs += 1
        length = RunLength(
            dist.distributed_c10d._get_default_store(),  # the job's, the one torch.distributed was initialised with
            f"conveyor/pipeline{self._id}/run{self._runs}",
            window=read_ahead(self.workers, self.microbatches),
            readers=self.workers - 1,
            batches=batches,
            source=source if self.worker == 0 else None,
        )
        actions = worker_actions(self.kind, self.worker, self.replicas, self.microbatches, length)
        out = self.executor.run(
            actions,
            source,
            training=True,
            stashing=self.stashing,
            will_use=self._pinned_versions(length),
            on_step=stepped,
            predict=self.predict,
        )
        if self.worker == 0 and source is not None and source.fill(length.total):
            raise InputError(f"the batches on worker 0 yielded more than their len() of {length.total}")
        return out, length.total

    def _pinned_versions(self, length: RunLength) -> Callable[[int], bool] | None:
        """For schedules whose forwards name their weight version: whether a forward of this worker not yet
        run will use a version (its own microbatches come in order, their versions never decrease)."""
        if self.kind.version(self.stage, 0, self.replicas, self.microbatches) is None:
            return None
        r, m = self.replicas[self.stage], self.microbatches
        first = self.worker - self.first_replica
        weights = self.executor.weights

        def will_use(version: int) -> bool:
            k = weights.last_forward + r if weights.last_forward >= 0 else first
            while (exists := length.known(k // m)) is not False:
                if exists is None:  # not announced yet: keep the version rather than wait in a backward
                    return True
                v = self.kind.version(self.stage, k, self.replicas, m)
                assert v is not None
                if v >= version:
                    return v == version
                k += r
            return False

        return will_use
