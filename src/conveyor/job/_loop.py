"""The training job's epoch loop, over any trainer that keeps the :class:`Trainer` protocol.

Each epoch: train on the epoch's batches (the progress bar, the energy knobs and the CPU's thread count follow
every update), evaluate on the test set, then agree with every other worker in one all-reduce on what the epoch
was (its accuracy, energy and seconds) and whether to go on (the target reached, the lease out, the cost over
its limit, a stop asked for). The output worker writes the epoch's line of ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from conveyor.config import TrainConfig
from conveyor.emulate.parts import ServerTraffic
from conveyor.energy import Meter
from conveyor.job._data import Inputs, rows
from conveyor.job._energy import EpochKnobs
from conveyor.job._estimate import checkpoint_extras
from conveyor.job._lease import lease_expires, read_lease
from conveyor.job._loader import EpochBatches
from conveyor.job._report import continued
from conveyor.job._summary import Divergence
from conveyor.job._trace import torch_profiled
from conveyor.plan import Topology
from conveyor.runtime import CoreShare
from conveyor.runtime.parts import stop_requested

__all__ = ["EpochLoop", "EpochRecord", "LoopOutcome", "Trainer", "whole_history"]

BAR_PERIOD_S = 0.05  # the progress bar moves at most this often (it redraws ten times a second)
IGNORED = -100  # a target position not scored: cross-entropy's default ignore_index (padding in labels)


class Trainer(Protocol):
    """What the epoch loop needs of a trainer: :class:`~conveyor.runtime.Pipeline` and
    :class:`~conveyor.stragglers.FlexiblePipeline` keep it."""

    worker: int  # this process's rank
    steps: int  # batches trained on so far (a loaded checkpoint's included)

    @property
    def is_first(self) -> bool:
        """Whether this worker reads the batches' inputs."""
        ...

    @property
    def is_last(self) -> bool:
        """Whether this worker reads the batches' targets."""
        ...

    @property
    def is_output(self) -> bool:
        """Whether this worker returns the losses and the evaluation's outputs."""
        ...

    def train(
        self, batches: Iterable[tuple[Any, Any]] | None, on_step: Callable[[int], None] | None = None
    ) -> list[float] | None:
        """One epoch; each batch's loss on the output worker, ``None`` elsewhere."""
        ...

    def evaluate(self, inputs: Any = None) -> Any:
        """The model's outputs for ``inputs`` (given on worker 0) on the output worker, ``None`` elsewhere."""
        ...

    def save(self, path: str | os.PathLike[str], extra: Mapping[str, Any] | None = None) -> None:
        """Write the whole model's checkpoint with worker 0's ``extra`` entries (every worker calls it)."""
        ...

    def load(self, path: str | os.PathLike[str]) -> None:
        """Read a checkpoint written by any layout of the same model."""
        ...

    def gather_records(self) -> list[dict[str, Any]] | None:
        """A flexible pipeline's step records since the last call (stragglers.jsonl) on the output worker;
        ``None`` elsewhere and for a trainer that keeps none. Every worker calls it."""
        ...

    def wan_records(self) -> list[dict[str, Any]] | None:
        """Each data centre's outer-sync counts since the last call (wan.jsonl) on worker 0; ``None`` elsewhere and
        for a trainer without an outer sync. Every worker calls it."""
        ...


@dataclass
class EpochRecord:
    """One line of ``metrics.jsonl``."""

    epoch: int
    seconds: float  # wall clock since training started, at the end of this epoch's evaluation
    train_seconds: float  # of that, the time spent training
    samples: int
    samples_per_s: float  # training samples per second of training time
    loss: float
    accuracy: float
    bytes_between_servers: int | None  # sent up out of the emulated servers while training (None off one)
    energy_j: float | None = None  # this epoch's training and evaluation, all workers' meters (None: no meter)
    energy_total_j: float | None = None  # since training started (None until an epoch is measured)


@dataclass
class LoopOutcome:
    """How the epochs went: the output worker's records (empty elsewhere) and why they stopped early, if so."""

    history: list[EpochRecord] = field(default_factory=list)
    stopped_by_lease: bool = False
    stopped_by_cost: bool = False
    interrupted: bool = False
    diverged: Divergence | None = None  # on every worker


