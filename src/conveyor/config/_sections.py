"""The sections of :class:`~conveyor.config.TrainConfig`: keyword-only frozen dataclasses, each holding a group of
``conveyor train``'s options (every field its default, help, choices and option name, :func:`option`) and
checking its own fields when it is made (one line for every bad value). Torch-free: the parser is made from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from conveyor.config._choices import (
    AUTOCAST,
    BACKENDS,
    DEVICES,
    MATERIALIZE,
    MODES,
    OPTIMIZERS,
    STALE_RATES,
    WAN_ESTIMATES,
    WAN_MODES,
    Chunks,
    check_chunks,
    check_meter_spec,
    check_resources_every,
    mode_settings,
    model_arguments,
    model_for_dataset,
    parse_power_limit,
)
from conveyor.config._flags import option, positive, positive_or_auto
from conveyor.errors import InputError
from conveyor.schedule import KINDS, parse_replicas

__all__ = [
    "ElasticConfig",
    "EmulationConfig",
    "EnergyConfig",
    "LayoutConfig",
    "ModelConfig",
    "ModelStoreConfig",
    "OptimizerConfig",
    "RunConfig",
    "StragglersConfig",
    "WanConfig",
    "batch_size_option",
]

_DATASETS = (
    "digits, digit-images, text, text:PATH, imagefolder:PATH, hf:PATH, synthetic:SHAPE:CLASSES:N, synthetic-images, "
    "synthetic-text, torchvision:NAME:ROOT (default: the model's own)"
)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What is trained on what. ``materialize="stage"`` builds the model on the meta device and makes real only
    each worker's stage, initialised per module (:func:`conveyor.runtime.initialise_from`)."""

    TITLE: ClassVar[str] = "the model and its data"
    name: str = option(
        "auto",
        "a zoo model (mlp, vgg, resnet, gpt, ...), or module:callable (any nn.Module); auto: by the dataset, gpt for "
        "text, resnet for images, mlp for features",
        name="model",
    )
    args: str = option("", "NAME=VALUE,... for a module:callable, e.g. num_classes=10 or n_layer=2", name="model_args")
    dataset: str | None = option(None, _DATASETS)
    width: int | None = option(None, "scale a zoo model's width", parse=positive)
    depth: int | None = option(None, "scale a zoo model's depth", parse=positive)
    max_train_samples: int | None = option(
        None,
        "train on N training samples drawn at random (seeded), for a quick try; the test split stays whole",
        parse=positive,
        metavar="N",
    )
    materialize: str = option(
        "whole",
        "whole: every worker builds the whole model; stage: each builds it on the meta device and makes real only "
        "its stage (a model larger than one worker), initialised per module",
        choices=MATERIALIZE,
    )

    def __post_init__(self) -> None:
        if self.name == "auto":  # the config names the model it runs: config.toml reruns it, the run folder says it
            object.__setattr__(self, "name", model_for_dataset(self.dataset))
        if self.materialize not in MATERIALIZE:
            raise InputError(f"--materialize {self.materialize!r}: use one of {', '.join(MATERIALIZE)}")
        if self.args and ":" not in self.name:
            raise InputError(f"--model-args goes with a module:callable model, not {self.name}: use --width, --depth")
        counts = {"width": self.width, "depth": self.depth, "max-train-samples": self.max_train_samples}
        for flag, value in counts.items():
            if value is not None and value < 1:  # the command line's parser refuses these too (positive)
                raise InputError(f"--{flag} must be at least 1, got {value}")
        model_arguments(self.args)  # a malformed one fails here


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    """Where the model runs: ``schedule="auto"`` lets the planner pick the schedule and layout for ``workers``;
    ``stages`` and ``replicas`` (or ``plan``, a plan file) fix the layout instead."""

    TITLE: ClassVar[str] = "the layout: planned, or fixed"
    workers: int | None = option(
        None,
        "worker processes (default: one per GPU on CUDA, else one per core up to 4, or what a fixed layout needs; "
        "the planner may then train on fewer)",
        parse=positive,
    )
    schedule: str = option("auto", "auto: the planner's", choices=("auto", *sorted(KINDS)))
    stages: int | None = option(None, "fix the stage count instead of planning", parse=positive)
    replicas: str | None = option(None, "fix workers per stage, e.g. 2-1, instead of planning")
    plan: str | None = option(None, "run this plan file (conveyor plan --json) as is")
    microbatches: int | None = option(
        None, "microbatches per batch (default 4, or 1 for a job of one worker)", parse=positive
    )
    remeasure: bool = option(
        False,
        "measure the model, the machine and its links again before planning, rather than plan from the figures "
        "kept from the last run of the same job on this machine (in ~/.cache/conveyor, or $CONVEYOR_DATA/cache)",
    )
    trial: bool = option(
        True,
        "before training, try a layout of several workers that no run has measured on this job's figures, on a copy "
        "of the model (up to an epoch untimed, then about a second timed), and plan again with what it measured "
        "(--no-trial: plan from the simulation alone)",
    )

    def __post_init__(self) -> None:
        if (self.microbatches or 1) < 1:
            raise InputError("--batch-size and --microbatches must be at least 1")
        if self.plan and (self.stages or self.replicas):
            raise InputError("give either --plan or --stages/--replicas, not both")
        for flag, value in {"workers": self.workers, "stages": self.stages}.items():
            if value is not None and value < 1:  # the command line's parser refuses these too (positive)
                raise InputError(f"--{flag} must be at least 1, got {value}")
        fixed = sum(parse_replicas(self.replicas, self.stages)) if self.replicas else self.stages
        if self.workers is not None and fixed is not None and fixed != self.workers:
            layout = f"--replicas {self.replicas}" if self.replicas else f"--stages {self.stages}"
            raise InputError(
                f"{layout} runs on {fixed} workers but --workers is {self.workers}: give --workers {fixed}, or drop "
                "--workers (a fixed layout starts the workers it needs)"
            )


