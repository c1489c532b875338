"""Run one worker's actions for real: forwards, backwards, transfers, gradient reduction and optimizer steps.

The executor is the only place where a schedule touches tensors. It follows its worker's actions in
order (a stream, generated as the run goes), one handler per kind of action, blocking only when it
receives data; it keeps what a pending backward needs (the stage's input and output of each in-flight
microbatch, and through :class:`~conveyor.runtime.WeightVersions` the weights its forward used) and counts
them, so the stash a schedule really uses can be compared with the bound the validator and the simulator
give. A microbatch without samples (the tail of a short batch) runs nothing and sends ``None``.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from conveyor.errors import InputError
from conveyor.runtime._microbatch import to_device
from conveyor.runtime._transport import P2P, PendingRecv, differentiable_leaves
from conveyor.runtime._update import Updater
from conveyor.runtime._versions import WeightVersions
from conveyor.schedule import Action, Op

__all__ = ["Executor", "Feed", "RunOutput"]

LossFn = Callable[[Any, Any], torch.Tensor]


class Feed(Protocol):
    """Where a worker's microbatches come from (the first and last stages read them; see ``BatchSource``)."""

    def microbatch(self, k: int) -> tuple[Any, Any, int]:
        """Inputs, targets and sample count of microbatch ``k`` (``None`` for a part this worker does not read)."""
        ...

    def batch_samples(self, k: int) -> int:
        """The samples of the whole batch microbatch ``k`` belongs to."""
        ...


@dataclass
class RunOutput:
    """What one run of a schedule produced on this worker.

    Attributes:
        losses: microbatch -> (its mean loss, a 0-d tensor on the device, and its samples) (last stage of a
            training run only). Read them with :meth:`loss_values`: once per run, not once per microbatch, does the
            worker wait for its device.
        outputs: per microbatch, the model output, detached (last stage of an evaluation only).
    """

    losses: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)

    def loss_values(self) -> dict[int, tuple[float, int]]:
        """Microbatch -> (its mean loss, its samples), read off the device at once."""
        if not self.losses:
            return {}
        values = torch.stack([loss.float() for loss, _ in self.losses.values()]).tolist()
        return {k: (v, n) for (k, (_, n)), v in zip(self.losses.items(), values, strict=True)}


@dataclass
class _InFlight:
    """One microbatch between its forward and its backward on this worker."""

    inputs: Any = None
    samples: int = 0
    forwarded: bool = False
    outputs: Any = None
    loss: torch.Tensor | None = None
    input_grads: list[torch.Tensor] | None = None


