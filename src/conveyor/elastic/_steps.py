"""One training step of an elastic job, on this worker: data parallel or a pipeline's stage.

A mixin of :class:`conveyor.elastic.ElasticTrainer` (see its module for the update's equation): the step's
gradients, buffers and loss summed among the computing workers, each owner's update of its shard, and the
weights of every stage gathered before an evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from conveyor.elastic._handover import Handover
from conveyor.elastic._job import ElasticJob
from conveyor.elastic._pipeline import StagedStep, StageLayout
from conveyor.elastic._tiers import shard_bounds

__all__ = ["LossFn", "Steps"]

LossFn = Callable[[Any, Any], torch.Tensor]


class Steps(Handover):
    """The step; the attributes are the trainer's."""

    model: nn.Module
    loss_fn: LossFn
    job: ElasticJob
    layout: Callable[[int], StageLayout] | None
    staged: StagedStep | None

    def _data_parallel_step(self, t: int, batch: torch.Tensor) -> float:
        gen = self.watch.gen
        assert gen is not None
        compute, owners = gen.roles.compute, gen.roles.owners
        a, b = shard_bounds(len(batch), len(compute))[compute.index(self.worker)]
        mine = batch[a:b]
        self.model.train()
        for p in self.flat.params:
            p.grad = None
        loss_sum = torch.zeros(())
        if len(mine):
            index = mine.to(self.job.train_x.device)
            loss_sum = self.loss_fn(self.model(self.job.train_x[index]), self.job.train_y[index]) * len(mine)
            loss_sum.backward()
        extra = torch.tensor([float(loss_sum.detach()), float(len(mine))], dtype=self.flat.dtype)
        packed = torch.cat([self.flat.grads(), self.flat.buffer_vector() * len(mine), extra]).to(self.flat.dtype)
        self.watch.wait(self.train_group.allreduce([packed]), stepping=True)
        samples = float(packed[-1])
        P, nb = self.flat.numel, self.flat.buffer_numel
        self._set_step_buffers(t, packed[P : P + nb] / samples)
        weights = self.flat.weights()
        bounds = shard_bounds(P, len(owners))
        if self.held.shard is not None:
            weights[slice(*self.held.shard.bounds)] = self._update_shard(
                t, packed[slice(*self.held.shard.bounds)] / samples
            )
        parts = [weights[lo:hi].contiguous() for lo, hi in bounds]
        works = [self.train_group.broadcast(part, compute.index(o)) for part, o in zip(parts, owners, strict=True)]
        for work in works:
            self.watch.wait(work, stepping=True)
        self.flat.set_weights(torch.cat(parts))
        return float(packed[-2]) / samples

    def _staged_step(self, t: int, batch: torch.Tensor) -> float:
        """One GPipe step of this worker's stage; its replicas all-reduce and update it (the pipeline module's
        equation). Every computing worker sums the loss before anyone updates: a stage's step needs only some
        peers, but this one needs all, so no worker's state runs two steps ahead of another's (a recovery then
        finds every stage at ``c`` or ``c + 1``, and each holder keeps step ``c``)."""
        gen = self.watch.gen
        assert gen is not None and self.staged is not None and self.layout is not None and self.held.shard is not None
        compute = gen.roles.compute
        self.model.train()
        for p in self.flat.params:
            p.grad = None
        index = batch.to(self.job.train_x.device)
        x, y = self.job.train_x[index], self.job.train_y[index]
        loss_sum, samples = self.staged.run(
            self.watch,
            self.train_group,
            layout=self.layout(len(compute)),
            compute=compute,
            worker=self.worker,
            inputs=x,
            targets=y,
            loss_fn=self.loss_fn,
        )
        (a, b), (ba, bb) = self.held.shard.bounds, self.held.buffer_bounds
        grad = self.flat.grads()
        buffers = self.flat.buffer_vector()
        count = torch.tensor([float(samples)], dtype=self.flat.dtype)
        packed = torch.cat([grad[a:b], buffers[ba:bb] * samples, count]).to(self.flat.dtype)
        if self.stage_group is not None:
            self.watch.wait(self.stage_group.allreduce([packed]), stepping=True)
        loss = torch.tensor([loss_sum], dtype=torch.float64)
        self.watch.wait(self.train_group.allreduce([loss]), stepping=True)
        buffers[ba:bb] = packed[b - a : -1] / packed[-1]
        self._set_step_buffers(t, buffers)
        weights = self.flat.weights()
        weights[a:b] = self._update_shard(t, packed[: b - a] / len(batch))
        self.flat.set_weights(weights)
        return float(loss) / len(batch)

    def _set_step_buffers(self, t: int, buffers: torch.Tensor) -> None:
        """Step ``t``'s averaged buffers (BatchNorm statistics) into the model, kept with the step before's."""
        self.flat.set_buffers(buffers)
        self.held.step_buffers = {k: v for k, v in self.held.step_buffers.items() if k == t - 1}
        self.held.step_buffers[t] = buffers

    def _update_shard(self, t: int, grad: torch.Tensor) -> torch.Tensor:
        """Apply step ``t``'s mean gradient to this owner's shard, keeping the shard of the step before (the
        step may not complete everywhere: :meth:`_shard_at` hands over either); return the new weights."""
        assert self.held.shard is not None
        self.held.prev = (t - 1, self._shard_at(t - 1).clone())
        new = self.held.shard.step(grad)
        self.held.shard_step = t  # ahead of done until the step completes
        return new

    def _gather_stages(self) -> None:
        """Every computing worker gets every stage's weights and buffers from its first replica, before each
        evaluation: the evaluating worker, the checkpoint and the returned weights have the whole model (a run
        ends at an epoch's end; a recovery hands everybody the whole state)."""
        gen = self.watch.gen
        assert gen is not None
        weights, buffers = self.flat.weights(), self.flat.buffer_vector()
        works = []
        for holders, (a, b), (ba, bb) in self.shards(gen):
            root = gen.roles.compute.index(holders[0])  # each broadcast lands in its range of the vectors
            works += [self.train_group.broadcast(weights[a:b], root), self.train_group.broadcast(buffers[ba:bb], root)]
        for work in works:
            self.watch.wait(work, stepping=True)
        self.flat.set_weights(weights)
        self.flat.set_buffers(buffers)
