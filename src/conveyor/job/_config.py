"""What ``conveyor train`` does: :class:`TrainConfig`, its sections (:mod:`conveyor.job._sections`) and the rules
between them, checked when it is made (one line for every bad value, before any worker starts); the map from
command-line options to sections; the loss and optimizer it names; the device, backend and worker count it
resolves to on this machine."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import torch.nn.functional as F

from conveyor.errors import InputError
from conveyor.job._sections import (
    OPTIMIZERS,
    ElasticConfig,
    EmulationConfig,
    EnergyConfig,
    LayoutConfig,
    ModelConfig,
    ModelStoreConfig,
    OptimizerConfig,
    RunConfig,
    StragglersConfig,
    WanConfig,
)
from conveyor.plan import Topology, read_plan_file
from conveyor.runtime import (
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

__all__ = [
    "OPTION_FIELDS",
    "RunState",
    "TrainConfig",
    "check_against_data",
    "explicit_workers",
    "job_devices",
    "loss_and_optimizer",
]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What ``conveyor train`` does, in sections; each component takes its own. ``None`` for ``stragglers`` and
    ``elastic``: a run without them. :meth:`from_options` makes one from ``conveyor train``'s options by name.

    Example:
        >>> cfg = TrainConfig.from_options(model="mlp", epochs=3, stages=2)
        >>> cfg == TrainConfig(model=ModelConfig(name="mlp"), run=RunConfig(epochs=3), layout=LayoutConfig(stages=2))
        True
        >>> cfg.options()["epochs"], cfg.stragglers is None
        (3, True)
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    energy: EnergyConfig = field(default_factory=EnergyConfig)
    stragglers: StragglersConfig | None = None
    elastic: ElasticConfig | None = None
    store: ModelStoreConfig = field(default_factory=ModelStoreConfig)
    wan: WanConfig = field(default_factory=WanConfig)

    def __post_init__(self) -> None:
        check_sections(self)

    @classmethod
    def from_options(cls, **options: Any) -> TrainConfig:
        """The config of ``conveyor train``'s options (their names with ``_`` for ``-``; ``stragglers="off"`` and
        no ``reliable`` nor ``join``: those sections are ``None``).

        Raises:
            InputError: a name that is no option, or a bad value (one line).
        """
        unknown = sorted(set(options) - set(OPTION_FIELDS))
        if unknown:
            raise InputError(f"conveyor train has no option {', '.join(unknown)}")
        values: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for option, value in options.items():
            section, name = OPTION_FIELDS[option]
            values[section][name] = value
        stragglers = values["stragglers"]
        elastic = values["elastic"]
        made = {
            section: kind(**values[section])
            for section, kind in SECTIONS.items()
            if section not in ("stragglers", "elastic")
        }
        return cls(
            **made,
            stragglers=None if stragglers.get("mode", "off") == "off" else StragglersConfig(**stragglers),
            elastic=ElasticConfig(**elastic) if elastic.get("reliable") is not None or elastic.get("join") else None,
        )

    def replaced(self, **options: Any) -> TrainConfig:
        """This config with some options changed, by their ``conveyor train`` names."""
        return TrainConfig.from_options(**{**self.options(), **options})

    def options(self) -> dict[str, Any]:
        """Every ``conveyor train`` option's value: the inverse of :meth:`from_options` (JSON-ready)."""
        out: dict[str, Any] = {}
        for option, (section, name) in OPTION_FIELDS.items():
            part = getattr(self, section)
            out[option] = getattr(part, name) if part is not None else _DEFAULTS[option]
        if self.stragglers is None:  # the field's default is a mode; off is the option's
            out["stragglers"] = "off"
        return out


SECTIONS: dict[str, type[Any]] = {
    "model": ModelConfig,
    "layout": LayoutConfig,
    "optimizer": OptimizerConfig,
    "run": RunConfig,
    "emulation": EmulationConfig,
    "energy": EnergyConfig,
    "stragglers": StragglersConfig,
    "elastic": ElasticConfig,
    "store": ModelStoreConfig,
    "wan": WanConfig,
}
_RENAMED = {
    ("model", "name"): "model",
    ("model", "args"): "model_args",
    ("optimizer", "name"): "optimizer",
    ("energy", "meter"): "energy_meter",
    ("stragglers", "mode"): "stragglers",
    ("elastic", "layout"): "elastic_layout",
    ("store", "folder"): "store",
    ("wan", "mode"): "wan",
    ("wan", "threshold"): "wan_threshold",
    ("wan", "staleness"): "wan_staleness",
}
OPTION_FIELDS: dict[str, tuple[str, str]] = {
    _RENAMED.get((section, f.name), f.name): (section, f.name)
    for section, kind in SECTIONS.items()
    for f in fields(kind)
}
"""``conveyor train``'s option (``_`` for ``-``) -> the section and field that hold it."""
_DEFAULTS: dict[str, Any] = {
    option: next(f.default for f in fields(SECTIONS[section]) if f.name == name)
    for option, (section, name) in OPTION_FIELDS.items()
}  # every option's default, which an absent (None) section's options read as