def batch_size_option(text: str) -> int | tuple[str, int]:
    """``--batch-size``'s type: ``64``, or ``auto`` / ``auto=128`` (tuned over recurrences from that start)."""
    name, _, default = text.partition("=")
    if name == "auto":
        return ("auto", positive(default) if default else 64)
    return positive(text)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """How the weights move: the optimizer, its rate, the batch, and the correction for stale gradients."""

    TITLE: ClassVar[str] = "the optimizer and the batch"
    name: str = option("sgd", "the optimizer every stage uses", name="optimizer", choices=OPTIMIZERS)
    lr: float = option(0.05, "learning rate, above 0")
    momentum: float = option(0.9, "SGD momentum, in [0, 1)")
    batch_size: int = option(
        64,
        "samples per batch, or auto[=B0]: learnt over recurrences of --job from B0 (default 64), the learning rate "
        "scaled with it (linear for SGD, square root for Adam)",
        parse=batch_size_option,
    )
    stale_correction: bool = option(
        True,
        "run pipedream, pipedream-vs and 2bw by their plain update rules, without weight prediction and without "
        "scaling PipeDream's per-minibatch learning rate",
    )
    stale_rate: str = option(
        "auto",
        "the stale-gradient correction's learning rate: sample (lr x the share of a batch an update covers: data "
        "parallelism's rate per sample), damped (that over 1 + the stage's staleness), or auto: the one conveyor "
        "bench convergence measured faster for the model and schedule (sample where it has no figure)",
        choices=STALE_RATES,
    )
    epoch_factors: str | None = option(
        None,
        "a conveyor bench convergence --json report: the epochs each schedule needs, to rank them by time to "
        "accuracy (default: the table shipped with Conveyor)",
    )

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise InputError("--batch-size and --microbatches must be at least 1")
        if not self.lr > 0 or not 0 <= self.momentum < 1:  # "not >" also refuses NaN
            raise InputError(f"--lr must be above 0 and --momentum in [0, 1); got {self.lr} and {self.momentum}")
        if self.name not in OPTIMIZERS:
            raise InputError(f"unknown optimizer {self.name!r}: use one of {', '.join(OPTIMIZERS)}")
        if self.stale_rate not in STALE_RATES:
            raise InputError(f"unknown --stale-rate {self.stale_rate!r}: use one of {', '.join(STALE_RATES)}")


