"""A small pipelined training run on real bundled data: scikit-learn's handwritten digits.

This is what ``conveyor train`` runs with no arguments: an MLP cut into stages, trained on local worker
processes with any pipeline schedule (each epoch is one run of it), evaluated on held-out digits every
epoch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from conveyor.launch import launch
from conveyor.pipeline import Pipeline
from conveyor.schedule import Op

__all__ = ["TrainConfig", "digits", "even_balance", "mlp", "train"]


@dataclass(frozen=True)
class TrainConfig:
    """What ``conveyor train`` does."""

    stages: int = 2
    replicas: str | None = None  # workers per stage, "2-1"; default one each
    schedule: str = "flush"
    microbatches: int = 4
    batch_size: int = 64
    epochs: int = 10
    lr: float = 0.05
    momentum: float = 0.9
    target_accuracy: float | None = None
    checkpoint: str | None = None
    resume: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"--batch-size {self.batch_size} is not a multiple of --microbatches {self.microbatches}: "
                "pick a batch size divisible by the microbatch count"
            )
        if self.epochs < 1:
            raise ValueError(f"--epochs must be at least 1, got {self.epochs}")
        counts = self.replica_counts
        if len(counts) != self.stages or min(counts) < 1:
            raise ValueError(
                f"--replicas {self.replicas} must give each of the {self.stages} stages a worker count >= 1, "
                f"e.g. {'-'.join(['2'] + ['1'] * (self.stages - 1))}"
            )

    @property
    def replica_counts(self) -> tuple[int, ...]:
        if self.replicas is None:
            return (1,) * self.stages
        try:
            return tuple(int(r) for r in self.replicas.split("-"))
        except ValueError:
            raise ValueError(f"--replicas {self.replicas!r} is not a list of counts like 2-1") from None

    @property
    def workers(self) -> int:
        return sum(self.replica_counts)


@dataclass
class TrainResult:
    """What a training run reports (from the last stage)."""

    epochs: int = 0
    accuracy: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    seconds: float = 0.0
    samples_per_s: float = 0.0


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package): train/test tensors."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def mlp(width: int = 128) -> nn.Sequential:
    """A 5-block MLP for 64-pixel digits; a block's output feeds the next, so it can be cut anywhere."""
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def even_balance(blocks: int, stages: int) -> list[int]:
    """Blocks per stage, as equal as possible: ``even_balance(5, 2) == [3, 2]``."""
    if not 1 <= stages <= blocks:
        raise ValueError(f"cannot cut {blocks} blocks into {stages} stages: use 1 to {blocks} stages")
    return [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]


def _worker(cfg: TrainConfig) -> dict[str, Any] | None:
    torch.manual_seed(cfg.seed)
    model = mlp()
    pipe = Pipeline(
        model,
        even_balance(len(model), cfg.stages),
        cfg.microbatches,
        F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=cfg.lr, momentum=cfg.momentum),
        schedule=cfg.schedule,
        replicas=cfg.replica_counts,
    )
    if cfg.resume:
        pipe.load(cfg.resume)
    x_train, y_train, x_test, y_test = digits(cfg.seed)
    steps = len(x_train) // cfg.batch_size  # the last partial batch is dropped
    updates = [a.op for a in pipe.schedule(steps).actions[pipe.worker]].count(Op.STEP)  # per epoch, this worker
    result = TrainResult()
    start = time.perf_counter()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        disable=not pipe.is_output,
    ) as bar:
        task = bar.add_task("training", total=cfg.epochs * updates, status="")
        for epoch in range(cfg.epochs):
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(cfg.seed + epoch))
            batches = [
                (x_train[idx], y_train[idx])
                for idx in (order[i * cfg.batch_size : (i + 1) * cfg.batch_size] for i in range(steps))
            ]
            losses = pipe.train(batches, on_step=lambda _: bar.update(task, advance=1))
            # The test set's 360 samples split into the pipeline's microbatches.
            n_test = len(x_test) - len(x_test) % cfg.microbatches
            logits = pipe.evaluate(x_test[:n_test])
            if pipe.is_output:
                result.accuracy.append(float((logits.argmax(1) == y_test[:n_test]).float().mean()))
                result.loss.append(sum(losses) / len(losses))
                elapsed = time.perf_counter() - start
                status = f"epoch {epoch + 1} loss {result.loss[-1]:.3f} acc {result.accuracy[-1]:.3f}"
                bar.update(task, status=f"{status} {(epoch + 1) * steps * cfg.batch_size / elapsed:.0f} samples/s")
            result.epochs = epoch + 1
            if cfg.target_accuracy is not None and _reached(pipe, result, cfg.target_accuracy):
                break
    result.seconds = time.perf_counter() - start
    result.samples_per_s = result.epochs * steps * cfg.batch_size / result.seconds
    if cfg.checkpoint:
        pipe.save(cfg.checkpoint)
    return asdict(result) if pipe.is_output else None


def _reached(pipe: Pipeline, result: TrainResult, target: float) -> bool:
    """Whether the last stage's accuracy reached ``target``, agreed by every worker."""
    flag = torch.tensor([1.0 if pipe.is_output and result.accuracy[-1] >= target else 0.0])
    torch.distributed.all_reduce(flag)
    return bool(flag.item())


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg`` on ``cfg.workers`` local workers (or as one worker of a torchrun job)."""
    if cfg.checkpoint:
        Path(cfg.checkpoint).parent.mkdir(parents=True, exist_ok=True)
    results = launch(_worker, cfg, nprocs=cfg.workers)
    last = [r for r in results.values() if r is not None]
    return last[0] if last else {}
