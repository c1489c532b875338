"""What ``conveyor train`` does: :class:`TrainConfig`, each field a command-line option, checked when it is made
(one line for every bad value, before any worker starts); the loss and optimizer it names; the device,
backend and worker count it resolves to on this machine."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from conveyor.energy import check_meter_spec, check_power_limit_spec
from conveyor.errors import InputError
from conveyor.plan import read_plan_file
from conveyor.runtime import (
    BACKENDS,
    DEVICES,
    Blocks,
    OptimizerFactory,
    as_blocks,
    block_shapes,
    check_checkpoint,
    check_workers,
    default_workers,
    load_checkpoint,
    resolve_backend,
    resolve_device,
    under_torchrun,
)
from conveyor.schedule import parse_replicas
from conveyor.stragglers import mode_settings

__all__ = [
    "AUTOCAST",
    "OPTIMIZERS",
    "RunState",
    "TrainConfig",
    "check_against_data",
    "explicit_workers",
    "job_devices",
    "loss_and_optimizer",
]

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}
AUTOCAST = {"off": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class TrainConfig:
    """What ``conveyor train`` does; every field is a command-line option of the same name.

    ``schedule="auto"`` lets the planner pick the schedule and layout for ``workers``; ``stages`` and
    ``replicas`` (or ``plan``, a plan file) fix the layout instead.
    """

    model: str = "mlp"
    dataset: str | None = None  # default: the model's own (digits for mlp, text for gpt)
    width: int | None = None
    depth: int | None = None
    workers: int | None = None  # default 4 when planning, else what the layout needs
    schedule: str = "auto"
    stages: int | None = None
    replicas: str | None = None
    plan: str | None = None
    microbatches: int | None = None  # default: 1 for one worker, else 4 (a pipeline's)
    batch_size: int = 64
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    stale_correction: bool = True  # weight prediction and PipeDream's per-sample rate (asynchronous schedules)
    epoch_factors: str | None = None  # a conveyor bench convergence report to rank schedules by (default: shipped)
    epochs: int = 10
    target_accuracy: float | None = None
    run_dir: str | None = None  # default runs/MODEL-TIME
    checkpoint: str | None = None  # default RUN_DIR/checkpoint.pt
    checkpoint_every: int | None = None  # also save the checkpoint every N epochs (default: at the end only)
    resume: str | None = None  # a checkpoint to start from; --epochs then counts the epochs still to run
    lease: str | None = None  # a JSON file {"until": UNIX_SECONDS}: stop (and save) before running past it
    seed: int = 0
    device: str = "auto"  # cuda (one worker per GPU), cpu, or auto: cuda where there is a GPU
    backend: str = "auto"  # nccl on CUDA, gloo on the CPU; gloo with CUDA: workers share the GPUs (for tests)
    autocast: str = "off"  # bf16: forwards and the loss under torch.autocast to bfloat16 (weights stay float32)
    torch_profile: str | None = None  # a folder: the second epoch's training under torch.profiler, per worker
    loader_workers: int = 0  # DataLoader processes per reading worker (0: the dataset sits on the device)
    network: str | None = None  # an emulated network's topology (conveyor.emulate)
    devices: str | None = None  # emulated devices: CPU cores per worker
    faults: str | None = None  # faults to apply on the emulated cluster
    stragglers: str = "off"  # flexrr, slack, reassign or off, where only the first stage is replicated
    slack: int = 1  # steps a replica may run ahead of the slowest (--stragglers flexrr or slack)
    chunks: int = 2  # chunks each replica owns per batch: the reassignment granularity (bench stragglers)
    reliable: int | None = None  # elastic training: the first K workers are reliable, the rest transient
    join: str | None = None  # HOST:PORT of an elastic job to join (conveyor.job.join_elastic)
    lost_s: float = 2.0  # elastic: a worker whose heartbeat is still this long is lost
    backup_every: int = 4  # elastic: steps between an owner's backups to the reliable tier
    sync_max: float = 2.0  # elastic: transient:reliable ratio up to which the reliable tier owns the state
    backup_only_min: float = 3.0  # elastic: the ratio from which reliable workers only keep backups
    elastic_layout: str = "data"  # elastic: data parallelism, or a pipeline the planner re-plans per generation
    energy_meter: str = "auto"  # auto (Zeus: NVML, RAPL), off, or replay:PATH (a Zeus CSV log; {rank}: one per worker)
    power_limit: str | None = None  # CUDA: auto (profiled in the first epoch, Zeus), max, or watts
    eta: float = 0.5  # cost = eta * energy + (1 - eta) * max_power * time, for --power-limit and --batch-size auto
    tune_batch_size: bool = False  # --batch-size auto: a recurrence of --job, batch size from its history
    job: str | None = None  # the recurring job's name in the store
    recurrences: str | None = None  # the recurrences' SQLite file (default: the user's data directory)
    beta: float = 2.0  # --batch-size auto: stop a recurrence whose cost passes beta x the least so far
    max_power: float | None = None  # watts that price a second (default: the GPUs' largest power limits)
    warm_start: str | None = None  # auto (the model store's best parent) or a checkpoint (ModelKeeper)
    store: str | None = None  # the model store's folder (default: the user's data directory)
    register: bool = False  # put the final model into the model store

    def __post_init__(self) -> None:
        if min(self.batch_size, self.microbatches or 1) < 1:
            raise InputError("--batch-size and --microbatches must be at least 1")
        if self.device not in DEVICES or self.backend not in BACKENDS or self.autocast not in AUTOCAST:
            raise InputError(
                f"--device is one of {', '.join(DEVICES)}, --backend one of {', '.join(BACKENDS)} and "
                f"--autocast one of {', '.join(AUTOCAST)}; got {self.device}, {self.backend}, "
                f"{self.autocast}"
            )
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise InputError(f"--target-accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.loader_workers < 0:
            raise InputError(f"--loader-workers must be 0 or more, got {self.loader_workers}")
        if not self.lr > 0 or not 0 <= self.momentum < 1:  # "not >" also refuses NaN
            raise InputError(f"--lr must be above 0 and --momentum in [0, 1); got {self.lr} and {self.momentum}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise InputError(f"--checkpoint-every must be at least 1 epoch, got {self.checkpoint_every}")
        if self.epochs < 1:
            raise InputError(f"--epochs must be at least 1, got {self.epochs}")
        if self.optimizer not in OPTIMIZERS:
            raise InputError(f"unknown optimizer {self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
        if self.plan and (self.stages or self.replicas):
            raise InputError("give either --plan or --stages/--replicas, not both")
        if self.chunks < 1:
            raise InputError(f"--chunks must be at least 1, got {self.chunks}")
        mode_settings(self.stragglers, self.slack)
        if self.reliable is not None and (self.stragglers != "off" or self.stages or self.replicas or self.plan):
            raise InputError(
                "--reliable plans its own layouts (--elastic-layout): drop --stragglers, --stages, --replicas, --plan"
            )
        if self.elastic_layout not in ("data", "pipeline"):
            raise InputError(f"--elastic-layout {self.elastic_layout!r}: use data or pipeline")
        if self.checkpoint_every is not None and (self.reliable is not None or self.join):
            raise InputError("--checkpoint-every saves a run of fixed workers; elastic jobs keep their own backups")
        if self.lease and (self.reliable is not None or self.join):
            raise InputError("--lease bounds a conveyor train run of fixed workers: drop --reliable and --join")
        if self.lost_s <= 0 or self.backup_every < 1:
            raise InputError("--lost-s must be > 0 and --backup-every at least 1")
        check_meter_spec(self.energy_meter)
        check_energy_options(self)
        if (self.warm_start or self.register) and (self.reliable is not None or self.join):
            raise InputError("--warm-start and --register apply to fixed workers: drop --reliable and --join")
        if self.warm_start and self.resume:
            raise InputError(
                "--warm-start starts a new model from a parent's weights; --resume continues one: pick one"
            )


@dataclass(frozen=True, kw_only=True)
class RunState:
    """What :func:`~conveyor.job.train` decides before the workers start and hands each beside the config: the
    outcome of a recurrence's and a warm start's preparation, not options."""

    stop_above: float = math.inf  # a recurrence's cost at which it stops early (--batch-size auto)
    warm_start_plan: str | None = None  # warm_start.json: the parent and layer pairs every worker applies


def loss_and_optimizer(cfg: TrainConfig, sequence: bool) -> tuple[Callable[[Any, Any], Any], OptimizerFactory]:
    """The loss (cross-entropy; per position for a sequence's logits (B, T, V)) and the optimizer ``cfg`` asks for."""
    opt_args = {"lr": cfg.lr, "momentum": cfg.momentum} if cfg.optimizer == "sgd" else {"lr": cfg.lr}
    make_optimizer = partial(OPTIMIZERS[cfg.optimizer], **opt_args)
    if sequence:
        return (lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())), make_optimizer
    return F.cross_entropy, make_optimizer


