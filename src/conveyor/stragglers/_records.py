"""What each worker of a flexible pipeline did in each step: the run folder's ``stragglers.jsonl``."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepRecord"]


@dataclass
class StepRecord:
    """What one worker did in one step (a line of the run folder's ``stragglers.jsonl``)."""

    step: int  # batches trained on before this one, over all runs
    stage: int
    replica: int  # within its stage
    samples: int  # samples this worker ran
    chunks: int  # chunks it ran
    taken: int  # of its samples, those taken from a peer's share
    compute_s: float  # forward and backward time (with a later stage's, what it waited for in between)
    wait_s: float  # time blocked on the all-reduce the update needed (slack 0: this step's)
    backups: int = 0  # of its samples, those of chunks it ran as a backup of a stalled peer's (and won)
    dropped: int = 0  # samples it ran (or began) whose result a peer's run replaced
    owned: int = 0  # the first stage: samples its share held (weighted shares give a slow replica fewer)
    wall: float = 0.0  # when it began, seconds since the Unix epoch (faults.jsonl's clock)
    run: int = 0  # the trainer's train() call it was in (1, 2, ...: the job's epochs in this process)
    cut: list[int] = field(default_factory=list)  # the first stage: the batch's chunk sizes, replica by replica