def check_sections(cfg: TrainConfig) -> None:
    """The rules between sections (each section checks its own fields); one line each."""
    elastic, run = cfg.elastic, cfg.run
    layout = cfg.layout
    if elastic is not None:
        if elastic.reliable is not None and (cfg.stragglers or layout.stages or layout.replicas or layout.plan):
            raise InputError(
                "--reliable plans its own layouts (--elastic-layout): drop --stragglers, --stages, --replicas, --plan"
            )
        if run.checkpoint_every is not None:
            raise InputError("--checkpoint-every saves a run of fixed workers; elastic jobs keep their own backups")
        if run.lease and elastic.join:
            raise InputError("--lease bounds the job its worker 0 starts: drop --join (the job's own lease holds)")
        if cfg.energy.tune_batch_size or cfg.energy.power_limit:
            raise InputError("--batch-size auto and --power-limit apply to fixed workers: drop --reliable and --join")
        if cfg.store.warm_start or cfg.store.register:
            raise InputError("--warm-start and --register apply to fixed workers: drop --reliable and --join")
    if cfg.model.materialize == "stage" and (
        elastic or cfg.stragglers or cfg.store.warm_start or cfg.energy.tune_batch_size
    ):
        raise InputError(
            "--materialize stage builds each worker's stage alone, for a fixed pipeline: drop --reliable, --join, "
            "--stragglers, --warm-start and --batch-size auto"
        )
    if cfg.wan.mode != "off":
        check_wan(cfg)
    if cfg.store.warm_start and run.resume:
        raise InputError("--warm-start starts a new model from a parent's weights; --resume continues one: pick one")
    if cfg.energy.tune_batch_size and (cfg.energy.job is None or run.target_accuracy is None):
        raise InputError(
            "--batch-size auto learns across recurrences of a job to a target: give --job NAME and --target-accuracy"
        )
    if cfg.energy.tune_batch_size and (run.lease or run.resume):
        raise InputError("a recurrence of --batch-size auto runs whole, from scratch: drop --lease and --resume")


def check_wan(cfg: TrainConfig) -> None:
    """``--wan``'s rules: a topology of two data centres or more, sites that step together, fixed workers."""
    mode, network = cfg.wan.mode, cfg.emulation.network
    if network is None:
        raise InputError(
            f"--wan {mode} trains across data centres: give --network with the WAN as its outer level, e.g. "
            "--network 2:1.25e9,3:6.25e6 (3 data centres of 2 workers)"
        )
    levels = Topology.parse(network).levels
    if len(levels) < 2 or levels[-1].count < 2:
        raise InputError(
            f"--wan {mode} needs two data centres or more, the outer level of --network: {network} is one data centre "
            f"(add a level, e.g. {network},2:6.25e6)"
        )
    if cfg.layout.schedule not in ("flush", "gpipe"):
        raise InputError(f"--wan {mode}: the data centres step together: give --schedule flush or gpipe")
    if cfg.elastic is not None or cfg.stragglers is not None:
        raise InputError(f"--wan {mode} runs fixed workers: drop --reliable, --join and --stragglers")


@dataclass(frozen=True, kw_only=True)
class RunState:
    """What :func:`~conveyor.job.train` decides before the workers start and hands each beside the config: the
    outcome of a recurrence's and a warm start's preparation, not options."""

    stop_above: float = math.inf  # a recurrence's cost at which it stops early (--batch-size auto)
    warm_start_plan: str | None = None  # warm_start.json: the parent and layer pairs every worker applies


def loss_and_optimizer(
    optimizer: OptimizerConfig, sequence: bool
) -> tuple[Callable[[Any, Any], Any], OptimizerFactory]:
    """The loss (cross-entropy; per position for a sequence's logits (B, T, V)) and the optimizer asked for."""
    opt_args = {"lr": optimizer.lr, "momentum": optimizer.momentum} if optimizer.name == "sgd" else {"lr": optimizer.lr}
    make_optimizer = partial(OPTIMIZERS[optimizer.name], **opt_args)
    if sequence:
        return (lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())), make_optimizer
    return F.cross_entropy, make_optimizer


def job_devices(cfg: TrainConfig) -> tuple[str, str, int]:
    """The job's device type, backend and local workers (``--workers``, else what a fixed layout needs, else one
    per GPU on CUDA and 4 on the CPU).

    Raises:
        ValueError: a device or backend this machine lacks, or more workers than GPUs under NCCL (one line each).
    """
    device = resolve_device(cfg.run.device)
    backend = resolve_backend(cfg.run.backend, device)
    nprocs = cfg.layout.workers or explicit_workers(cfg.layout) or default_workers(device)
    check_workers(int(os.environ.get("LOCAL_WORLD_SIZE", nprocs)) if under_torchrun() else nprocs, device, backend)
    return device, backend, nprocs


def explicit_workers(layout: LayoutConfig) -> int | None:
    """Workers a fixed layout needs (None when the planner decides)."""
    if layout.plan:
        return read_plan_file(layout.plan).workers
    if layout.replicas:
        return sum(parse_replicas(layout.replicas, layout.stages))
    return layout.stages


def check_against_data(cfg: TrainConfig, model: Blocks, samples: int) -> None:
    """The rules that need the model and the training set's size (``samples``); one line each, before any worker
    starts (a checkpoint of another model would otherwise fail in every worker after the start-up measurements).

    Raises:
        ValueError: a batch larger than the training set, more microbatches than samples in a batch, or a
            ``--resume`` checkpoint missing, unreadable or of another model.
    """
    batch, microbatches = cfg.optimizer.batch_size, cfg.layout.microbatches
    if batch > samples and not cfg.energy.tune_batch_size:  # auto=B0 may start above: the tuner shrinks it
        raise InputError(f"--batch-size {batch} is more than the {samples} training samples: use at most {samples}")
    if (microbatches or 1) > batch:
        raise InputError(
            f"--microbatches {microbatches} is more than the {batch} samples of a batch: use at most {batch}"
        )
    if cfg.run.resume:
        check_checkpoint(load_checkpoint(cfg.run.resume)["model"], block_shapes(as_blocks(model)), cfg.run.resume)
