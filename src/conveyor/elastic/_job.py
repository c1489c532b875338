"""What an elastic job is given: its tolerances (:class:`ElasticOptions`) and its data and schedule
(:class:`ElasticJob`); and what each of its workers returns (:class:`WorkerOutcome`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.elastic._tiers import BACKUP_ONLY_MIN, SYNC_MAX

__all__ = ["ElasticJob", "ElasticOptions", "WorkerOutcome"]


@dataclass(frozen=True)
class ElasticOptions:
    """How an elastic job tolerates revocations; each is a ``conveyor train`` option of the same name."""

    reliable: int = 1  # the first K workers are reliable; worker 0 hosts the store and coordinates
    lost_s: float = 10.0  # a worker whose heartbeat is still this long is lost (one that dies is known at once)
    beat_s: float = 0.2  # heartbeat period
    backup_every: int = 4  # steps between an owner's backups to the reliable tier (stages 2 and 3)
    sync_max: float = SYNC_MAX  # transient:reliable ratio up to which the reliable tier owns the state
    backup_only_min: float = BACKUP_ONLY_MIN  # ratio from which the reliable tier only keeps backups
    timeout_s: float = 120.0  # a collective's own limit (a lost peer is noticed through heartbeats sooner)


@dataclass(frozen=True)
class ElasticJob:
    """The data and the schedule of an elastic run."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor | None = None
    test_y: torch.Tensor | None = None
    batch_size: int = 64
    epochs: int = 1
    seed: int = 0
    target_accuracy: float | None = None
    # Asked by the evaluating worker after each epoch, with the run's mean epoch seconds so far: whether to stop
    # there (``conveyor train --lease``: whether one more epoch would end past the lease).
    stop_after: Callable[[float], bool] | None = None


@dataclass(frozen=True)
class WorkerOutcome:
    """What :meth:`~conveyor.elastic.ElasticTrainer.fit` returns on one worker."""

    worker: int
    steps: int = 0  # the steps the job completed, as this worker saw them end (0: it left)
    losses: list[float] = field(default_factory=list)  # its batch losses over its last epoch's steps
    events: list[dict[str, Any]] = field(default_factory=list)  # the lines it wrote to elastic.jsonl
    weights: torch.Tensor | None = None  # the final flat weights, on a worker computing at the end
    left_at: int | None = None  # the last step it completed before it was revoked (None: it stayed)