_LEASE = (
    'run only while a lease lasts: FILE holds JSON {"until": UNIX_SECONDS} (replace it atomically to extend it). '
    "After each epoch worker 0 (elastic: the worker that evaluates) re-reads it; when one more epoch as long as "
    "the last one (elastic: the mean one) would end past until, the job stops there, saves its checkpoint and "
    'exits 0 (summary.json: "stopped_by_lease": true). At least one epoch runs; saving takes time beyond until'
)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How long, where it is written, what it starts from, and on which devices."""

    TITLE: ClassVar[str] = "the run: how long, where to, on what"
    epochs: int = option(10, "epochs to run (with --resume: epochs more)", parse=positive)
    target_accuracy: float | None = option(None, "stop once test accuracy reaches it, in (0, 1]")
    run_dir: str | None = option(None, "the run folder (default runs/MODEL-TIME, a new one)")
    overwrite: bool = option(False, "run in a --run-dir that holds a run, replacing it")
    checkpoint: str | None = option(None, "write the final model here (default RUN_DIR/checkpoint.pt)")
    checkpoint_every: int | None = option(
        None,
        "also save the checkpoint every N epochs, so a run killed outright loses at most N (default: at the end, "
        "and when Ctrl-C or SIGTERM stops it)",
        parse=positive,
        metavar="N",
    )
    resume: str | None = option(
        None, "start from this checkpoint (it may be the --checkpoint path too: it is read before it is replaced)"
    )
    lease: str | None = option(None, _LEASE, metavar="FILE")
    seed: int = option(0, "initial weights, data order and dropout")
    device: str = option("auto", "cuda: one worker per GPU (default where there is one); cpu; auto", choices=DEVICES)
    backend: str = option(
        "auto",
        "nccl (CUDA) or gloo (CPU) by default; gloo with --device cuda lets several workers share each GPU (for "
        "tests and one-GPU machines: slower)",
        choices=BACKENDS,
    )
    autocast: str = option(
        "off", "bf16: forwards and the loss in bfloat16 under torch.autocast (weights stay float32)", choices=AUTOCAST
    )
    torch_profile: str | None = option(
        None,
        "profile the second epoch's training with torch.profiler: DIR/workerN.txt (operators by time) and .json "
        "(timeline) per worker",
        metavar="DIR",
    )
    loader_workers: int = option(
        0, "DataLoader processes per reading worker, reading host memory (0: the dataset moves to the device once)"
    )
    resources_every: float | None = option(
        None,
        "every SECONDS, each worker's memory, open descriptors, threads and the store's keys to RUN_DIR/"
        "resources.jsonl (Linux; to see that a long run holds steady)",
        metavar="SECONDS",
    )

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

    TITLE: ClassVar[str] = "emulated cluster (needs root)"
    network: str | None = option(None, "a topology to emulate, e.g. 2:1.25e9,2:1.25e7 (2 servers of 2)")
    devices: str | None = option(None, "CPU cores per worker: 1,1,0.5,0.5 or fast=1.0:2,slow=0.25:2")
    faults: str | None = option(
        None, "a JSON file, events or patterns, ';'-separated (docs/guides/emulated-cluster.md)"
    )
    cpu_slice: float = option(
        0.025,
        "seconds an emulated device runs before each stop of its quota (shorter slows it more evenly, each stop "
        "costing some work)",
    )


@dataclass(frozen=True, kw_only=True)
class EnergyConfig:
    """Zeus' knobs: the meter, the GPUs' power limit, and a recurring job's batch size (cost = eta * energy +
    (1 - eta) * max_power * time)."""

    TITLE: ClassVar[str] = "energy (Zeus: cost = eta * energy + (1 - eta) * max power * time)"
    meter: str = option(
        "auto",
        "measure each epoch's energy, all workers summed: auto (Zeus: each worker's GPU through NVML, each host's "
        "CPU and DRAM through RAPL on its local rank 0; null where none is readable), off, or replay:PATH (a Zeus "
        "CSV log replayed, one row per epoch; {rank} in PATH: one log per worker)",
        name="energy_meter",
        metavar="auto|off|replay:PATH",
    )
    power_limit: str | None = option(
        None,
        "CUDA: each GPU's power limit; auto profiles the candidates in the first epoch and keeps the cheapest for "
        "--eta; every GPU's own limit is restored at exit",
        metavar="auto|max|WATTS",
    )
    eta: float = option(0.5, "weight of energy against time in the cost, 0..1")
    tune_batch_size: bool = option(False, "set by --batch-size auto: a recurrence of --job", name="")
    job: str | None = option(None, "the recurring job's name (--batch-size auto)")
    recurrences: str | None = option(None, "the recurrences' SQLite file (default: the user's data dir)")
    beta: float = option(2.0, "stop a recurrence past beta x the least cost so far")
    max_power: float | None = option(None, "watts that price a second (default: the GPUs' largest power limits)")

    def __post_init__(self) -> None:
        check_meter_spec(self.meter)
        if not 0.0 <= self.eta <= 1.0:
            raise InputError(f"--eta weighs energy against time and must be in [0, 1], got {self.eta}")
        if self.beta <= 1.0 or (self.max_power is not None and self.max_power <= 0):
            raise InputError("--beta must be greater than 1 and --max-power above 0")
        if self.power_limit is not None:
            parse_power_limit(self.power_limit)
        if self.job is not None and not self.tune_batch_size:
            raise InputError("--job names a recurring job whose batch size is tuned: add --batch-size auto")


@dataclass(frozen=True, kw_only=True)
class StragglersConfig:
    """Work reassignment among a replicated first stage's replicas (:mod:`conveyor.stragglers`)."""

    TITLE: ClassVar[str] = "stragglers: layouts whose first stage alone is replicated (data parallelism, 2-1)"
    mode: str = option(
        "off",
        "take slow replicas' work (reassign), let replicas run --slack steps ahead (slack), both (flexrr), take "
        "their unstarted work and run again a chunk a stalled replica holds, synchronously (backup), the same "
        "reduced among the replicas whose runs were used, never waiting for a stalled one (live), or none (off)",
        name="stragglers",
        choices=MODES,
    )
    slack: int = option(1, "steps a replica may run ahead of the slowest (flexrr, slack)")
    chunks: Chunks = option(
        2,
        "chunks each replica owns per batch (reassignment), or auto: weigh the chunks' fixed costs against the work "
        "a stalled replica holds, timed on the first batch",
        parse=positive_or_auto,
    )
    equal_shares: bool = option(
        False,
        "every replica owns as many of a batch's chunks (default: shares in proportion to the replicas' measured "
        "speeds, one chunk each at least)",
    )

    def __post_init__(self) -> None:
        check_chunks(self.chunks)
        mode_settings(self.mode, self.slack)


