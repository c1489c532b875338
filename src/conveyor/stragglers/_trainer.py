"""Training that tolerates stragglers among replicas: rapid reassignment of chunks, backups, live reduction and
bounded staleness.

Data parallelism, or a pipeline whose first stage is replicated (``2-1``, ``3-1-1``; data parallelism is
one stage). The first stage's replicas read every batch. A batch is cut into ``replicas x chunks`` chunks,
claimed through the c10d store (:mod:`conveyor.stragglers._claims`): each replica runs its own share, and
with reassignment a replica out of work takes the unstarted tail of the slowest peer's. In a pipeline a
replica sends each chunk's activations on as soon as it has them, announced through the store
(:mod:`conveyor.stragglers._route`), so the next stage takes chunks in the order they come, from whichever
replica ran them, and returns each gradient to that replica (at most ``stages - s`` chunks are in flight
from stage ``s``; :mod:`conveyor.stragglers._inbox`). The first stage's replicas sum their chunks' per-sample
gradients, and the reduction of those sums and the sample count gives the batch's mean gradient whatever the
split:

    g(t) = (sum over chunks c of the batch: n_c grad l_c(W~(t))) / (sum of n_c) = grad L_t(W~(t))

where ``l_c`` is chunk ``c``'s mean loss over its ``n_c`` samples and ``L_t`` the batch's mean loss (for a
model whose samples do not interact: BatchNorm's batch statistics depend on the chunks, as on
microbatches), each chunk counted once whoever ran it. The reduction is an all-reduce of each replica's sums,
or, with live reduction, the sum of each chunk's own gradient sent by the replica whose run was used, which
needs no replica that ran nothing (:mod:`conveyor.stragglers._live`). BatchNorm's running statistics ride in
the same reduction, so every stage holds those of one process running the batch's chunks in order
(:mod:`conveyor.stragglers._statistics`).

**Slack** ``s`` (bounded staleness, with the all-reduce): the all-reduce of step ``t`` is started without
waiting, and step ``t`` applies the averaged gradient of step ``t - s``:

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
dropped, its compute time and the time it waited for the reduction (:attr:`FlexiblePipeline.records`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.config import Chunks
from conveyor.errors import InputError
from conveyor.runtime import (
    OptimizerFactory,
    as_blocks,
    batch_size,
    block_shapes,
    build_stage,
    default_device,
    split_batch,
    stage_ranges,
    to_device,
)
from conveyor.runtime.parts import reduce_dtype, set_mean_grads
from conveyor.schedule import check_replicas, stage_workers
from conveyor.stragglers._backup import Backups
from conveyor.stragglers._buffer import BufferLayout
from conveyor.stragglers._chunks import ChunkRun, FirstStage, StepWork
from conveyor.stragglers._claims import StepClaims
from conveyor.stragglers._granularity import agree_on_chunks
from conveyor.stragglers._inbox import Inbox
from conveyor.stragglers._later import LaterStage
from conveyor.stragglers._live import LiveReduction, parse_runner
from conveyor.stragglers._modes import check_flexible
from conveyor.stragglers._prediction import WeightPrediction
from conveyor.stragglers._records import StepRecord
from conveyor.stragglers._route import Router
from conveyor.stragglers._shares import ShareWeights, equal_cut
from conveyor.stragglers._stage import FlexibleStage
from conveyor.stragglers._statistics import RunningStatistics

__all__ = ["FlexiblePipeline"]

LossFn = Callable[[Any, Any], torch.Tensor]
_INSTANCES = itertools.count()  # every worker builds its trainers in the same order, so their keys agree


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
        live: reduce each step among the replicas whose runs were used, never waiting for one that ran nothing
            (:mod:`conveyor.stragglers._live`; needs ``slack=0``, and takes reassignment and backups).
        weighted: deal each step's chunks in proportion to the replicas' measured speeds
            (:mod:`conveyor.stragglers._shares`; ``False``: equal shares).
        predict: take gradients at the weights predicted ``slack`` updates ahead (see above).
        device: this worker's device; default ``cuda:LOCAL_RANK`` with CUDA, else CPU.
        autocast: run forwards and the loss under ``torch.autocast`` with this dtype (``torch.bfloat16``).

    Example (on every worker of ``conveyor.launch(main, nprocs=4)``: data parallelism)::

        ddp = FlexiblePipeline(model, loss_fn=F.cross_entropy, optimizer=partial(torch.optim.SGD, lr=0.1),
                               chunks=2, live=True)
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
        live: bool = False,
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
            backup=backup or live,
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
        self.loss_fn, self.slack, self.weighted, self.live = loss_fn, slack, weighted, live
        self.reassign = reassign or live
        self._id, self._runs, self._evals = next(_INSTANCES), 0, 0
        self._weights: ShareWeights | None = None  # the shares by speed, once the chunks are known
        self.chunks: int | None = chunks if isinstance(chunks, int) else None  # auto: chosen at the first train
        self.chunk_times: dict[int, float] = {}  # auto: a step's seconds on worker 0 at each candidate count
        self.autocast = autocast
        self._prediction = WeightPrediction(self.params, slack) if predict and slack > 0 else None
        self.store = dist.distributed_c10d._get_default_store()
        self.router = Router(self.store, self.device)
        self._statistics = RunningStatistics.of(self.module, self._dtype)  # updated in the chunks' order
        terms = self._statistics.size if self._statistics is not None else 0  # a chunk's BatchNorm term's length
        self._layout = BufferLayout(terms=terms, grads=sum(p.numel() for p in self.params))  # of its buffers
        self._backups, self._live = self._straggler_parts(counts, backup=backup, live=live)
        self._duplicates = (backup or live) and counts[0] > 1  # a later stage may receive a chunk twice
        # Every worker creates every group, as torch.distributed requires; data parallelism uses the world's.
        group = dist.new_group(stage_workers(counts)[0]) if self.num_stages > 1 and self.replicas > 1 else None
        self._group = group if self.stage == 0 and self.replicas > 1 else None
        self._next = self.replicas + self.stage  # the rank of the next stage's worker
        self._output = 0 if self.num_stages == 1 else world - 1  # the last stage's first worker
        self.steps = 0  # batches trained on
        self.records: list[StepRecord] = []
        dist.barrier()  # every worker is built before any claims work, or an early one would take it all

    def _straggler_parts(
        self, counts: tuple[int, ...], *, backup: bool, live: bool
    ) -> tuple[Backups | None, LiveReduction | None]:
        """The first stage's backups (with live reduction, a round per peer: a chunk a stalled backup holds is
        backed up in turn) and its side of live reduction, where its replicas have them."""
        if not (backup or live) or self.stage != 0 or counts[0] < 2:
            return None, None
        backups = Backups(self.store, replica=self.worker, rounds=counts[0] - 1 if live else 1)
        backups.attach(self.module)
        if not live:
            return backups, None
        tag = 1 + self._id  # apart from the router's messages (tag 0) and another trainer's
        ranks = stage_workers(counts)[0]
        return backups, LiveReduction(self.store, self.device, replica=self.worker, ranks=ranks, tag=tag)

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
        if self._live is not None:  # a chunk's buffer: its sums, then its loss, samples and seconds
            like = self._layout.empty(1, self._dtype, self.device)
            self._live.open(like, self.replicas * self._share)
        self._runs += 1
        if self._prediction is not None:
            self._prediction.restart()
        inbox = None
        if self.stage > 0:
            onward = self._queue(self.stage + 1) if not self.is_last else None
            inbox = Inbox(self.router, self._queue(self.stage), onward, keep=self._duplicates)
        pending: deque[StepWork] = deque()
        losses: list[torch.Tensor] = []  # on the device: read once, at the run's end
        steps = 0
        for index, (inputs, targets) in enumerate(self._steps(batches, inbox)):
            record = StepRecord(
                self.steps, self.stage, self._replica, 0, 0, 0, 0.0, 0.0, wall=time.time(), run=self._runs
            )
            step = self._first_step(index, inputs, targets, record) if inbox is None else None
            pending.append(step or self._later_step(inbox, index, targets, record))  # type: ignore[arg-type]
            if len(pending) > self.slack:
                record.wait_s = self._apply(pending.popleft(), losses)
            self.records.append(record)
            self.steps, steps = self.steps + 1, steps + 1
            if on_step is not None:
                on_step(self.steps)
        while pending:  # the last s gradients, in order (their waits end the run's last step)
            self.records[-1].wait_s += self._apply(pending.popleft(), losses)
        self._end_run(inbox, steps)
        return torch.stack(losses).tolist() if self.is_output and losses else None

    def _first_step(self, index: int, inputs: Any, targets: Any, record: StepRecord) -> StepWork:
        """Run this replica's chunks of one batch; start the reduction of their gradients."""
        start = time.perf_counter()
        for p in self.params:
            p.grad = None
        cut = self._cut(batch_size(inputs))
        parts = split_batch(inputs, cut)
        y_parts = split_batch(targets, cut) if self.is_last else None
        starts = [sum(cut[:j]) for j in range(len(cut))]
        chunks = [j for j, n in enumerate(cut) if n]
        step = StepWork.begin(
            index,
            self._step_key(index),
            chunks=chunks,
            samples=batch_size(inputs),
            record=record,
            owned=range(sum(self._shares[: self._replica]), sum(self._shares[: self._replica + 1])),
            layout=self._layout,
            dtype=self._dtype,
            device=self.device,
        )
        record.owned, record.cut = sum(cut[j] for j in step.owned), cut
        if self._backups is not None:
            self._backups.prefix = step.key
        runs = self._first_stage(step)
        with self._predicted(), self._statistics.step() if self._statistics is not None else contextlib.nullcontext():
            for j, source in self._sources(step, chunks, runs):
                if not (n := batch_size(parts[j])):  # a short batch leaves the last chunks empty
                    continue
                y = to_device(y_parts[j], self.device) if y_parts is not None else None
                runs.run(ChunkRun(j, len(chunks), starts[j], n, source, to_device(parts[j], self.device), y))
                if source == "backup":  # committed only after its backward: no peer waits on a backup in flight
                    runs.drain()
            runs.drain()
        record.compute_s = time.perf_counter() - start
        if self._live is None:
            step.reduce(self.params, reduces=self._reduces, group=self._group, extra=self._rates(step))
        return step

    def _predicted(self) -> contextlib.AbstractContextManager[Any]:
        """Within: the parameters are the weights predicted ``slack`` updates ahead (or the weights)."""
        return self._prediction.predicted() if self._prediction is not None else contextlib.nullcontext()

    def _first_stage(self, step: StepWork) -> FirstStage:
        return FirstStage(
            step=step,
            module=self.module,
            params=self.params,
            loss_fn=self.loss_fn,
            mixed=self._mixed,
            statistics=self._statistics,
            backups=self._backups,
            live=self._live,
            router=self.router if not self.is_last else None,
            queue=self._queue(1),
            next_rank=self._next,
            depth=self.num_stages,
            replica=self.worker,
        )

    def _sources(self, step: StepWork, chunks: list[int], runs: FirstStage) -> Iterator[tuple[int, str]]:
        """The chunks this replica runs in the step, each with how it came: ``own``, ``taken`` from a peer's share
        or a ``backup`` of a peer's run (once idle, of chunks still unfinished at the deadline)."""
        claims = StepClaims(self.store, step.key, replica=self.worker, shares=self._shares, reassign=self.reassign)
        for j, taken in claims:
            yield j, "taken" if taken else "own"
        runs.drain()  # this replica's own chunks committed before it watches the others'
        if self._backups is not None:
            for j in self._backups.takeovers(chunks):
                yield j, "backup"

    def _rates(self, step: StepWork) -> list[float]:
        """With weighted shares, this replica's samples a second in its own slot, the others' zero (an all-reduce
        then gives every replica every rate exactly)."""
        if self._weights is None:
            return []
        return [step.rate if w == self.worker else 0.0 for w in range(self.replicas)]

    def _later_step(self, inbox: Inbox, index: int, targets: Any, record: StepRecord) -> StepWork:
        """Run this stage's chunks of one batch as they arrive (each once), answering each with its inputs'
        gradient (:mod:`conveyor.stragglers._later`)."""
        start = time.perf_counter()
        for p in self.params:
            p.grad = None
        step = StepWork.begin(
            index,
            self._step_key(index),
            chunks=[],
            samples=0,
            record=record,
            layout=self._layout,
            dtype=self._dtype,
            device=self.device,
        )
        stage = LaterStage(
            module=self.module,
            loss_fn=self.loss_fn,
            mixed=self._mixed,
            statistics=self._statistics,
            router=self.router,
            next_rank=self._next,
            depth=self.num_stages - self.stage,
            last=self.is_last,
        )
        with self._predicted(), self._statistics.step() if self._statistics is not None else contextlib.nullcontext():
            stage.run(step, inbox, targets, self._queue(self.stage + 1))
        record.compute_s = time.perf_counter() - start
        step.reduce(self.params, reduces=False, group=None, extra=[])
        return step

    @property
    def _shares(self) -> list[int]:
        """The chunks each replica of the first stage owns this step."""
        return self._weights.shares() if self._weights is not None else [self._share] * self.replicas

    def _cut(self, samples: int) -> list[int]:
        """The sizes of a batch's chunks, each replica's in turn: in proportion to the replicas' measured speeds
        (:mod:`conveyor.stragglers._shares`), or as equal as possible."""
        if self._weights is not None:
            return self._weights.cut(samples)
        return equal_cut(samples, self.replicas * self._share)

    def _apply(self, step: StepWork, losses: list[torch.Tensor]) -> float:
        """Wait for a step's reduction; step the optimizer with its mean gradient; return the seconds waited."""
        start = time.perf_counter()
        rates: list[float] = []
        if self._live is not None and self._backups is not None:
            runners = {j: parse_runner(self._backups.runner(j)) for j in step.chunks}
            step.buffer, rates = self._live.reduce(runners, self.replicas, self._layout)
        else:
            step.wait()
        waited = time.perf_counter() - start
        assert step.buffer is not None
        buffer = self._layout.read(step.buffer)
        if self._live is None and self._weights is not None:
            rates = buffer.extra.tolist()  # each replica's rate, in its slot
        losses.append(buffer.loss / max(step.samples, 1))
        if self._weights is not None and rates:  # the next step's shares, the same on every replica
            self._weights.update(rates)
        if self._statistics is not None:
            self._statistics.apply(buffer.terms, len(step.chunks))
        if step.samples and self.optimizer is not None:
            set_mean_grads(self.params, buffer.grads, step.samples)
            if self._prediction is not None:
                self._prediction.before_update()
            self.optimizer.step()
        self._release(step)
        return waited
