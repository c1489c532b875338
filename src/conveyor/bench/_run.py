"""The training runs the benchmarks make."""

from __future__ import annotations

import itertools
from pathlib import Path

from conveyor.config import TrainConfig
from conveyor.job import RunSummary, read_jsonl, train

__all__ = ["run_job", "run_rate", "steady_rate"]


def run_job(cfg: TrainConfig) -> RunSummary:
    """:func:`conveyor.job.train` on this machine's local workers, where the summary always comes back."""
    summary = train(cfg)
    if summary is None:  # only a torchrun worker without the output gets none, and benchmarks launch their own
        raise RuntimeError("a benchmark's run came back without a summary: run benchmarks without torchrun")
    return summary


def steady_rate(epoch_seconds: list[float], samples: int) -> float:
    """Samples per second over the epochs after the first (the first warms up: allocator, kernels, threads)."""
    return samples * (len(epoch_seconds) - 1) / sum(epoch_seconds[1:])


def run_rate(folder: Path) -> float:
    """A run's steady training samples/s, from its ``metrics.jsonl`` (whose seconds and samples are cumulative)."""
    epochs = read_jsonl(folder / "metrics.jsonl")
    totals = [0.0] + [e["train_seconds"] for e in epochs]
    return steady_rate([b - a for a, b in itertools.pairwise(totals)], epochs[0]["samples"])
