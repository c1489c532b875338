"""One worker's stage of a :class:`~conveyor.stragglers.FlexiblePipeline` beyond its steps: where it sits, its
runs' store keys and queues and how a run ends, its evaluation through the first stage's replica 0, its per-step
records, and its checkpoints, the replicas' floating buffers averaged first (other than BatchNorm's running
statistics, which the replicas agree every step: :mod:`conveyor.stragglers._statistics`)."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.errors import InputError
from conveyor.runtime import to_device
from conveyor.runtime.parts import StagePosition, load_stage, save_stages
from conveyor.stragglers._backup import Backups
from conveyor.stragglers._chunks import StepWork
from conveyor.stragglers._claims import share_keys
from conveyor.stragglers._inbox import Inbox
from conveyor.stragglers._live import LiveReduction
from conveyor.stragglers._records import StepRecord
from conveyor.stragglers._route import END, RELEASE, Router
from conveyor.stragglers._statistics import RunningStatistics

__all__ = ["FlexibleStage"]


class FlexibleStage(StagePosition):
    """The part of :class:`~conveyor.stragglers.FlexiblePipeline` that is not a step (set up by it)."""

    worker: int
    replicas: int  # the first stage's
    chunks: int | None  # each replica's per batch (None: auto, chosen by the first run)
    store: dist.Store
    device: torch.device
    autocast: torch.dtype | None
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    router: Router
    records: list[StepRecord]
    steps: int
    _group: Any  # the first stage's replicas' process group (None: the world's, or unreplicated)
    _next: int  # the rank of the next stage's worker
    _output: int  # the last stage's first worker
    _model_shapes: Any
    _id: int
    _runs: int
    _evals: int
    _statistics: RunningStatistics | None
    _backups: Backups | None
    _live: LiveReduction | None

    @property
    def is_output(self) -> bool:
        """Whether this worker reports the losses and the evaluation's output (the last stage's first)."""
        return self.worker == self._output

    @property
    def _replica(self) -> int:
        return self.worker if self.stage == 0 else 0

    def _mixed(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` to the trainer's dtype, or nothing."""
        return torch.autocast(self.device.type, self.autocast) if self.autocast else contextlib.nullcontext()

    def _steps(self, batches: Iterable[tuple[Any, Any]] | None, inbox: Inbox | None) -> Iterator[tuple[Any, Any]]:
        """The run's batches; a stage between the first and the last: a step per batch the first stage sends."""
        if batches is not None:
            yield from batches
            return
        assert inbox is not None, "the first stage reads batches"
        for index in itertools.count():
            if not inbox.has(index):
                return
            yield None, None

    def _end_run(self, inbox: Inbox | None, steps: int) -> None:
        """Every replica of the first stage has finished the run: the last to finish tells the next stage the run's
        step count; a later stage reads its queue to that end, answering late duplicates."""
        finished = f"{self._run_key()}/finished"
        if self.stage == 0 and self.num_stages > 1 and int(self.store.add(finished, 1)) == self.replicas:
            self.store.delete_key(finished)
            self.router.notify(self._queue(1), END, steps)
        if inbox is not None:
            inbox.finish()
        self.router.wait_sends()

    def _run_key(self) -> str:
        return f"conveyor/flexible{self._id}/run{self._runs}"

    def _step_key(self, index: int) -> str:
        """The store keys of step ``index`` of this trainer's current run (its claims, its commits)."""
        return f"{self._run_key()}/step{index}"

    def _queue(self, to_stage: int) -> str:
        return f"{self._run_key()}/to{to_stage}"

    @property
    def _share(self) -> int:
        """Chunks each replica owns (chosen at the first run where ``chunks="auto"``)."""
        if self.chunks is None:
            raise RuntimeError("chunks='auto' are chosen by the first train(), before any step")
        return self.chunks

    def _release(self, step: StepWork) -> None:
        """Delete a step's store keys once every replica is past it, and tell the next stage (which then drops
        what it kept to answer the step's duplicates)."""
        if self.stage != 0:
            return
        if self._live is not None:
            assert self._backups is not None
            keys = [*share_keys(step.key, self.replicas), *self._backups.keys(step.key, step.chunks)]
            self._live.applied(step.key, keys, lambda: self._tell_released(step.index))
            return
        self.store.delete_key(share_keys(step.key, self.replicas)[self.worker])
        if self._backups is not None:
            self._backups.release(step.key, step.owned)
            if self.worker == 0:  # the all-reduce is done: every replica is past the step
                self._tell_released(step.index)

    def _tell_released(self, index: int) -> None:
        if self.num_stages > 1:
            self.router.notify(self._queue(1), RELEASE, index)

    @property
    def _reduces(self) -> bool:
        return self.stage == 0 and self.replicas > 1

    @torch.no_grad()
    def _average_buffers(self) -> None:
        """Average the replicas' floating buffers (a module's own statistics: each replica saw other chunks)."""
        agreed = {id(b) for b in self._statistics.buffers()} if self._statistics is not None else set()
        buffers = [b for b in self.module.buffers() if b.is_floating_point() and id(b) not in agreed]
        if self._reduces and buffers:
            flat = torch.cat([b.flatten() for b in buffers])
            dist.all_reduce(flat, group=self._group)
            flat /= self.replicas
            offset = 0
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()

    @torch.no_grad()
    def evaluate(self, inputs: Any = None) -> Any:
        """The model's output for ``inputs`` through replica 0 of the first stage (every worker calls it; only
        worker 0 needs ``inputs``); returned on the output worker, ``None`` elsewhere."""
        self._average_buffers()
        self.module.eval()
        self._evals += 1
        queue = f"conveyor/flexible{self._id}/eval{self._evals}/to"
        if self.stage == 0 and self.worker != 0:
            return None
        if self.stage == 0:
            if inputs is None:
                raise InputError("worker 0 needs the batch's inputs to evaluate: pass them on this worker")
            with self._mixed():
                out = self.module(to_device(inputs, self.device))
        else:
            entry = self.router.next(f"{queue}{self.stage}")
            self.router.close(f"{queue}{self.stage}")
            with self._mixed():
                out = self.module(self.router.receive(entry, training=False).inputs)
        if not self.is_last:
            self.router.send(f"{queue}{self.stage + 1}", out, step=0, chunk=0, count=1, start=0, dst=self._next)
            self.router.wait_sends()
        return out if self.is_output else None

    def wan_records(self) -> None:
        """No outer sync's counts: a flexible pipeline runs inside one data centre."""
        return None

    def gather_records(self) -> list[dict[str, Any]] | None:
        """Every worker's records since the last call, on the output worker (``None`` elsewhere); every worker
        calls it."""
        mine, self.records = [asdict(r) for r in self.records], []
        parts: list[Any] = [None] * dist.get_world_size() if self.is_output else []
        dist.gather_object(mine, parts if self.is_output else None, dst=self._output)
        if not self.is_output:
            return None
        return sorted((r for part in parts for r in part), key=lambda r: (r["step"], r["stage"], r["replica"]))

    def save(self, path: str | os.PathLike[str], extra: Mapping[str, Any] | None = None) -> None:
        """Write the whole model and optimizer to ``path`` (worker 0 writes; every worker must call it), with
        worker 0's ``extra`` entries beside them."""
        self._average_buffers()
        save_stages(path, self.module, self.optimizer, self._replica == 0, self.steps, extra)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Load a checkpoint of this model (saved by this class, a :class:`~conveyor.runtime.Pipeline` or a
        plain model), whatever its split."""
        self.steps = load_stage(path, self.module, self.optimizer, self._model_shapes)
