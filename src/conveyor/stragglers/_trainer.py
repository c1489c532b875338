"""Training that tolerates stragglers among replicas: rapid reassignment of chunks and bounded staleness.

Data parallelism, or a pipeline whose first stage is replicated (``2-1``, ``3-1-1``; data parallelism is
one stage). The first stage's replicas read every batch. A batch is cut into ``replicas x chunks`` chunks,
claimed through the c10d store (:mod:`conveyor.stragglers._claims`): each replica runs its own share, and
with reassignment a replica out of work takes the unstarted tail of the slowest peer's. In a pipeline a
replica sends each chunk's activations on as soon as it has them, announced through the store
(:mod:`conveyor.stragglers._route`), so the next stage takes chunks in the order they come, from whichever
replica ran them, and returns each gradient to that replica (at most ``stages - s`` chunks are in flight
from stage ``s``). Every worker sums its chunks' per-sample gradients; an all-reduce among the replicas of
the sums and the sample count gives the batch's mean gradient whatever the split:

    g(t) = (sum over replicas r, chunks c claimed by r: n_c grad l_c(W~(t))) / (sum of n_c) = grad L_t(W~(t))

where ``l_c`` is chunk ``c``'s mean loss over its ``n_c`` samples and ``L_t`` the batch's mean loss (for a
model whose samples do not interact: BatchNorm's batch statistics depend on the chunks, as on
microbatches). BatchNorm's running statistics ride in the same all-reduce, so every stage holds those of
one process running the batch's chunks in order, whichever replica ran them and in whatever order they
came (:mod:`conveyor.stragglers._statistics`).

**Slack** ``s`` (bounded staleness): the all-reduce of step ``t`` is started without waiting, and step ``t``
applies the averaged gradient of step ``t - s``:

    W(t + 1) = opt(W(t), g(t - s))    for t >= s;    W(t + 1) = W(t) for t < s

so a replica waits only for the all-reduce ``s`` steps old, i.e. it runs at most ``s`` steps ahead of the
slowest replica, and a short pause of one replica (which can hand over nothing while frozen) is absorbed.
At the end of a run the last ``s`` gradients are applied in order, so a run makes one update per batch.
Every replica applies the same updates in the same order, so all hold the same parameters. ``s = 0`` is
synchronous data parallelism. The gradients are ``s`` updates old when applied, so, as for the asynchronous
pipelines, they are taken at the weights predicted ``s`` updates ahead (weight prediction; SpecTrain's
form with SGD momentum; :mod:`conveyor.stragglers._prediction`):

    W~(t) = W(t) + s (W(t) - W(t - 1))    (W~(t) = W(t) when ``predict`` is off or t = 0)

where ``W(t - 1)`` is the weights one step earlier in the same run: until a run's first update (its first
``s`` steps, whose gradients are applied with fewer than ``s`` updates between) there is nothing to
extrapolate.

**Backups** (synchronous only): a replica out of work runs again a chunk that a stalled peer holds past a
deadline, and the first run to finish is used (:mod:`conveyor.stragglers._backup`).

Each step, each worker records the samples it ran, those it took from peers, those it backed up and those
dropped, its compute time and the time it waited for the all-reduce (:attr:`FlexiblePipeline.records`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.errors import InputError
from conveyor.runtime import (
    OptimizerFactory,
    as_blocks,
    batch_size,
    block_shapes,
    build_stage,
    default_device,
    pack_grads,
    reduce_dtype,
    set_mean_grads,
    split_batch,
    stage_ranges,
    to_device,
)
from conveyor.schedule import check_replicas, stage_workers
from conveyor.stragglers._backup import Backups
from conveyor.stragglers._claims import StepClaims, release_share
from conveyor.stragglers._granularity import Chunks, agree_on_chunks
from conveyor.stragglers._modes import check_flexible
from conveyor.stragglers._prediction import WeightPrediction
from conveyor.stragglers._records import StepRecord
from conveyor.stragglers._route import END, Arrival, Router
from conveyor.stragglers._shares import ShareWeights
from conveyor.stragglers._stage import FlexibleStage
from conveyor.stragglers._statistics import RunningStatistics

__all__ = ["FlexiblePipeline"]

LossFn = Callable[[Any, Any], torch.Tensor]
_INSTANCES = itertools.count()  # every worker builds its trainers in the same order, so their keys agree


@dataclass
class _Pending:
    buffer: torch.Tensor  # the gradient sums, then the loss sum and the sample count (pack_grads)
    work: Any  # the all-reduce in flight (None on an unreplicated stage)
    samples: int  # the batch's: every chunk runs once, on one replica of each stage
    step_key: str  # the step's store keys, released once its all-reduce is done
    chunks: int  # the batch's non-empty chunks (every stage runs each once)
    owned: range  # the chunks this replica's share held (its backup keys, released with the step)


class FlexiblePipeline(FlexibleStage):
    """Train ``model`` over the default process group, its first stage's replicas tolerating stragglers.

    Args:
        model: the whole model (every worker builds it identically), an ``nn.Sequential`` or list of blocks.
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over a chunk's samples.
        optimizer: builds the optimizer from the parameters, e.g. ``partial(torch.optim.SGD, lr=0.1)``.
        balance: blocks per stage (default: one stage, data parallelism).
        replicas: workers per stage; only the first stage may have more than one (default: every worker
            replicates one stage).
        chunks: chunks each replica owns per batch (the reassignment granularity), or ``"auto"``: chosen from
            the first batch, weighing the chunks' fixed costs against the work a stalled replica holds
            (:mod:`conveyor.stragglers._granularity`).
        slack: ``s``, how many steps a replica may run ahead of the slowest (0: synchronous).
        reassign: let replicas take chunks from slow peers (``False``: a fixed split).
        backup: let idle replicas run again chunks that stalled peers hold (needs ``slack=0``).
        weighted: deal each step's chunks in proportion to the replicas' measured speeds
            (:mod:`conveyor.stragglers._shares`; ``False``: equal shares).
        predict: take gradients at the weights predicted ``slack`` updates ahead (see above).
        device: this worker's device; default ``cuda:LOCAL_RANK`` with CUDA, else CPU.
        autocast: run forwards and the loss under ``torch.autocast`` with this dtype (``torch.bfloat16``).

    Example (on every worker of ``conveyor.launch(main, nprocs=4)``: data parallelism)::

        ddp = FlexiblePipeline(model, loss_fn=F.cross_entropy, optimizer=partial(torch.optim.SGD, lr=0.1),
                               chunks=2, slack=1)
        for epoch in range(10):
            losses = ddp.train(loader)       # every replica reads every batch, in the same order

    Or of ``conveyor.launch(main, nprocs=3)``, workers 0 and 1 replicating stage 0::

        pipe = FlexiblePipeline(model, loss_fn=F.cross_entropy, optimizer=partial(torch.optim.SGD, lr=0.1),
                                balance=[4, 2], replicas=[2, 1], chunks=2, slack=1)
        for epoch in range(10):
            losses = pipe.train(loader)      # stage 0's replicas read the inputs, the last stage the targets
    """

    def __init__(
        self,
        model: nn.Sequential | Sequence[nn.Module],
        *,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        balance: Sequence[int] | None = None,
        replicas: Sequence[int] | None = None,
        chunks: Chunks = 2,
        slack: int = 0,
        reassign: bool = True,
        backup: bool = False,
        weighted: bool = True,
        predict: bool = True,
        device: torch.device | str | None = None,
        autocast: torch.dtype | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: run under conveyor.launch or torchrun")
        blocks = as_blocks(model)
        ranges = stage_ranges(balance if balance is not None else [len(blocks)], len(blocks))
        world = dist.get_world_size()
        counts = check_flexible(
            check_replicas(len(ranges), replicas if replicas is not None or len(ranges) > 1 else [world]),
            world=world,
            chunks=chunks,
            slack=slack,
            backup=backup,
        )
        self.worker = dist.get_rank()
        self.stage = 0 if self.worker < counts[0] else self.worker - counts[0] + 1
        self.num_stages, self.replicas = len(ranges), counts[0]
        self.device = torch.device(device) if device is not None else default_device()
        self._model_shapes = block_shapes(blocks)
        self.module = build_stage(model, ranges[self.stage]).to(self.device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = optimizer(self.params) if self.params else None
        self._dtype = reduce_dtype(self.params)
        self.loss_fn, self.slack, self.reassign, self.weighted = loss_fn, slack, reassign, weighted
        self._weights: ShareWeights | None = None  # the shares by speed, once the chunks are known
        self.chunks: int | None = chunks if isinstance(chunks, int) else None  # auto: chosen at the first train
        self.chunk_times: dict[int, float] = {}  # auto: a step's seconds on worker 0 at each candidate count
        self.autocast = autocast
        self._prediction = WeightPrediction(self.params, slack) if predict and slack > 0 else None
        self.store = dist.distributed_c10d._get_default_store()
        self.router = Router(self.store, self.device)
        self._backups = Backups(self.store) if backup and self.stage == 0 and counts[0] > 1 else None
        if self._backups is not None:
            self._backups.attach(self.module)
        self._statistics = RunningStatistics.of(self.module, self._dtype)  # updated in the chunks' order
        # Every worker creates every group, as torch.distributed requires; data parallelism uses the world's.
        group = dist.new_group(stage_workers(counts)[0]) if self.num_stages > 1 and self.replicas > 1 else None
        self._group = group if self.stage == 0 and self.replicas > 1 else None
        self._next = self.replicas + self.stage  # the rank of the next stage's worker
        self._output = 0 if self.num_stages == 1 else world - 1  # the last stage's first worker
        self._first_arrival: Arrival | None = None  # a stage between: the step's first, read to see it exists
        self.steps = 0  # batches trained on
        self.records: list[StepRecord] = []
        self._id, self._runs, self._evals = next(_INSTANCES), 0, 0
        dist.barrier()  # every worker is built before any claims work, or an early one would take it all

    def train(
        self, batches: Iterable[tuple[Any, Any]] | None, on_step: Callable[[int], None] | None = None
    ) -> list[float] | None:
        """Train on every batch of ``batches`` (the same batches in the same order on every worker that reads
        them: the first stage's and the last's; a stage between passes ``None``).

        Returns:
            Each batch's mean loss on the output worker (:attr:`is_output`), ``None`` elsewhere.
        """
        if batches is None and (self.is_first or self.is_last):
            raise InputError(f"worker {self.worker} runs stage {self.stage}, which reads the batches: pass them")
        self.module.train()
        if self.chunks is None:
            batches, self.chunks, self.chunk_times = agree_on_chunks(
                self.module,
                batches,
                first=self.worker == 0,
                replicas=self.replicas,
                device=self.device,
                mixed=self._mixed,
            )
        if self.weighted and self._reduces and self._weights is None:
            self._weights = ShareWeights(self.replicas, self._share)
        self._runs += 1
        if self._prediction is not None:
            self._prediction.restart()
        pending: deque[_Pending] = deque()
        losses: list[torch.Tensor] = []  # on the device: read once, at the run's end
        for inputs, targets in batches if batches is not None else self._announced_steps():
            record = StepRecord(self.steps, self.stage, self._replica, 0, 0, 0, 0.0, 0.0)
            pending.append(self._compute(inputs, targets, record))
            if len(pending) > self.slack:
                record.wait_s = self._apply(pending.popleft(), losses)
            self.records.append(record)
            self.steps += 1
            if on_step is not None:
                on_step(self.steps)
        if self.worker == 0 and self.num_stages > 2:  # the stages between read no batches: tell them it ended
            self.router.end(self._queue(1))
        while pending:  # the last s gradients, in order (their waits end the run's last step)
            self.records[-1].wait_s += self._apply(pending.popleft(), losses)
        self.router.wait_sends()
        return torch.stack(losses).tolist() if self.is_output and losses else None

    def _step_key(self) -> str:
        """The store keys of this trainer's current run and step (its claims, its queues)."""
        return f"conveyor/flexible{self._id}/run{self._runs}/step{self.steps}"

    def _queue(self, to_stage: int) -> str:
        return f"{self._step_key()}/to{to_stage}"

    def _announced_steps(self) -> Iterator[tuple[None, None]]:
        """A stage between the first and the last: a step per batch, until the first stage says the run ended."""
        while True:
            first = self.router.receive(self._queue(self.stage), 1)
            if first.chunk == END:
                if self.stage + 1 < self.num_stages - 1:
                    self.router.end(self._queue(self.stage + 1))
                return
            self._first_arrival = first
            yield None, None

    def _chunks(self, inputs: Any) -> Iterator[tuple[Arrival, int, str]]:
        """This worker's chunks of the step, each with its sample count and how it came: ``own``, ``taken``
        from a peer's share or a ``backup`` of a peer's run; claimed on the first stage, received on the
        others."""
        if self.stage == 0:
            parts = split_batch(inputs, self.replicas * self._share)
            nonempty = [j for j, x in enumerate(parts) if batch_size(x)]
            claims = StepClaims(
                self.store, self._step_key(), replica=self.worker, shares=self._shares, reassign=self.reassign
            )
            takeovers = self._backups.takeovers(nonempty) if self._backups is not None else iter(())
            sources = ((j, "taken" if taken else "own") for j, taken in claims), ((j, "backup") for j in takeovers)
            for j, source in itertools.chain(*sources):
                if n := batch_size(parts[j]):
                    yield Arrival(j, len(nonempty), self.worker, to_device(parts[j], self.device)), n, source
            return
        first, self._first_arrival = self._first_arrival, None
        arrival = first or self.router.receive(self._queue(self.stage), 1)
        yield arrival, batch_size(arrival.inputs), "own"
        for place in range(2, arrival.count + 1):
            arrival = self.router.receive(self._queue(self.stage), place)
            yield arrival, batch_size(arrival.inputs), "own"

    def _compute(self, inputs: Any, targets: Any, record: StepRecord) -> _Pending:
        """Run this worker's chunks of one batch; start the all-reduce of their gradient sums."""
        start = time.perf_counter()
        for p in self.params:
            p.grad = None
        if self._backups is not None:
            self._backups.prefix = self._step_key()
        loss_sum = torch.zeros((), dtype=self._dtype, device=self.device)
        predicted = self._prediction.predicted() if self._prediction is not None else contextlib.nullcontext()
        with predicted, self._statistics.step() if self._statistics is not None else contextlib.nullcontext():
            rate = self._run_chunks(inputs, targets, record, loss_sum)
        # A later stage runs every chunk; the first stage's replicas sum their counts in the all-reduce, and
        # with weighted shares each its rate, in its own slot (the others' zero, so every replica reads it exactly).
        rates = [rate if w == self.worker else 0.0 for w in range(self.replicas)] if self._weights else []
        buffer = pack_grads(self.params, self._dtype, self.device, [*rates, loss_sum, float(record.samples)])
        if self._statistics is not None:  # before the gradients: their layout starts the tensor's tail
            buffer = torch.cat([self._statistics.take(), buffer])
        record.compute_s = time.perf_counter() - start
        work = dist.all_reduce(buffer, group=self._group, async_op=True) if self._reduces else None
        # The step's samples, all-reduced or not, are the batch's: a later stage runs every chunk.
        samples = batch_size(inputs) if self.stage == 0 else record.samples
        chunks = min(samples, self.replicas * self._share)  # a short batch leaves the last chunks empty
        first = sum(self._shares[: self._replica])
        owned = range(first, first + self._shares[self._replica])
        record.owned = len(owned) if self.stage == 0 else 0
        return _Pending(buffer, work, samples, self._step_key(), chunks, owned)

    def _run_chunks(self, inputs: Any, targets: Any, record: StepRecord, loss_sum: torch.Tensor) -> float:
        """Run this worker's chunks of one batch, recording them; the last stage's losses add to ``loss_sum``.
        Returns the runs a second inside them (0 without any)."""
        runs, busy = 0, 0.0
        y_parts = split_batch(targets, self.replicas * self._share) if self.is_last else None
        in_flight: deque[tuple[Any, Arrival]] = deque()  # forwards sent on whose gradients are not back
        for arrival, n, source in self._chunks(inputs):
            targets_j = to_device(y_parts[arrival.chunk], self.device) if y_parts is not None else None
            began = time.perf_counter()
            out = self._chunk(arrival, targets_j, n, loss_sum, backup=source == "backup")
            runs, busy = runs + 1, busy + time.perf_counter() - began
            if self._statistics is not None:
                self._statistics.end_chunk(arrival.chunk, arrival.count, counted=out is not None)
            if out is None:  # a peer's run of the chunk was used instead
                record.dropped += n
                continue
            record.samples, record.chunks = record.samples + n, record.chunks + 1
            record.taken += n if source == "taken" else 0
            record.backups += n if source == "backup" else 0
            if self.is_last:
                if self.stage > 0:
                    self.router.send_grads(arrival)
                continue
            self.router.send(self._queue(self.stage + 1), out, arrival.chunk, arrival.count, self._next)
            in_flight.append((out, arrival))
            if len(in_flight) >= self.num_stages - self.stage:
                self._backward(*in_flight.popleft())
        while in_flight:
            self._backward(*in_flight.popleft())
        return runs / busy if busy > 0 else 0.0

    def _chunk(self, arrival: Arrival, targets: Any, n: int, loss_sum: torch.Tensor, backup: bool = False) -> Any:
        """Run one chunk: its forward, and on the last stage its loss (added to ``loss_sum``) and backward; its
        output, or ``None`` where a peer's run of it was used (with backups, whose result is dropped here)."""
        if self._backups is None:
            return self._forward_backward(arrival, targets, n, loss_sum)
        chunk_loss = torch.zeros_like(loss_sum)
        won, out = self._backups.run(
            arrival.chunk,
            self.params,
            lambda check: self._forward_backward(arrival, targets, n, chunk_loss, before_backward=check),
            backup=backup,
        )
        if won:
            loss_sum += chunk_loss
        return out if won else None

    def _forward_backward(
        self,
        arrival: Arrival,
        targets: Any,
        n: int,
        loss_sum: torch.Tensor,
        before_backward: Callable[[], None] | None = None,
    ) -> Any:
        """The chunk's forward; on the last stage also its loss (added to ``loss_sum``) and its backward."""
        with self._mixed():
            out = self.module(arrival.inputs)
        if not self.is_last:
            return out
        with self._mixed():
            loss = self.loss_fn(out, targets)
        if before_backward is not None:
            before_backward()
        (loss * n).backward()  # a sum over the chunk's samples
        loss_sum += loss.detach() * n
        return out

    @property
    def _shares(self) -> list[int]:
        """The chunks each replica of the first stage owns this step."""
        return list(self._weights.shares) if self._weights is not None else [self._share] * self.replicas

    @property
    def _share(self) -> int:
        """Chunks each replica owns (chosen at the first run where ``chunks="auto"``)."""
        if self.chunks is None:
            raise RuntimeError("chunks='auto' are chosen by the first train(), before any step")
        return self.chunks

    def _backward(self, out: Any, arrival: Arrival) -> None:
        """Back-propagate the gradient the next stage returns for ``out``; pass the inputs' on to their sender."""
        self.router.backward(out, self._next)
        if self.stage > 0:
            self.router.send_grads(arrival)

    def _apply(self, pending: _Pending, losses: list[torch.Tensor]) -> float:
        """Wait for an all-reduce; step the optimizer with its mean gradient; return the seconds waited."""
        start = time.perf_counter()
        if pending.work is not None:
            pending.work.wait()
        waited = time.perf_counter() - start
        self._release(pending)
        samples = pending.samples  # (what the all-reduce summed too: read here, it would wait for the device)
        losses.append(pending.buffer[-2] / max(samples, 1))
        grads = pending.buffer
        if self._weights is not None:  # the next step's shares, the same on every replica
            self._weights.update(grads[-2 - self.replicas : -2].tolist())
        if self._statistics is not None:
            self._statistics.apply(grads[: self._statistics.size], pending.chunks)
            grads = grads[self._statistics.size :]
        if samples and self.optimizer is not None:
            set_mean_grads(self.params, grads, samples)
            if self._prediction is not None:
                self._prediction.before_update()
            self.optimizer.step()
        return waited

    def _release(self, pending: _Pending) -> None:
        """Delete this replica's claim keys of a step whose all-reduce is done (the later stages' queues are
        deleted as they are read)."""
        if self.stage == 0:
            release_share(self.store, pending.step_key, self.worker)
            if self._backups is not None:
                self._backups.release(pending.step_key, pending.owned)
