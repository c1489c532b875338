"""The sections of :class:`~conveyor.job.TrainConfig`: keyword-only frozen dataclasses, each holding a group of
``conveyor train``'s options and checking its own fields when it is made (one line for every bad value)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.emulate import Emulation
from conveyor.energy import check_meter_spec, check_power_limit_spec
from conveyor.errors import InputError
from conveyor.job._resources import check_resources_every
from conveyor.job._zoo import model_arguments
from conveyor.runtime import BACKENDS, DEVICES
from conveyor.stragglers import Chunks, check_chunks, mode_settings

__all__ = [
    "AUTOCAST",
    "OPTIMIZERS",
    "ElasticConfig",
    "EmulationConfig",
    "EnergyConfig",
    "LayoutConfig",
    "ModelConfig",
    "ModelStoreConfig",
    "OptimizerConfig",
    "RunConfig",
    "StragglersConfig",
]

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}
AUTOCAST = {"off": None, "bf16": torch.bfloat16}


MATERIALIZE = ("whole", "stage")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What is trained on what: ``--model``, ``--model-args``, ``--dataset``, ``--width``, ``--depth``; and
    ``--materialize``: ``whole`` builds the whole model in every worker, ``stage`` builds it on the meta device
    and makes real only each worker's stage, initialised per module (:func:`conveyor.runtime.initialise_from`)."""

    name: str = "mlp"  # --model
    args: str = ""  # --model-args: NAME=VALUE,... for a module:callable
    dataset: str | None = None  # default: the model's own (digits for mlp, text for gpt)
    width: int | None = None
    depth: int | None = None
    materialize: str = "whole"

    def __post_init__(self) -> None:
        if self.materialize not in MATERIALIZE:
            raise InputError(f"--materialize {self.materialize!r}: use one of {', '.join(MATERIALIZE)}")
        if self.args and ":" not in self.name:
            raise InputError(f"--model-args goes with a module:callable model, not {self.name}: use --width, --depth")
        model_arguments(self.args)  # a malformed one fails here


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    """Where the model runs: ``schedule="auto"`` lets the planner pick the schedule and layout for ``workers``;
    ``stages`` and ``replicas`` (or ``plan``, a plan file) fix the layout instead."""

    workers: int | None = None  # default 4 when planning, else what the layout needs
    schedule: str = "auto"
    stages: int | None = None
    replicas: str | None = None
    plan: str | None = None
    microbatches: int | None = None  # default: 1 for one worker, else 4 (a pipeline's)

    def __post_init__(self) -> None:
        if (self.microbatches or 1) < 1:
            raise InputError("--batch-size and --microbatches must be at least 1")
        if self.plan and (self.stages or self.replicas):
            raise InputError("give either --plan or --stages/--replicas, not both")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """How the weights move: the optimizer, its rate, the batch, and the correction for stale gradients."""

    name: str = "sgd"  # --optimizer
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 64
    stale_correction: bool = True  # weight prediction and PipeDream's per-sample rate (asynchronous schedules)
    epoch_factors: str | None = None  # a conveyor bench convergence report to rank schedules by (default: shipped)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise InputError("--batch-size and --microbatches must be at least 1")
        if not self.lr > 0 or not 0 <= self.momentum < 1:  # "not >" also refuses NaN
            raise InputError(f"--lr must be above 0 and --momentum in [0, 1); got {self.lr} and {self.momentum}")
        if self.name not in OPTIMIZERS:
            raise InputError(f"unknown optimizer {self.name!r}: use one of {', '.join(OPTIMIZERS)}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How long, where it is written, what it starts from, and on which devices."""

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
    resources_every: float | None = None  # seconds between samples of each worker's holdings (resources.jsonl)

    def __post_init__(self) -> None:
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
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise InputError(f"--checkpoint-every must be at least 1 epoch, got {self.checkpoint_every}")
        if self.epochs < 1:
            raise InputError(f"--epochs must be at least 1, got {self.epochs}")
        check_resources_every(self.resources_every)


@dataclass(frozen=True, kw_only=True)
class EmulationConfig:
    """An emulated cluster around the workers (:mod:`conveyor.emulate`)."""

    network: str | None = None  # an emulated network's topology
    devices: str | None = None  # emulated devices: CPU cores per worker
    faults: str | None = None  # faults to apply on the emulated cluster
    cpu_slice: float = Emulation.cpu_slice  # seconds a device's quota lets it run before each stop

    def emulation(self) -> Emulation:
        """The emulated cluster this section describes."""
        return Emulation(self.network, self.devices, self.faults, self.cpu_slice)


@dataclass(frozen=True, kw_only=True)
class EnergyConfig:
    """Zeus' knobs: the meter, the GPUs' power limit, and a recurring job's batch size (cost = eta * energy +
    (1 - eta) * max_power * time)."""

    meter: str = "auto"  # --energy-meter: auto (Zeus: NVML, RAPL), off, or replay:PATH ({rank}: one per worker)
    power_limit: str | None = None  # CUDA: auto (profiled in the first epoch, Zeus), max, or watts
    eta: float = 0.5  # for --power-limit and --batch-size auto
    tune_batch_size: bool = False  # --batch-size auto: a recurrence of --job, batch size from its history
    job: str | None = None  # the recurring job's name in the store
    recurrences: str | None = None  # the recurrences' SQLite file (default: the user's data directory)
    beta: float = 2.0  # --batch-size auto: stop a recurrence whose cost passes beta x the least so far
    max_power: float | None = None  # watts that price a second (default: the GPUs' largest power limits)

    def __post_init__(self) -> None:
        check_meter_spec(self.meter)
        if not 0.0 <= self.eta <= 1.0:
            raise InputError(f"--eta weighs energy against time and must be in [0, 1], got {self.eta}")
        if self.beta <= 1.0 or (self.max_power is not None and self.max_power <= 0):
            raise InputError("--beta must be greater than 1 and --max-power above 0")
        if self.power_limit is not None:
            check_power_limit_spec(self.power_limit)
        if self.job is not None and not self.tune_batch_size:
            raise InputError("--job names a recurring job whose batch size is tuned: add --batch-size auto")


@dataclass(frozen=True, kw_only=True)
class StragglersConfig:
    """Work reassignment among a replicated first stage's replicas (:mod:`conveyor.stragglers`)."""

    mode: str = "flexrr"  # --stragglers: live, flexrr, slack, reassign or backup
    slack: int = 1  # steps a replica may run ahead of the slowest (flexrr or slack; the others are synchronous)
    chunks: Chunks = 2  # chunks each replica owns per batch (the reassignment granularity), or "auto"
    equal_shares: bool = False  # every replica owns as many chunks (else: in proportion to measured speeds)

    def __post_init__(self) -> None:
        check_chunks(self.chunks)
        mode_settings(self.mode, self.slack)


WAN_MODES = ("off", "gaia", "diloco")  # conveyor.gaia.WAN_MODES, written out: the parser must not import torch


@dataclass(frozen=True, kw_only=True)
class WanConfig:
    """Data centres joined by the emulated network's outer level, a WAN (:mod:`conveyor.gaia`): synchronous inside
    each, ``mode`` across them."""

    mode: str = "off"  # --wan: gaia, diloco, or off (one all-reduce over every replica, across the WAN)
    threshold: float = 0.05  # --wan-threshold: gaia's significance, a relative change of a weight
    staleness: int = 1  # --wan-staleness: the mirror clock's bound; 1 reads each exchange at once
    local_steps: int = 16  # diloco's updates between outer steps
    outer_lr: float = 0.7  # diloco's outer Nesterov rate

    def __post_init__(self) -> None:
        if self.mode not in WAN_MODES:
            raise InputError(f"--wan {self.mode!r}: use one of {', '.join(WAN_MODES)}")
        if not 0 < self.threshold < 1:
            raise InputError(f"--wan-threshold is a relative change in (0, 1), got {self.threshold}")
        if self.staleness < 1:
            raise InputError(f"--wan-staleness is at least 1 update, got {self.staleness}")
        if self.local_steps < 1 or not self.outer_lr > 0:
            raise InputError(
                f"--local-steps must be at least 1 and --outer-lr above 0, got {self.local_steps} and {self.outer_lr}"
            )


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """Elastic training on revocable workers (:mod:`conveyor.elastic`): a job whose first ``reliable`` workers
    are reliable, or ``join``, the address of one to join."""

    reliable: int | None = None  # the first K workers are reliable, the rest transient
    join: str | None = None  # HOST:PORT of an elastic job to join (conveyor.job.join_elastic)
    lost_s: float = 10.0  # a worker whose heartbeat is still this long is lost (one that dies is known at once)
    backup_every: int = 4  # steps between an owner's backups to the reliable tier
    sync_max: float = 2.0  # transient:reliable ratio up to which the reliable tier owns the state
    backup_only_min: float = 3.0  # the ratio from which reliable workers only keep backups
    layout: str = "data"  # --elastic-layout: data parallelism, or a pipeline re-planned per generation

    def __post_init__(self) -> None:
        if (self.reliable is None) == (self.join is None):
            raise InputError("an elastic job has --reliable K (to start one) or --join HOST:PORT, one of them")
        if self.layout not in ("data", "pipeline"):
            raise InputError(f"--elastic-layout {self.layout!r}: use data or pipeline")
        if self.lost_s <= 0 or self.backup_every < 1:
            raise InputError("--lost-s must be > 0 and --backup-every at least 1")


@dataclass(frozen=True, kw_only=True)
class ModelStoreConfig:
    """Warm starts from trained models and the store they come from (ModelKeeper)."""

    warm_start: str | None = None  # auto (the model store's best parent) or a checkpoint
    folder: str | None = None  # --store: the model store's folder (default: the user's data directory)
    register: bool = False  # put the final model into the model store