@dataclass(frozen=True, kw_only=True)
class EpochLoop:
    """Everything the epochs use; :meth:`run` trains them (every worker calls it)."""

    cfg: TrainConfig
    trainer: Trainer
    batches: EpochBatches | None  # the first and last stages' batches, None between
    test_x: Inputs | None  # worker 0's
    test_y: torch.Tensor | None  # the output worker's
    test_samples: int  # on every worker, which takes part in each chunk's evaluation
    train_samples: int
    updates: int  # this worker's updates per epoch
    first_epoch: int  # epochs a loaded checkpoint trained: the data order goes on from there
    folder: Path
    checkpoint: str
    device: torch.device
    meter: Meter
    knobs: EpochKnobs
    cores: CoreShare | None
    history_before: Sequence[Mapping[str, Any]] = ()  # --resume: the epochs the checkpoint's runs trained

    def run(self) -> LoopOutcome:
        """Train until the epochs, the target accuracy, the lease, the cost limit or a stop request end it."""
        outcome, cfg = LoopOutcome(), self.cfg
        until = read_lease(cfg.run.lease) if cfg.run.lease and dist.get_rank() == 0 else None  # worker 0 alone reads it
        traffic, energy_total = ServerTraffic(self.trainer.is_output), None
        last_loss: float | None = None  # the output worker's last finite step loss
        start, train_seconds = time.perf_counter(), 0.0
        with self._progress() as bar:
            task = bar.add_task("training", total=cfg.run.epochs * self.updates, status="")

            unshown, shown_at = 0, time.monotonic()  # updates not yet on the bar, and when it last moved

            def updated(_: int) -> None:  # after each update: the bar, the power limit's profiling windows, threads
                nonlocal unshown, shown_at
                unshown += 1
                if time.monotonic() - shown_at >= BAR_PERIOD_S:  # at every step: 1.5% of the MLP's
                    bar.advance(task, unshown)
                    unshown, shown_at = 0, time.monotonic()
                self.knobs.step()
                if self.cores is not None:
                    self.cores.update()

            for epoch in range(cfg.run.epochs):
                self.meter.begin()
                began = time.perf_counter()
                traffic.start()
                wan = self._wan_traffic()  # this epoch's
                if wan is not None:
                    wan.start()
                losses = self._train_epoch(epoch, updated)
                train_seconds += time.perf_counter() - began
                bar.advance(task, unshown)
                unshown = 0
                traffic.stop()
                if wan is not None:
                    wan.stop()
                    self._write_wan_records(epoch, wan)
                correct = self._test_accuracy()
                joules, evaluated = self.meter.end(), time.perf_counter()
                until, lease_out = self._lease(until, epoch, began)
                bad_step, last_loss = _first_not_finite(losses, last_loss)
                agreed = _agree(correct, lease_out, joules, (evaluated - began), self.device, (bad_step, last_loss))
                if (epoch_energy := agreed.spent[0]) is not None:
                    energy_total = (energy_total or 0.0) + epoch_energy
                if self.trainer.is_output:
                    assert losses is not None
                    record = _record(
                        epoch + 1,
                        self.train_samples,
                        losses,
                        agreed,
                        seconds=evaluated - start,
                        train_seconds=train_seconds,
                        bytes_between_servers=traffic.total,
                        energy_total=energy_total,
                    )
                    self._write(outcome, record, bar, task)
                if self._ends(outcome, agreed, epoch + 1):
                    break
                self._checkpoint_between(outcome, epoch + 1)
        self._write_straggler_records()  # once: a gather each epoch would wait there for a stalled replica
        return outcome

    def _ends(self, outcome: LoopOutcome, agreed: Agreed, epochs: int) -> bool:
        """Whether the run ends after ``epochs`` epochs, on what every worker agreed (the outcome says why): the
        weights diverged (before a checkpoint), the target reached, the lease or the cost limit out, a stop asked."""
        outcome.diverged = agreed.divergence(epochs)
        if outcome.diverged is not None:
            return True
        over = self.knobs.epoch_end(*agreed.spent)
        target = self.cfg.run.target_accuracy
        if target is not None and agreed.accuracy >= target:
            return True
        outcome.stopped_by_lease, outcome.stopped_by_cost, outcome.interrupted = agreed.expired, over, agreed.stop
        return agreed.expired or over or agreed.stop

    def _checkpoint_between(self, outcome: LoopOutcome, epochs: int) -> None:
        """Every ``--checkpoint-every`` epochs but the last: a run killed later loses at most the epochs since."""
        every = self.cfg.run.checkpoint_every
        if every and epochs % every == 0 and epochs < self.cfg.run.epochs:
            saved = checkpoint_extras(self.cfg, whole_history(self.history_before, outcome, self.trainer.is_output))
            self.trainer.save(self.checkpoint, saved)

    def _write(self, outcome: LoopOutcome, record: EpochRecord, bar: Progress, task: TaskID) -> None:
        """The output worker's record of an epoch: in the outcome, ``metrics.jsonl`` and the progress bar."""
        outcome.history.append(record)
        with (self.folder / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(asdict(record)) + "\n")
        status = f"epoch {record.epoch} loss {record.loss:.3f} acc {record.accuracy:.3f} "
        bar.update(task, status=status + f"{record.samples_per_s:.0f} samples/s")

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            disable=not self.trainer.is_output,
        )

    def _train_epoch(self, epoch: int, updated: Callable[[int], None]) -> list[float] | None:
        if self.batches is not None:
            self.batches.order.epoch = self.first_epoch + epoch
        profiled = (
            self.cfg.run.torch_profile if epoch == min(1, self.cfg.run.epochs - 1) else None
        )  # the 2nd: warmed up
        with torch_profiled(profiled, f"worker{dist.get_rank()}", self.device):
            losses = self.trainer.train(self.batches, updated)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the epoch's time is the GPU's too
        return losses

    def _write_straggler_records(self) -> None:
        if (records := self.trainer.gather_records()) is not None:
            with (self.folder / "stragglers.jsonl").open("a") as f:
                f.writelines(json.dumps({"epoch": r.pop("run"), **r}) + "\n" for r in records)

    def _wan_traffic(self) -> ServerTraffic | None:
        """With ``--wan``, worker 0's count of what each data centre sends up its WAN link (the outer level)."""
        network = self.cfg.emulation.network
        if self.cfg.wan.mode == "off" or network is None:
            return None
        return ServerTraffic(dist.get_rank() == 0, level=len(Topology.parse(network).levels) - 1)

    def _write_wan_records(self, epoch: int, wan: ServerTraffic) -> None:
        """wan.jsonl: per data centre and epoch, the bytes its WAN link carried (the kernel's count, frames
        included; ``null`` off an emulated network) beside what the outer sync sent and how stale its reads were."""
        records = self.trainer.wan_records()
        if records is None:
            return
        with (self.folder / "wan.jsonl").open("a") as f:
            for r in records:
                sent = wan.by_group.get(r["site"], 0) if wan.total is not None else None
                f.write(json.dumps({"epoch": epoch + 1, "wan_bytes": sent, **r}) + "\n")

    def _lease(self, until: float | None, epoch: int, began: float) -> tuple[float | None, bool]:
        """Worker 0's lease, read again, and whether another epoch as long as this one would end past it."""
        if until is None or not self.cfg.run.lease or epoch + 1 >= self.cfg.run.epochs:
            return until, False
        with contextlib.suppress(ValueError):  # the scheduler replaces it atomically: keep the last read
            until = read_lease(self.cfg.run.lease)
        return until, lease_expires(until, time.perf_counter() - began, time.time())

    def _test_accuracy(self) -> torch.Tensor | None:
        """The test accuracy, a 0-d tensor on the output worker's device (``None`` on the others); the test set is
        evaluated in chunks of a batch (a whole one could outgrow the device), every worker taking part in each
        (worker 0 holds the inputs, the output worker the targets)."""
        x, y, chunk, correct = self.test_x, self.test_y, self.cfg.optimizer.batch_size, None
        for start in range(0, self.test_samples, chunk):
            logits = self.trainer.evaluate(None if x is None else rows(x, slice(start, start + chunk)))
            if self.trainer.is_output:
                assert y is not None
                hits = (logits.argmax(-1) == y[start : start + chunk]).sum()  # never an IGNORED position
                correct = hits if correct is None else correct + hits
        return None if correct is None or y is None else correct.double() / (y != IGNORED).sum()


