"""A small pipelined training run on real bundled data: scikit-learn's handwritten digits.

This is what ``conveyor train`` runs with no arguments: an MLP cut into stages, trained on local worker
processes with a synchronous pipeline schedule, evaluated on held-out digits every epoch.
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

__all__ = ["TrainConfig", "digits", "even_balance", "mlp", "train"]


@dataclass(frozen=True)
class TrainConfig:
    """What ``conveyor train`` does."""

    stages: int = 2
    schedule: str = "flush"
    microbatches: int = 4
    batch_size: int = 64
    epochs: int = 10
    lr: float = 0.05
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
        optimizer=partial(torch.optim.SGD, lr=cfg.lr, momentum=0.9),
        schedule=cfg.schedule,
    )
    if cfg.resume:
        pipe.load(cfg.resume)
    x_train, y_train, x_test, y_test = digits(cfg.seed)
    steps = len(x_train) // cfg.batch_size  # the last partial batch is dropped
    result = TrainResult()
    start = time.perf_counter()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        disable=not pipe.is_last,
    ) as bar:
        task = bar.add_task("training", total=cfg.epochs * steps, status="")
        for epoch in range(cfg.epochs):
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(cfg.seed + epoch))
            losses = []
            for i in range(steps):
                idx = order[i * cfg.batch_size : (i + 1) * cfg.batch_size]
                losses.append(pipe.train_step(x_train[idx], y_train[idx]))
                bar.update(task, advance=1)
            # The test set's 360 samples split into the pipeline's microbatches.
            n_test = len(x_test) - len(x_test) % cfg.microbatches
            logits = pipe.evaluate(x_test[:n_test])
            if pipe.is_last:
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
    return asdict(result) if pipe.is_last else None


def _reached(pipe: Pipeline, result: TrainResult, target: float) -> bool:
    """Whether the last stage's accuracy reached ``target``, agreed by every worker."""
    flag = torch.tensor([1.0 if pipe.is_last and result.accuracy[-1] >= target else 0.0])
    torch.distributed.all_reduce(flag)
    return bool(flag.item())


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg`` on ``cfg.stages`` local workers (or as one worker of a torchrun job)."""
    if cfg.checkpoint:
        Path(cfg.checkpoint).parent.mkdir(parents=True, exist_ok=True)
    results = launch(_worker, cfg, nprocs=cfg.stages)
    last = [r for r in results.values() if r is not None]
    return last[0] if last else {}