class Executor:
    """Executes a worker's actions.

    Args:
        module: this worker's stage.
        stage, stages: its stage and the pipeline's stage count.
        rank_of_worker: the process-group rank of every worker.
        p2p: the transport to the other workers.
        loss_fn: ``loss_fn(output, target)``, applied on the last stage to each microbatch.
        device: where inputs and targets are moved.
        weights: the stage's weight versions.
        updater: what ``REDUCE`` and ``STEP`` do (see :mod:`conveyor.runtime._update`).
        autocast: run forwards and the loss under ``torch.autocast`` with this dtype (``torch.bfloat16``).
        recompute: keep only each microbatch's stage input and re-run the forward in its backward
            (``torch.utils.checkpoint``, random state replayed), trading a forward for the stashed activations.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        stages: int,
        rank_of_worker: list[int],
        p2p: P2P,
        loss_fn: LossFn,
        device: torch.device,
        weights: WeightVersions,
        updater: Updater,
        autocast: torch.dtype | None = None,
        recompute: bool = False,
    ) -> None:
        self.module, self.p2p, self.loss_fn, self.device = module, p2p, loss_fn, device
        self.first, self.last = stage == 0, stage == stages - 1
        self.stage, self.rank_of_worker = stage, rank_of_worker
        self.weights, self.updater, self.autocast, self.recompute = weights, updater, autocast, recompute
        self.peak_stashed = 0
        # Set to a list to record (action, start, end) of every action, perf_counter seconds.
        self.trace: list[tuple[Action, float, float]] | None = None
        self._handlers: dict[Op, Callable[[_Run, Action], None]] = {
            Op.RECV_ACTIVATION: self._recv_activation,
            Op.FORWARD: self._forward,
            Op.SEND_ACTIVATION: self._send_activation,
            Op.RECV_GRAD: self._recv_grad,
            Op.BACKWARD: self._backward,
            Op.SEND_GRAD: self._send_grad,
            Op.REDUCE_GRAD: self._reduce,
            Op.STEP: self._step,
        }

    def run(
        self,
        actions: Iterable[Action],
        feed: Feed | None,
        *,
        training: bool,
        stashing: bool = False,
        will_use: Callable[[int], bool] | None = None,
        on_step: Callable[[], None] | None = None,
        predict: int = 0,
    ) -> RunOutput:
        """Run this worker's ``actions``.

        Args:
            actions: the actions, in order (a list, or a generator producing them as the run goes).
            feed: the microbatches' inputs (first stage) and targets (last stage of training).
            training: whether this is a training run (backwards, steps) or an evaluation.
            stashing: keep a weight version per update for the backwards of microbatches in flight.
            will_use: whether a forward still to come pins this weight version (2BW, vertical sync).
            on_step: called after each optimizer step.
            predict: extrapolate each weight version over this many steps (the stage's staleness; 0: none).
        """
        if training:
            self.weights.start(stashing, will_use, predict)
        run = _Run(self, actions, feed, training, on_step)
        handlers, trace = self._handlers, self.trace
        for action in run.stream:
            if trace is None:
                handlers[action.op](run, action)
                continue
            start = time.perf_counter()
            handlers[action.op](run, action)
            trace.append((action, start, time.perf_counter()))
        self.p2p.wait_sends()
        return run.output

    def _peer(self, action: Action) -> int:
        return self.rank_of_worker[action.to]

    def _recv_activation(self, run: _Run, action: Action) -> None:
        received, samples = self.p2p.wait_tree(run.prefetch.take(action))
        run.prefetch.post()  # the channel is idle again and the next message's size known
        if run.training:
            for t in differentiable_leaves(received):
                t.requires_grad_(True)
        run.flight[action.mb] = _InFlight(inputs=received, samples=samples)

    def _forward(self, run: _Run, action: Action) -> None:
        k = action.mb
        state = run.flight.setdefault(k, _InFlight())
        target = None
        if self.first or (self.last and run.training):
            assert run.feed is not None, "the first stage (and the last, training) needs a feed"
            inputs, target, samples = run.feed.microbatch(k)
            if self.first:
                state.inputs, state.samples = to_device(inputs, self.device), samples
            elif samples != state.samples:
                raise InputError(
                    f"microbatch {k} has {state.samples} samples of inputs but {samples} targets: give every worker "
                    "the same batches in the same order"
                )
        state.forwarded = True
        if not state.samples:  # an empty microbatch: nothing to run, None to pass on
            if run.training:
                self.weights.use(k, action.version)
            elif self.last:
                del run.flight[k]
            return
        autocast = torch.autocast(self.device.type, self.autocast) if self.autocast else contextlib.nullcontext()
        with torch.set_grad_enabled(run.training), autocast:
            if run.training and self.recompute:
                state.outputs = checkpoint(self.weights.forward, k, state.inputs, action.version, use_reentrant=False)
            elif run.training:
                state.outputs = self.weights.forward(k, state.inputs, action.version)
            else:
                state.outputs = self.module(state.inputs)
            if self.last and run.training:
                loss = self.loss_fn(state.outputs, to_device(target, self.device))
                run.output.losses[k] = (loss.detach(), state.samples)
                state.loss = self._backward_root(run, k, loss, state.samples)
        if self.last and not run.training:
            run.output.outputs.append(pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, state.outputs))
        if run.training:
            self.peak_stashed = max(self.peak_stashed, len(run.flight))
        elif self.last:
            del run.flight[k]  # evaluation keeps nothing for a backward
        else:
            state.inputs = None

    def _backward_root(self, run: _Run, k: int, loss: torch.Tensor, samples: int) -> torch.Tensor:
        """What microbatch ``k``'s backward starts from: its share ``l n / N`` of its batch's mean loss where the
        update is the batch (``N`` its samples), else the sum ``l n``, which REDUCE divides by the update's
        samples (:mod:`conveyor.runtime._update`)."""
        if not self.updater.averaged:
            return loss * samples
        assert run.feed is not None
        total = run.feed.batch_samples(k)
        return loss if samples == total else loss * (samples / total)

    def _send_activation(self, run: _Run, action: Action) -> None:
        state = run.flight[action.mb]
        self.p2p.send_tree(state.outputs, self._peer(action), state.samples)
        run.prefetch.post()
        if not run.training:
            del run.flight[action.mb]

    def _recv_grad(self, run: _Run, action: Action) -> None:
        run.flight[action.mb].input_grads = self.p2p.wait_tensors(run.prefetch.take(action))
        run.prefetch.post()

    def _backward(self, run: _Run, action: Action) -> None:
        k = action.mb
        state = run.flight[k]
        self.weights.check(k, self.stage)
        if self.updater.overlaps and run.lookahead.next_of(Op.BACKWARD, Op.REDUCE_GRAD) is Op.REDUCE_GRAD:
            self.updater.arm(run.samples + state.samples)  # the update's last backward: all-reduce as it goes
        if state.samples and self.last:
            assert state.loss is not None
            torch.autograd.backward(state.loss)
        elif state.samples:
            assert state.input_grads is not None
            pairs = [
                (out, g)
                for out, g in zip(differentiable_leaves(state.outputs), state.input_grads, strict=True)
                if out.requires_grad
            ]
            if pairs:  # a stage with no parameters fed by raw data has nothing to differentiate
                torch.autograd.backward([out for out, _ in pairs], [g for _, g in pairs])
        run.samples += state.samples
        # Free the activation graph's outputs now; the inputs' .grad is what the next action sends.
        state.outputs = state.loss = state.input_grads = None
        self.weights.done(k)
        if self.first:
            del run.flight[k]

    def _send_grad(self, run: _Run, action: Action) -> None:
        state = run.flight.pop(action.mb)
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in differentiable_leaves(state.inputs)]
        self.p2p.send_tensors(grads, self._peer(action))
        run.prefetch.post()

    def _reduce(self, run: _Run, action: Action) -> None:
        self.weights.collect_grads()
        self.updater.reduce(run.samples)
        run.samples = 0

    def _step(self, run: _Run, action: Action) -> None:
        # No wait for outstanding sends here: they read packed copies, not parameters, and waiting would
        # stall this stage until a busy receiver posts its receive.
        self.weights.before_step()
        self.updater.step()
        self.weights.publish()
        if run.on_step is not None:
            run.on_step()


class _Run:
    """The state of one run: the action stream with its lookahead, the microbatches in flight, the output."""

    def __init__(
        self,
        executor: Executor,
        actions: Iterable[Action],
        feed: Feed | None,
        training: bool,
        on_step: Callable[[], None] | None,
    ) -> None:
        self.training, self.on_step, self.feed = training, on_step, feed
        self.flight: dict[int, _InFlight] = {}
        self.output = RunOutput()
        self.samples = 0  # of the backwards since the last REDUCE
        self.lookahead = _Lookahead(actions)
        self.prefetch = _Prefetcher(executor.p2p, self.lookahead, executor.rank_of_worker, self.flight)

    @property
    def stream(self) -> Iterator[Action]:
        return iter(self.lookahead)


class _Lookahead:
    """The action stream, read ahead up to the next forward (and never further, since reading further may
    wait on the run's length), so that the prefetcher can post the receives it sees there."""

    def __init__(self, actions: Iterable[Action]) -> None:
        self._source = iter(actions)
        self.buffer: deque[Action] = deque()
        self._forwards = 0  # in the buffer
        self._ended = False

    def _fill(self) -> None:
        while not self._forwards and not self._ended:
            a = next(self._source, None)
            if a is None:
                self._ended = True
            else:
                self.buffer.append(a)
                self._forwards += a.op is Op.FORWARD

    def next_of(self, *ops: Op) -> Op | None:
        """Which of ``ops`` comes first among the actions read ahead (``None``: none of them)."""
        return next((a.op for a in self.buffer if a.op in ops), None)

    def __iter__(self) -> Iterator[Action]:
        while True:
            self._fill()
            if not self.buffer:
                return
            a = self.buffer.popleft()
            self._forwards -= a.op is Op.FORWARD
            yield a


class _Prefetcher:
    """Posts each channel's next receive as early as its size is known, so data lands during compute.

    A blocking receive costs a wake-up (a few hundred microseconds on a busy host) every time a worker
    waits for a message; a receive posted before the worker starts computing is usually complete by the
    time it is needed. One receive per channel is outstanding at a time: an activation's size is only
    known once the previous message on its channel has been read, a gradient's once its forward ran.
    """

    def __init__(
        self, p2p: P2P, lookahead: _Lookahead, rank_of_worker: list[int], flight: dict[int, _InFlight]
    ) -> None:
        self.p2p, self.lookahead, self.rank_of_worker, self.flight = p2p, lookahead, rank_of_worker, flight
        self.posted: dict[tuple[int | None, Op], tuple[Action, PendingRecv]] = {}

    def post(self) -> None:
        """Post the next receive of every idle channel whose message size is known."""
        seen: set[tuple[int | None, Op]] = set()
        for a in self.lookahead.buffer:
            key = (a.peer, a.op)
            if not a.op.is_recv or key in seen:
                continue
            seen.add(key)  # only a channel's first receive in the buffer can be posted, and one at a time
            if key not in self.posted:
                self._post(a)

    def _post(self, action: Action) -> None:
        """Post ``action``'s receive if its message size is known."""
        src = self.rank_of_worker[action.to]
        if action.op is Op.RECV_ACTIVATION:
            pending = self.p2p.irecv_tree(src)
        elif action.mb in self.flight and self.flight[action.mb].forwarded:
            pending = self.p2p.irecv_tensors(differentiable_leaves(self.flight[action.mb].outputs), src)
        else:
            return
        self.posted[(action.peer, action.op)] = (action, pending)

    def take(self, action: Action) -> PendingRecv:
        """The posted receive for ``action`` (posting it now if it was not yet)."""
        key = (action.peer, action.op)
        if key not in self.posted:
            self._post(action)
        posted, pending = self.posted.pop(key)
        assert posted == action, f"receive {action} found {posted} posted: the schedule's receives are out of order"
        return pending