def whole_history(before: Sequence[Mapping[str, Any]], outcome: LoopOutcome, is_output: bool) -> list[dict[str, Any]]:
    """The run's epochs so far, those before a resume included (a checkpoint keeps them), on every worker: the
    output worker's records gathered (every worker calls it)."""
    records: list[list[dict[str, Any]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(records, [asdict(r) for r in outcome.history] if is_output else None)
    return continued(before, next(r for r in records if r is not None))


def _first_not_finite(losses: list[float] | None, last: float | None) -> tuple[int, float | None]:
    """The step (from 1) of ``losses``' first loss that is not finite (0: none is; ``losses`` is ``None`` off the
    output worker), and the last finite loss before it (``last``, the epochs' before, where none is)."""
    for step, loss in enumerate(losses or (), 1):
        if not math.isfinite(loss):
            return step, last
        last = loss
    return 0, last


def _record(
    epochs: int,
    train_samples: int,
    losses: list[float],
    agreed: Agreed,
    *,
    seconds: float,
    train_seconds: float,
    bytes_between_servers: int | None,
    energy_total: float | None,
) -> EpochRecord:
    """The output worker's record of epoch ``epochs``: ``seconds`` since the run began, ``train_seconds`` of them
    training, ``losses`` the epoch's steps'."""
    samples = epochs * train_samples
    return EpochRecord(
        epoch=epochs,
        seconds=seconds,
        train_seconds=train_seconds,
        samples=samples,
        samples_per_s=samples / train_seconds,
        loss=sum(losses) / len(losses),
        accuracy=agreed.accuracy,
        bytes_between_servers=bytes_between_servers,
        energy_j=agreed.spent[0],
        energy_total_j=energy_total,
    )


@dataclass(frozen=True)
class Agreed:
    """What the workers agree on after an epoch (see :func:`_agree`)."""

    accuracy: float
    expired: bool  # worker 0's lease runs out
    spent: tuple[float | None, float]  # the epoch's joules (None: no meter read) and its mean seconds
    stop: bool  # a worker was asked to stop
    bad_step: int  # the output worker's first step whose loss is not finite (0: none)
    last_finite_loss: float | None  # the output worker's last finite step loss before it

    def divergence(self, epoch: int) -> Divergence | None:
        """Where epoch ``epoch``'s loss stopped being finite, if it did."""
        if not self.bad_step:
            return None
        return Divergence(epoch=epoch, step=self.bad_step, last_finite_loss=self.last_finite_loss)


def _agree(
    correct: torch.Tensor | None,
    lease_out: bool,
    joules: float | None,
    seconds: float,
    device: torch.device,
    loss: tuple[int, float | None],
) -> Agreed:
    """Summed over workers in one all-reduce: the output worker's test accuracy, worker 0's lease running out (each
    alone sets its own), every worker's joules and whether its meter read them, the epoch's seconds as a mean (so
    every worker prices the epoch alike), whether any worker was asked to stop (Ctrl-C, SIGTERM), and the output
    worker's ``loss``: the step whose loss stopped being finite (0: none) and the last finite one (the others
    give 0s)."""
    bad_step, last_finite = loss
    flags = torch.tensor(
        [
            0.0,
            float(lease_out),
            joules or 0.0,
            float(joules is not None),
            seconds / dist.get_world_size(),
            float(stop_requested()),
            float(bad_step),
            0.0 if not bad_step or last_finite is None else last_finite,
            float(bad_step > 0 and last_finite is not None),
        ],
        dtype=torch.float64,
        device=device,  # NCCL reduces device tensors only
    )
    if correct is not None:  # the output worker's
        flags[0] = correct
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    accuracy, expired, epoch_j, meters_read, epoch_s, stop, step, finite, has_finite = flags.tolist()
    return Agreed(
        accuracy=accuracy,
        expired=expired > 0,
        spent=(epoch_j if meters_read else None, epoch_s),
        stop=stop > 0,
        bad_step=int(step),
        last_finite_loss=finite if has_finite else None,
    )
