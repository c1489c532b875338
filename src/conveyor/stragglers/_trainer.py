"""Data parallelism that tolerates stragglers: rapid reassignment of chunks and bounded staleness (slack).

Every replica holds the whole model and reads every batch. A batch is cut into ``replicas x chunks``
chunks, claimed through the c10d store (:mod:`conveyor.stragglers._claims`): each replica runs its own
share, and with reassignment a replica out of work takes the unstarted tail of the slowest peer's. Each
replica sums its chunks' per-sample gradients; one all-reduce of the sums and the sample count gives the
batch's mean gradient whatever the split:

    g(t) = (sum over replicas r, chunks c claimed by r: n_c grad l_c(W~(t))) / (sum of n_c) = grad L_t(W~(t))

where ``l_c`` is chunk ``c``'s mean loss over its ``n_c`` samples and ``L_t`` the batch's mean loss (for a
model whose samples do not interact: BatchNorm's batch statistics depend on the chunks, as on microbatches,
and each replica keeps its own running statistics; replica 0's evaluate and are saved).

**Slack** ``s`` (bounded staleness): the all-reduce of step ``t`` is started without waiting, and step ``t``
applies the averaged gradient of step ``t - s``:

    W(t + 1) = opt(W(t), g(t - s))    for t >= s;    W(t + 1) = W(t) for t < s

so a replica waits only for the all-reduce ``s`` steps old, i.e. it runs at most ``s`` steps ahead of the
slowest replica, and a short pause of one replica (which can hand over nothing while frozen) is absorbed.
At the end of a run the last ``s`` gradients are applied in order, so a run makes one update per batch.
Every replica applies the same updates in the same order, so all hold the same parameters. ``s = 0`` is
synchronous data parallelism. The gradients are ``s`` updates old when applied, so, as for the asynchronous
pipelines, they are taken at the weights predicted ``s`` updates ahead (weight prediction; SpecTrain's
form with SGD momentum):

    W~(t) = W(t) + s (W(t) - W(t - 1))    (W~(t) = W(t) when ``predict`` is off or t = 0)

where ``W(t - 1)`` is the weights one step earlier in the same run: until a run's first update (its first
``s`` steps, whose gradients are applied with fewer than ``s`` updates between) there is nothing to
extrapolate.

Each step, each replica records the samples it ran, those it took from peers, its compute time and
the time it waited for the all-reduce (:attr:`FlexibleDataParallel.records`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import conveyor.runtime._checkpoint as checkpoint
from conveyor.runtime import OptimizerFactory, default_device
from conveyor.runtime._microbatch import batch_size, split, to_device
from conveyor.runtime._update import pack_grads, reduce_dtype, set_mean_grads
from conveyor.stragglers._claims import StepClaims

__all__ = ["FlexibleDataParallel", "StepRecord"]

LossFn = Callable[[Any, Any], torch.Tensor]
_INSTANCES = itertools.count()  # every replica builds its trainers in the same order, so their keys agree


@dataclass
class StepRecord:
    """What one replica did in one step (a line of the run folder's ``stragglers.jsonl``)."""

    step: int  # batches trained on before this one, over all runs
    replica: int
    samples: int  # samples this replica ran
    chunks: int  # chunks it ran
    taken: int  # of its samples, those taken from a peer's share
    compute_s: float  # forward and backward time
    wait_s: float  # time blocked on the all-reduce the update needed (slack 0: this step's)


@dataclass
class _Pending:
    buffer: torch.Tensor  # the gradient sums, then the loss sum and the sample count (pack_grads)
    work: Any  # the all-reduce in flight


class FlexibleDataParallel:
    """Train ``model`` data-parallel over the default process group, tolerating stragglers.

    Args:
        model: the whole model (every replica builds it identically).
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over a chunk's samples.
        optimizer: builds the optimizer from the parameters, e.g. ``partial(torch.optim.SGD, lr=0.1)``.
        chunks: chunks each replica owns per batch (the reassignment granularity).
        slack: ``s``, how many steps a replica may run ahead of the slowest (0: synchronous).
        reassign: let replicas take chunks from slow peers (``False``: a fixed split).
        predict: take gradients at the weights predicted ``slack`` updates ahead (see above).
        device: this worker's device; default ``cuda:LOCAL_RANK`` with CUDA, else CPU.

    Example (on every worker of ``conveyor.launch(main, nprocs=4)``)::

        ddp = FlexibleDataParallel(model, F.cross_entropy, partial(torch.optim.SGD, lr=0.1), chunks=4, slack=1)
        for epoch in range(10):
            losses = ddp.train(loader)       # every replica reads every batch, in the same order
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        chunks: int = 4,
        slack: int = 0,
        reassign: bool = True,
        predict: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: run under conveyor.launch or torchrun")
        if chunks < 1 or slack < 0:
            raise ValueError(f"chunks must be at least 1 and slack at least 0, got chunks={chunks}, slack={slack}")
        self.device = torch.device(device) if device is not None else default_device()
        self.module = model.to(self.device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = optimizer(self.params)
        self._dtype = reduce_dtype(self.params)
        self.loss_fn, self.chunks, self.slack, self.reassign = loss_fn, chunks, slack, reassign
        self.predict = predict and slack > 0
        self.worker, self.replicas = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self.steps = 0  # batches trained on
        self.records: list[StepRecord] = []
        self._previous: list[torch.Tensor] | None = None  # W(t - 1), for the prediction
        self._id, self._runs = next(_INSTANCES), 0
        dist.barrier()  # every replica is built before any claims work, or an early one would take it all

    is_first = is_last = True  # every replica reads every batch's inputs and targets

    @property
    def is_output(self) -> bool:
        """Whether this worker reports the losses and evaluates: replica 0."""
        return self.worker == 0

    def train(
        self, batches: Iterable[tuple[Any, Any]] | None, on_step: Callable[[int], None] | None = None
    ) -> list[float] | None:
        """Train on every batch of ``batches`` (the same batches in the same order on every replica).

        Returns:
            Each batch's mean loss on replica 0, ``None`` elsewhere.
        """
        if batches is None:
            raise ValueError(f"every replica reads the batches: pass them on worker {self.worker}")
        self.module.train()
        self._runs += 1
        self._previous = None  # W(t - 1) = W(t) until this run's first update: its first gradients are fresh
        pending: deque[_Pending] = deque()
        losses: list[float] = []
        for inputs, targets in batches:
            record = StepRecord(self.steps, self.worker, 0, 0, 0, 0.0, 0.0)
            pending.append(self._compute(inputs, targets, record))
            if len(pending) > self.slack:
                record.wait_s = self._apply(pending.popleft(), losses)
            self.records.append(record)
            self.steps += 1
            if on_step is not None:
                on_step(self.steps)
        while pending:  # the last s gradients, in order (their waits end the run's last step)
            self.records[-1].wait_s += self._apply(pending.popleft(), losses)
        return losses if self.is_output else None

    def _compute(self, inputs: Any, targets: Any, record: StepRecord) -> _Pending:
        """Claim and run this replica's chunks of one batch; start the all-reduce of their sums."""
        start = time.perf_counter()
        parts = self.replicas * self.chunks
        x_parts, y_parts = split(inputs, parts), split(targets, parts)
        claims = StepClaims(self.store, f"conveyor/flexible{self._id}/run{self._runs}/step{self.steps}", self.worker,
                            self.replicas, self.chunks, self.reassign)  # fmt: skip
        master = self._predicted() if self.predict else None
        loss_sum = 0.0
        for p in self.params:
            p.grad = None
        for j, taken in claims:
            n = batch_size(x_parts[j])
            if not n:
                continue
            out = self.module(to_device(x_parts[j], self.device))
            loss = self.loss_fn(out, to_device(y_parts[j], self.device))
            (loss * n).backward()  # a sum over the chunk's samples
            loss_sum += float(loss.detach()) * n
            record.samples, record.chunks = record.samples + n, record.chunks + 1
            record.taken += n if taken else 0
        if master is not None:
            with torch.no_grad():
                for p, w in zip(self.params, master, strict=True):
                    p.copy_(w)
        buffer = pack_grads(self.params, self._dtype, self.device, [loss_sum, float(record.samples)])
        record.compute_s = time.perf_counter() - start
        return _Pending(buffer, dist.all_reduce(buffer, async_op=True))

    def _predicted(self) -> list[torch.Tensor]:
        """Set the parameters to W~(t) = W(t) + s (W(t) - W(t - 1)); return W(t) to put back."""
        master = [p.detach().clone() for p in self.params]
        if self._previous is not None:
            with torch.no_grad():
                for p, prev in zip(self.params, self._previous, strict=True):
                    p.add_(p - prev, alpha=self.slack)
        return master

    def _apply(self, pending: _Pending, losses: list[float]) -> float:
        """Wait for an all-reduce; step the optimizer with its mean gradient; return the seconds waited."""
        start = time.perf_counter()
        pending.work.wait()
        waited = time.perf_counter() - start
        loss_sum, samples = pending.buffer[-2:].tolist()
        losses.append(loss_sum / max(samples, 1.0))
        if samples:
            set_mean_grads(self.params, pending.buffer, samples)
            if self.predict:
                self._previous = [p.detach().clone() for p in self.params]
            self.optimizer.step()
        return waited

    @torch.no_grad()
    def evaluate(self, inputs: Any = None) -> Any:
        """Replica 0's model output for ``inputs`` (every worker calls it; only worker 0 needs ``inputs``)."""
        if not self.is_output:
            return None
        self.module.eval()
        return self.module(to_device(inputs, self.device))

    def gather_records(self) -> list[dict[str, Any]] | None:
        """Every replica's records since the last call, on replica 0 (``None`` elsewhere); every worker calls it."""
        mine, self.records = [asdict(r) for r in self.records], []
        parts: list[Any] = [None] * self.replicas if self.is_output else []
        dist.gather_object(mine, parts if self.is_output else None, dst=0)
        if not self.is_output:
            return None
        return sorted((r for part in parts for r in part), key=lambda r: (r["step"], r["replica"]))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model and optimizer to ``path`` (replica 0 writes; every worker must call it)."""
        if self.is_output:
            state = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
            optim = checkpoint.named_optimizer_state(self.optimizer, self.module)
            checkpoint.save(path, state, optimizer=optim, steps=self.steps)
        dist.barrier()

    def load(self, path: str | os.PathLike[str]) -> None:
        """Load a checkpoint of this model (saved by this class, a :class:`~conveyor.runtime.Pipeline` or a
        plain model)."""
        payload = checkpoint.load(path)
        shapes = {k: v.shape for k, v in self.module.state_dict().items()}
        checkpoint.check_compatible(payload["model"], shapes, str(path))
        self.module.load_state_dict(payload["model"])
        if payload.get("optimizer"):
            checkpoint.set_optimizer_state(self.optimizer, self.module, payload["optimizer"])
        self.steps = int(payload.get("steps", 0))
