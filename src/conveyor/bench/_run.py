"""The training runs the benchmarks make."""

from __future__ import annotations

from conveyor.config import TrainConfig
from conveyor.job import RunSummary, train

__all__ = ["run_job"]


def run_job(cfg: TrainConfig) -> RunSummary:
    """:func:`conveyor.job.train` on this machine's local workers, where the summary always comes back."""
    summary = train(cfg)
    if summary is None:  # only a torchrun worker without the output gets none, and benchmarks launch their own
        raise RuntimeError("a benchmark's run came back without a summary: run benchmarks without torchrun")
    return summary