def job_devices(cfg: TrainConfig) -> tuple[str, str, int]:
    """The job's device type, backend and local workers (``--workers``, else what a fixed layout needs, else one
    per GPU on CUDA and 4 on the CPU).

    Raises:
        ValueError: a device or backend this machine lacks, or more workers than GPUs under NCCL (one line each).
    """
    device = resolve_device(cfg.device)
    backend = resolve_backend(cfg.backend, device)
    nprocs = cfg.workers or explicit_workers(cfg) or default_workers(device)
    check_workers(int(os.environ.get("LOCAL_WORLD_SIZE", nprocs)) if under_torchrun() else nprocs, device, backend)
    return device, backend, nprocs


def explicit_workers(cfg: TrainConfig) -> int | None:
    """Workers a fixed layout needs (None when the planner decides)."""
    if cfg.plan:
        return read_plan_file(cfg.plan).workers
    if cfg.replicas:
        return sum(parse_replicas(cfg.replicas, cfg.stages))
    return cfg.stages


def check_against_data(cfg: TrainConfig, model: Blocks, samples: int) -> None:
    """The rules that need the model and the training set's size (``samples``); one line each, before any worker
    starts (a checkpoint of another model would otherwise fail in every worker after the start-up measurements).

    Raises:
        ValueError: a batch larger than the training set, more microbatches than samples in a batch, or a
            ``--resume`` checkpoint missing, unreadable or of another model.
    """
    if cfg.batch_size > samples and not cfg.tune_batch_size:  # auto=B0 may start above: the tuner shrinks it
        raise InputError(
            f"--batch-size {cfg.batch_size} is more than the {samples} training samples: use at most {samples}"
        )
    if (cfg.microbatches or 1) > cfg.batch_size:
        batch = cfg.batch_size
        raise InputError(
            f"--microbatches {cfg.microbatches} is more than the {batch} samples of a batch: use at most {batch}"
        )
    if cfg.resume:
        check_checkpoint(load_checkpoint(cfg.resume)["model"], block_shapes(as_blocks(model)), cfg.resume)


