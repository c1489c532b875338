"""Run one worker's action list for real: forwards, backwards and transfers over torch.distributed.

The executor is the only place where a schedule touches tensors. It follows its worker's actions in
order, blocking only when it receives data; it keeps what a pending backward needs (the stage's input
and output of each in-flight microbatch, and through :mod:`conveyor.runtime._versions` the weights its forward
used) and counts them, so the stash a schedule really uses can be compared with the bound the
validator and the simulator give.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from conveyor.runtime._transport import P2P, PendingRecv, differentiable_leaves
from conveyor.runtime._versions import WeightVersions
from conveyor.schedule._schedule import Action, Op, Schedule

__all__ = ["Executor", "StepOutput"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class StepOutput:
    """What one run of a schedule produced on this worker.

    Attributes:
        losses: microbatch -> its unscaled loss (last stage of a training run only).
        outputs: per microbatch, the model output, detached (last stage of an evaluation only).
    """

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)


@dataclass
class _InFlight:
    """One microbatch between its forward and its backward on this worker."""

    inputs: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    input_grads: list[torch.Tensor] | None = None


class Executor:
    """Executes a worker's actions of a :class:`~conveyor.schedule._schedule.Schedule`.

    Args:
        module: this worker's stage.
        worker: this worker's index in the schedule.
        rank_of_worker: the process-group rank of every worker.
        p2p: the transport to the other workers.
        loss_fn: ``loss_fn(output, target)``, applied on the last stage to each microbatch.
        device: where inputs and targets are moved.
        weights: the stage's weight versions (default: a fresh :class:`~conveyor.runtime._versions.WeightVersions`).
        autocast: run forwards and the loss under ``torch.autocast`` with this dtype (``torch.bfloat16``).
        recompute: keep only each microbatch's stage input and re-run the forward in its backward
            (``torch.utils.checkpoint``, random state replayed), trading a forward for the stashed activations.
    """

    def __init__(
        self,
        module: nn.Module,
        worker: int,
        rank_of_worker: Sequence[int],
        p2p: P2P,
        loss_fn: LossFn | None,
        device: torch.device,
        weights: WeightVersions | None = None,
        autocast: torch.dtype | None = None,
        recompute: bool = False,
    ) -> None:
        self.module = module
        self.worker = worker
        self.rank_of_worker = list(rank_of_worker)
        self.p2p = p2p
        self.loss_fn = loss_fn
        self.device = device
        self.weights = weights if weights is not None else WeightVersions(module)
        self.autocast = autocast
        self.recompute = recompute
        self.peak_stashed = 0
        # Set to a list to record (action, start, end) of every action, perf_counter seconds.
        self.trace: list[tuple[Action, float, float]] | None = None

    def run(
        self,
        schedule: Schedule,
        inputs: list[Any] | None,
        targets: list[Any] | None,
        on_step: Callable[[], None] | None = None,
    ) -> StepOutput:
        """Run this worker's actions of ``schedule``.

        Args:
            schedule: the schedule; a training schedule if it has backwards.
            inputs: the microbatches' inputs, indexed by microbatch (first stage only).
            targets: the microbatches' targets, indexed by microbatch (last stage of training only).
            on_step: called at each ``STEP`` action, once the gradients are on the module's parameters and
                before the updated weights become the newest version: all-reduce, clip and step the
                optimizer there.
        """
        stage = schedule.worker_stage[self.worker]
        first, last = stage == 0, stage == schedule.stages - 1
        training = any(a.op is Op.BACKWARD for a in schedule.actions[self.worker])
        if training:
            self.weights.start(schedule, self.worker)
            # An update's gradient is the mean over the microbatches it covers.
            scale = 1.0 / schedule.update_size(schedule.stages - 1)
        autocast = (
            torch.autocast(self.device.type, self.autocast) if self.autocast is not None else contextlib.nullcontext()
        )
        flight: dict[int, _InFlight] = {}
        result = StepOutput()
        prefetch = _Prefetcher(self.p2p, schedule.actions[self.worker], self.rank_of_worker, flight)
        for action in schedule.actions[self.worker]:
            start = time.perf_counter()
            mb, op = action.microbatch, action.op
            peer = None if action.peer is None else self.rank_of_worker[action.peer]
            if op is Op.RECV_ACTIVATION:
                received = self.p2p.wait_tree(prefetch.take(action))
                prefetch.post()  # the channel is idle again and the next message's size known
                if training:
                    for t in differentiable_leaves(received):
                        t.requires_grad_(True)
                flight[mb] = _InFlight(inputs=received)
            elif op is Op.FORWARD:
                state = flight.setdefault(mb, _InFlight())
                if first:
                    state.inputs = _to(inputs[mb], self.device)
                with torch.set_grad_enabled(training), autocast:
                    if training and self.recompute:
                        state.outputs = checkpoint(self.weights.forward, mb, state.inputs, use_reentrant=False)
                    elif training:
                        state.outputs = self.weights.forward(mb, state.inputs)
                    else:
                        state.outputs = self.module(state.inputs)
                    if last and training:
                        loss = self.loss_fn(state.outputs, _to(targets[mb], self.device))
                        result.losses[mb] = loss.detach()
                        state.loss = loss * scale
                if last and not training:
                    result.outputs.append(pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, state.outputs))
                if training:
                    self.peak_stashed = max(self.peak_stashed, len(flight))
                elif last:
                    del flight[mb]  # evaluation keeps nothing for a backward
                else:
                    state.inputs = None
            elif op is Op.SEND_ACTIVATION:
                self.p2p.send_tree(flight[mb].outputs, peer)
                prefetch.post()
                if not training:
                    del flight[mb]
            elif op is Op.RECV_GRAD:
                flight[mb].input_grads = self.p2p.wait_tensors(prefetch.take(action))
                prefetch.post()
            elif op is Op.BACKWARD:
                self.weights.check(mb, stage)
                self._backward(flight[mb], last)
                self.weights.done(mb)
                if first:
                    del flight[mb]
            elif op is Op.SEND_GRAD:
                state = flight.pop(mb)
                grads = [
                    t.grad if t.grad is not None else torch.zeros_like(t) for t in differentiable_leaves(state.inputs)
                ]
                self.p2p.send_tensors(grads, peer)
                prefetch.post()
            elif op is Op.STEP:
                # No wait for outstanding sends here: they read packed copies, not parameters, and waiting
                # would stall this stage until a busy receiver posts its receive.
                self.weights.collect_grads()
                if on_step is not None:
                    on_step()
                self.weights.publish()
            if self.trace is not None:
                self.trace.append((action, start, time.perf_counter()))
        self.p2p.wait_sends()
        return result

    @staticmethod
    def _backward(state: _InFlight, last: bool) -> None:
        if last:
            roots, grads = [state.loss], [None]
        else:
            pairs = [
                (out, g)
                for out, g in zip(differentiable_leaves(state.outputs), state.input_grads, strict=True)
                if out.requires_grad
            ]
            roots, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        if roots:  # a stage with no parameters fed by raw data has nothing to differentiate
            torch.autograd.backward(roots, grads)
        # Free the activation graph's outputs now; the inputs' .grad is what the next action sends.
        state.outputs = state.loss = state.input_grads = None


class _Prefetcher:
    """Posts each channel's next receive as early as its size is known, so data lands during compute.

    A blocking receive costs a wake-up (a few hundred microseconds on a busy host) every time a worker
    waits for a message; a receive posted before the worker starts computing is usually complete by the
    time it is needed. One receive per channel is outstanding at a time: an activation's size is only
    known once the previous message on its channel has been read, a gradient's once its forward ran.
    """

    def __init__(
        self, p2p: P2P, actions: Sequence[Action], rank_of_worker: Sequence[int], flight: dict[int, _InFlight]
    ) -> None:
        self.p2p, self.rank_of_worker, self.flight = p2p, rank_of_worker, flight
        self.queues: dict[tuple[int | None, Op], deque[Action]] = {}
        for a in actions:
            if a.op.is_recv:
                self.queues.setdefault((a.peer, a.op), deque()).append(a)
        self.posted: dict[tuple[int | None, Op], tuple[Action, PendingRecv]] = {}
        self.post()

    def post(self) -> None:
        """Post the next receive of every idle channel whose message size is known."""
        for key, queue in self.queues.items():
            if key in self.posted or not queue:
                continue
            a = queue[0]
            src = self.rank_of_worker[a.peer]
            if a.op is Op.RECV_ACTIVATION:
                pending = self.p2p.irecv_tree(src)
            elif a.microbatch in self.flight and self.flight[a.microbatch].outputs is not None:
                pending = self.p2p.irecv_tensors(differentiable_leaves(self.flight[a.microbatch].outputs), src)
            else:
                continue
            self.posted[key] = (queue.popleft(), pending)

    def take(self, action: Action) -> PendingRecv:
        """The posted receive for ``action`` (posting it now if it was not yet)."""
        key = (action.peer, action.op)
        if key not in self.posted:
            self.post()
        posted, pending = self.posted.pop(key)
        assert posted == action, f"receive {action} found {posted} posted: the schedule's receives are out of order"
        return pending


def _to(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), tree)