@dataclass(frozen=True, kw_only=True)
class WanConfig:
    """Data centres joined by the emulated network's outer level, a WAN (:mod:`conveyor.gaia`): synchronous inside
    each, ``mode`` across them."""

    TITLE: ClassVar[str] = "data centres joined by a WAN: the outer level of --network (conveyor.gaia)"
    mode: str = option(
        "off",
        "synchronous inside each data centre; across them gaia sends only significant updates, diloco takes "
        "--local-steps steps then an outer Nesterov step, off all-reduces every update across the WAN",
        name="wan",
        choices=WAN_MODES,
    )
    threshold: float = option(
        0.05,
        "gaia: an update crosses once its step is this fraction of the weight it moves (Gaia used 1%)",
        name="wan_threshold",
    )
    staleness: int = option(
        1,
        "gaia's mirror clock: an update is read at most this many - 1 updates after it is sent (1: at once, no "
        "overlap of the WAN with training)",
        name="wan_staleness",
    )
    period: int = option(
        2,
        "gaia: updates between exchanges; what is pending is tested for significance and sent at each (1: every "
        "update; 2 reached the target sooner than 1 in 11 of 12 runs of conveyor bench wan)",
        name="wan_period",
    )
    estimate: str = option(
        "auto",
        "gaia: each data centre stands its own gradient in for what the others hold back, until they send it (on), "
        "or not (off); auto: on where a short pilot before training learns faster on a data centre's share stepped "
        "as the estimate steps it",
        name="wan_estimate",
        choices=WAN_ESTIMATES,
    )
    local_steps: int = option(16, "diloco: updates between outer steps")
    outer_lr: float = option(0.7, "diloco: the outer Nesterov step's rate")

    def __post_init__(self) -> None:
        if self.mode not in WAN_MODES:
            raise InputError(f"--wan {self.mode!r}: use one of {', '.join(WAN_MODES)}")
        if not 0 < self.threshold < 1:
            raise InputError(f"--wan-threshold is a relative change in (0, 1), got {self.threshold}")
        if isinstance(self.estimate, bool):  # a config.toml from when --wan-estimate was a switch
            object.__setattr__(self, "estimate", "on" if self.estimate else "off")
        if self.estimate not in WAN_ESTIMATES:
            raise InputError(f"--wan-estimate {self.estimate!r}: use one of {', '.join(WAN_ESTIMATES)}")
        if self.staleness < 1:
            raise InputError(f"--wan-staleness is at least 1 update, got {self.staleness}")
        if self.period < 1:
            raise InputError(f"--wan-period is at least 1 update, got {self.period}")
        if self.local_steps < 1 or not self.outer_lr > 0:
            raise InputError(
                f"--local-steps must be at least 1 and --outer-lr above 0, got {self.local_steps} and {self.outer_lr}"
            )


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """Elastic training on revocable workers (:mod:`conveyor.elastic`): a job whose first ``reliable`` workers
    are reliable, or ``join``, the address of one to join."""

    TITLE: ClassVar[str] = "elastic training on revocable workers (conveyor.elastic)"
    reliable: int | None = option(
        None, "the first K workers are reliable, the rest transient: keep training through revocations", parse=positive
    )
    join: str | None = option(None, "join the elastic job whose worker 0 is here", metavar="HOST:PORT")
    lost_s: float = option(10.0, "a worker silent this long is lost (one that dies: at once)")
    backup_every: int = option(4, "steps between backups to the reliable tier", parse=positive)
    sync_max: float = option(2.0, "transient:reliable ratio up to which reliable workers own the state (AgileML 1)")
    backup_only_min: float = option(3.0, "ratio from which reliable workers only keep backups (AgileML stage 3)")
    layout: str = option(
        "data",
        "data parallelism, or a pipeline whose stages and replicas the planner re-plans at every change",
        name="elastic_layout",
        choices=("data", "pipeline"),
    )

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

    TITLE: ClassVar[str] = "warm starts from trained models (ModelKeeper)"
    warm_start: str | None = option(
        None,
        "start from the weights of the store's most similar, most accurate model (auto), or of a checkpoint, "
        "transformed to this model's shapes",
        metavar="auto|CHECKPOINT",
    )
    folder: str | None = option(None, "the model store's folder (default: the user's data dir)", name="store")
    register: bool = option(False, "put the final model into the model store")
