"""A run's energy knobs: the GPU power limit (``--power-limit``) and a recurring job's batch size
(``--batch-size auto --job NAME``), on top of the energy every run measures."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from conveyor.config import EnergyConfig, TrainConfig
from conveyor.energy import (
    CostMeter,
    JobSettings,
    PowerLimits,
    RecurrenceStore,
    Recurring,
    candidate_sizes,
    open_meter,
    scaled_lr,
)
from conveyor.errors import InputError
from conveyor.job._summary import RunSummary

__all__ = ["EpochKnobs", "KnobsSummary", "finish_recurrence", "guarded_power_limits", "start_recurrence"]


@contextlib.contextmanager
def guarded_power_limits(energy: EnergyConfig) -> Iterator[None]:
    """With ``--power-limit``: the launcher records every GPU's power limit before the workers start and puts
    them back when they end, whatever ends them (a worker killed while blocked in a collective cannot restore
    its own; SIGTERM to the launcher becomes SystemExit so this runs)."""
    if energy.power_limit is None or not torch.cuda.is_available():
        yield
        return
    from zeus.device import get_gpus

    gpus = get_gpus()
    original = {i: gpus.get_power_management_limit(i) for i in range(len(gpus))}

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for i, limit in original.items():
            with contextlib.suppress(Exception):  # restore every GPU whatever one of them says
                if gpus.get_power_management_limit(i) != limit:
                    gpus.set_power_management_limit(i, limit)


def _gpus_max_power(count: int) -> float:
    """The summed largest power limits (W) of the first ``count`` GPUs (Zeus prices time at full power)."""
    from zeus.device import get_gpus

    gpus = get_gpus()
    return float(sum(gpus.get_power_management_limit_constraints(i)[1] / 1000 for i in range(min(count, len(gpus)))))


def max_power_w(energy: EnergyConfig, workers: int) -> float:
    """What a second costs, in watts: ``--max-power``, else the GPUs' maximum power, else 1 where it does not
    matter (``--eta 0``: the cost is the seconds; ``--eta 1``: energy alone)."""
    if energy.max_power is not None:
        return energy.max_power
    if torch.cuda.is_available():
        return _gpus_max_power(workers)
    if energy.eta in (0.0, 1.0):
        return 1.0
    raise InputError(
        f"pricing time with --eta {energy.eta} needs a maximum power and this machine has no GPU: give "
        "--max-power WATTS (e.g. the CPUs' TDP) or --eta 0 (time to accuracy alone)"
    )


def start_recurrence(
    cfg: TrainConfig, train_samples: Callable[[], int], workers: int
) -> tuple[TrainConfig, Recurring | None, float]:
    """With ``--batch-size auto``: begin a recurrence of ``cfg.job``; the config to run it with (its batch size,
    the learning rate scaled to it and the watts that price time), and its early-stopping cost. First,
    ``--power-limit`` without a GPU of its own for each local worker fails here, in one line, before any worker
    starts (workers sharing a GPU would each drive its limit)."""
    from conveyor.runtime import under_torchrun

    if cfg.energy.power_limit is not None and not torch.cuda.is_available():
        raise InputError("--power-limit needs NVIDIA GPUs (CUDA); this run has none: drop --power-limit")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", workers)) if under_torchrun() else workers
    if cfg.energy.power_limit is not None and local > (gpus := torch.cuda.device_count()):
        raise InputError(
            f"--power-limit needs a GPU per worker, but {local} workers share {gpus} GPUs here: use --workers {gpus}"
        )
    if not cfg.energy.tune_batch_size:
        return cfg, None, math.inf
    if under_torchrun():  # every process would begin a recurrence of its own
        raise InputError("--batch-size auto runs on the local launcher, not under torchrun: drop it there")
    if cfg.energy.eta > 0:
        with open_meter(cfg.energy.meter, gpu_index=0 if torch.cuda.is_available() else None) as probe:
            if not probe.available:
                raise InputError(
                    f"--batch-size auto with --eta {cfg.energy.eta} prices energy, but {probe.reason}: use "
                    "--eta 0 (time to accuracy alone) or an --energy-meter that reads"
                )
    assert cfg.energy.job is not None and cfg.run.target_accuracy is not None  # TrainConfig checks both
    watts = max_power_w(cfg.energy, workers)
    # what else changes a recurrence's cost: a job whose recurrences differ in these is another job
    context = json.dumps(
        {
            "model": cfg.model.name,
            "dataset": cfg.model.dataset,
            "width": cfg.model.width,
            "depth": cfg.model.depth,
            "optimizer": cfg.optimizer.name,
            "lr": cfg.optimizer.lr,
            "epochs": cfg.run.epochs,
            "workers": workers,
            "schedule": cfg.layout.schedule,
            "devices": cfg.emulation.devices,
            "max_power": watts,
        }
    )
    settings = JobSettings(
        candidate_sizes(cfg.optimizer.batch_size, train_samples()),
        cfg.optimizer.batch_size,
        cfg.run.target_accuracy,
        cfg.energy.eta,
        cfg.energy.beta,
        context,
    )
    recurring = Recurring(
        RecurrenceStore(Path(cfg.energy.recurrences) if cfg.energy.recurrences else None), cfg.energy.job, settings
    )
    started = recurring.start()
    lr = scaled_lr(cfg.optimizer.lr, started.batch_size, cfg.optimizer.batch_size, cfg.optimizer.name)
    run_cfg = cfg.replaced(batch_size=started.batch_size, lr=lr, max_power=watts)
    return run_cfg, recurring, started.stop_above


def finish_recurrence(recurring: Recurring | None, summary: RunSummary, cfg: TrainConfig) -> RunSummary:
    """Record the recurrence's outcome (reached the target or not); the run's summary with it."""
    if recurring is None:
        return summary
    assert recurring.started is not None and summary.cost is not None  # every worker's knobs priced the run
    reached = max(summary.accuracy, default=0.0) >= (cfg.run.target_accuracy or math.inf)
    recurring.end(summary.cost, summary.energy_j, summary.seconds, reached, summary.epochs)
    started = recurring.started
    recurrence = {
        "job": cfg.energy.job,
        "number": started.number + 1,
        "phase": started.phase,
        "batch_size": cfg.optimizer.batch_size,
        "lr": cfg.optimizer.lr,
        "reached": reached,
        "stop_above": started.stop_above,
        "store": str(recurring.store.path),
    }
    return dataclasses.replace(summary, recurrence=recurrence)


def profiling_window(steps_per_epoch: int) -> tuple[int, int]:
    """Warm-up and measured steps per power limit for ``--power-limit auto``: Zeus' 10 and 40 where an epoch holds
    them, else as many as fit one epoch (a window an epoch's end cuts is thrown away and begun again in the next
    epoch, so a window longer than an epoch never completes; the epoch's first step readies the next limit).

    Example:
        >>> profiling_window(500), profiling_window(23), profiling_window(2)
        ((10, 40), (4, 18), (1, 1))
    """
    room = steps_per_epoch - 1
    if room >= 50:
        return 10, 40
    warmup = max(1, room // 5)
    return warmup, max(1, room - warmup)


class EpochKnobs:
    """One worker's knobs during training: its GPU's power limit (stepped per update, told of epochs' ends)
    and the recurrence's running cost (the run stops once another epoch would pass ``stop_above``).
    ``steps_per_epoch``: this worker's updates in an epoch (the power limit's profiling windows fit in one)."""

    def __init__(
        self, energy: EnergyConfig, gpu_index: int | None, equal_steps: bool, steps_per_epoch: int, stop_above: float
    ) -> None:
        self.power: PowerLimits | None = None
        if energy.power_limit is not None:
            if gpu_index is None:
                raise RuntimeError("--power-limit needs NVIDIA GPUs (CUDA); this run has none: drop --power-limit")
            if energy.power_limit.lower() == "auto" and not equal_steps:
                raise InputError(
                    "--power-limit auto profiles every worker's steps together, so each must run as "
                    "many steps per epoch: use equal replicas per stage, or a fixed limit"
                )
            warmup, profile = profiling_window(steps_per_epoch)
            self.power = PowerLimits(
                energy.power_limit,
                eta=energy.eta,
                gpu_index=gpu_index,
                warmup_steps=warmup,
                profile_steps=profile,
            )
        tuning = energy.tune_batch_size
        self.cost = CostMeter(energy.eta, energy.max_power or 1.0, stop_above) if tuning else None

    def step(self) -> None:
        if self.power is not None:
            self.power.step_begin()

    def epoch_end(self, energy_j: float | None, seconds: float) -> bool:
        """Account an epoch (every worker passes the same figures); whether the recurrence must stop here."""
        if self.power is not None:
            self.power.epoch_end()
        if self.cost is None:
            return False
        self.cost.add_epoch(energy_j, seconds)
        return self.cost.over

    def __enter__(self) -> EpochKnobs:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.power is not None:
            self.power.close()  # the GPU's own limit back, also on failure

    def summary(self) -> KnobsSummary:
        """What the run's summary gets: the recurrence's cost, the power limit chosen and its profile."""
        cost = None if self.cost is None else self.cost.cost
        if self.power is None:
            return KnobsSummary(cost=cost)
        note = None
        if self.power.chosen is None:
            note = (
                f"--power-limit auto measured {len(self.power.profile)} of {self.power.candidates} limits before "
                "the run ended, so the GPU ran at its largest limit: run more epochs (each limit takes a window "
                "of an epoch's steps), or give a limit in watts"
            )
        profile = [dataclasses.asdict(p) for p in self.power.profile]
        return KnobsSummary(cost=cost, power_limit_w=self.power.chosen, power_profile=profile, power_limit_note=note)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KnobsSummary:
    """The knobs' part of a run's summary (``None`` where their options were not given)."""

    cost: float | None = None  # --batch-size auto: the recurrence's cost
    power_limit_w: float | None = None  # --power-limit: the limit chosen
    power_profile: list[dict[str, Any]] | None = None  # --power-limit auto: each limit's measured cost
    power_limit_note: str | None = None  # --power-limit auto: why no limit was chosen