def check_energy_options(cfg: TrainConfig) -> None:
    """One-line errors for energy options that do not go together (no GPU is touched)."""
    if not 0.0 <= cfg.eta <= 1.0:
        raise InputError(f"--eta weighs energy against time and must be in [0, 1], got {cfg.eta}")
    if cfg.beta <= 1.0 or (cfg.max_power is not None and cfg.max_power <= 0):
        raise InputError("--beta must be greater than 1 and --max-power above 0")
    if cfg.power_limit is not None:
        check_power_limit_spec(cfg.power_limit)
    if cfg.tune_batch_size and (cfg.job is None or cfg.target_accuracy is None):
        raise InputError(
            "--batch-size auto learns across recurrences of a job to a target: give --job NAME and --target-accuracy"
        )
    if cfg.job is not None and not cfg.tune_batch_size:
        raise InputError("--job names a recurring job whose batch size is tuned: add --batch-size auto")
    if (cfg.tune_batch_size or cfg.power_limit) and (cfg.reliable is not None or cfg.join):
        raise InputError("--batch-size auto and --power-limit apply to fixed workers: drop --reliable and --join")
    if cfg.tune_batch_size and (cfg.lease or cfg.resume):
        raise InputError("a recurrence of --batch-size auto runs whole, from scratch: drop --lease and --resume")
