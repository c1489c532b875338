"""One training step of an elastic job, on this worker: data parallel or a pipeline's stage.

A part of :class:`conveyor.elastic.ElasticTrainer` (see its module for the update's equation), given the
state it changes explicitly (:mod:`conveyor.elastic._held`): the step's gradients, buffers and loss summed
among the computing workers, each owner's update of its shard, and the weights of every stage gathered
before an evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from conveyor.elastic._held import Groups, HeldState, Placement, WorkerContext
from conveyor.elastic._job import ElasticJob
from conveyor.elastic._tiers import shard_bounds

__all__ = ["LossFn", "Steps"]

LossFn = Callable[[Any, Any], torch.Tensor]


class Steps:
    """This worker's part of a step.

    Args:
        context: this worker's surroundings.
        held: the state it holds, which a step updates.
        groups: this generation's process groups.
        placement: who holds which part of the state (a pipeline's stages, if any).
        model, loss_fn: the model and ``loss_fn(output, target)``, the mean over the samples.
        job: the data (on the model's device).
    """

    def __init__(
        self,
        context: WorkerContext,
        *,
        held: HeldState,
        groups: Groups,
        placement: Placement,
        model: nn.Module,
        loss_fn: LossFn,
        job: ElasticJob,
    ) -> None:
        self.context, self.held, self.groups, self.placement = context, held, groups, placement
        self.model, self.loss_fn, self.job = model, loss_fn, job

    def run(self, t: int, batch: torch.Tensor) -> float:
        """Step ``t`` on ``batch`` (indices of the training set); the batch's mean loss."""
        if self.placement.staged is not None:
            return self._staged_step(t, batch)
        return self._data_parallel_step(t, batch)

    def _data_parallel_step(self, t: int, batch: torch.Tensor) -> float:
        ctx, held, flat = self.context, self.held, self.context.flat
        gen = ctx.watch.gen
        assert gen is not None
        compute, owners = gen.roles.compute, gen.roles.owners
        a, b = shard_bounds(len(batch), len(compute))[compute.index(ctx.worker)]
        mine = batch[a:b]
        self.model.train()
        for p in flat.params:
            p.grad = None
        loss_sum = torch.zeros(())
        if len(mine):
            index = mine.to(self.job.train_x.device)
            loss_sum = self.loss_fn(self.model(self.job.train_x[index]), self.job.train_y[index]) * len(mine)
            loss_sum.backward()
        extra = torch.tensor([float(loss_sum.detach()), float(len(mine))], dtype=flat.dtype)
        packed = torch.cat([flat.grads(), flat.buffer_vector() * len(mine), extra]).to(flat.dtype)
        ctx.watch.wait(self.groups.train.allreduce([packed]), stepping=True)
        samples = float(packed[-1])
        P, nb = flat.numel, flat.buffer_numel
        self._set_step_buffers(t, packed[P : P + nb] / samples)
        weights = flat.weights()
        bounds = shard_bounds(P, len(owners))
        if held.shard is not None:
            mine_bounds = slice(*held.shard.bounds)
            weights[mine_bounds] = held.update_shard(t, packed[mine_bounds] / samples)
        parts = [weights[lo:hi].contiguous() for lo, hi in bounds]
        train = self.groups.train
        works = [train.broadcast(part, compute.index(o)) for part, o in zip(parts, owners, strict=True)]
        for work in works:
            ctx.watch.wait(work, stepping=True)
        flat.set_weights(torch.cat(parts))
        return float(packed[-2]) / samples

    def _staged_step(self, t: int, batch: torch.Tensor) -> float:
        """One GPipe step of this worker's stage; its replicas all-reduce and update it (the pipeline module's
        equation). Every computing worker sums the loss before anyone updates: a stage's step needs only some
        peers, but this one needs all, so no worker's state runs two steps ahead of another's (a recovery then
        finds every stage at ``c`` or ``c + 1``, and each holder keeps step ``c``)."""
        ctx, held, flat, staged = self.context, self.held, self.context.flat, self.placement.staged
        gen = ctx.watch.gen
        assert gen is not None and staged is not None and held.shard is not None
        self.model.train()
        for p in flat.params:
            p.grad = None
        index = batch.to(self.job.train_x.device)
        x, y = self.job.train_x[index], self.job.train_y[index]
        loss_sum, samples = staged.run(
            ctx.watch,
            self.groups.train,
            layout=self.placement.stage_layout(gen),
            compute=gen.roles.compute,
            worker=ctx.worker,
            inputs=x,
            targets=y,
            loss_fn=self.loss_fn,
        )
        (a, b), (ba, bb) = held.shard.bounds, held.buffer_bounds
        grad = flat.grads()
        buffers = flat.buffer_vector()
        count = torch.tensor([float(samples)], dtype=flat.dtype)
        packed = torch.cat([grad[a:b], buffers[ba:bb] * samples, count]).to(flat.dtype)
        if self.groups.stage is not None:
            ctx.watch.wait(self.groups.stage.allreduce([packed]), stepping=True)
        loss = torch.tensor([loss_sum], dtype=torch.float64)
        ctx.watch.wait(self.groups.train.allreduce([loss]), stepping=True)
        buffers[ba:bb] = packed[b - a : -1] / packed[-1]
        self._set_step_buffers(t, buffers)
        weights = flat.weights()
        weights[a:b] = held.update_shard(t, packed[: b - a] / len(batch))
        flat.set_weights(weights)
        return float(loss) / len(batch)

    def _set_step_buffers(self, t: int, buffers: torch.Tensor) -> None:
        """Step ``t``'s averaged buffers (BatchNorm statistics) into the model, kept with the step before's."""
        self.context.flat.set_buffers(buffers)
        self.held.keep_step_buffers(t, buffers)

    def gather_stages(self) -> None:
        """Every computing worker gets every stage's weights and buffers from its first replica, before each
        evaluation: the evaluating worker, the checkpoint and the returned weights have the whole model (a run
        ends at an epoch's end; a recovery hands everybody the whole state)."""
        ctx, flat = self.context, self.context.flat
        gen = ctx.watch.gen
        assert gen is not None
        weights, buffers = flat.weights(), flat.buffer_vector()
        works, train = [], self.groups.train
        for holders, (a, b), (ba, bb) in self.placement.shards(gen):
            root = gen.roles.compute.index(holders[0])  # each broadcast lands in its range of the vectors
            works += [train.broadcast(weights[a:b], root), train.broadcast(buffers[ba:bb], root)]
        for work in works:
            ctx.watch.wait(work, stepping=True)
        flat.set_weights(weights)
        flat.set_buffers(buffers)
