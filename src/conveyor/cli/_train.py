"""``conveyor train``: the main job, with its options."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from conveyor.cli._common import add_emulation, console, positive, positive_or_auto, write_json
from conveyor.errors import InputError
from conveyor.processes import start_worker_server, under_torchrun
from conveyor.schedule import KINDS

if TYPE_CHECKING:
    from conveyor.job import ElasticSummary, RunSummary

DEVICES = ("auto", "cpu", "cuda")  # conveyor.runtime.DEVICES and BACKENDS written out: importing them loads torch
BACKENDS = ("auto", "nccl", "gloo")

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    train = sub.add_parser("train", help="profile, plan and train a model; writes a run folder")
    train.add_argument(
        "--model", default="mlp", help="a zoo model (mlp, vgg, resnet, gpt, ...), or module:callable (any nn.Module)"
    )
    train.add_argument(
        "--model-args", default="", help="NAME=VALUE,... for a module:callable, e.g. num_classes=10 or n_layer=2"
    )
    train.add_argument(
        "--dataset",
        default=None,
        help="digits, digit-images, text, text:PATH, imagefolder:PATH, hf:PATH, synthetic:SHAPE:CLASSES:N, "
        "synthetic-images, synthetic-text, torchvision:NAME:ROOT",
    )
    train.add_argument(
        "--materialize",
        choices=("whole", "stage"),
        default="whole",
        help="whole: every worker builds the whole model; stage: each builds it on the meta device and makes "
        "real only its stage (a model larger than one worker), initialised per module",
    )
    train.add_argument("--width", type=positive, default=None, help="scale a zoo model's width")
    train.add_argument("--depth", type=positive, default=None, help="scale a zoo model's depth")
    train.add_argument(
        "--workers", type=positive, default=None, help="worker processes (default: one per GPU on CUDA, else 4)"
    )
    train.add_argument("--schedule", choices=["auto", *sorted(KINDS)], default="auto", help="auto: the planner's")
    train.add_argument("--stages", type=positive, default=None, help="fix the stage count instead of planning")
    train.add_argument("--replicas", default=None, help="fix workers per stage, e.g. 2-1, instead of planning")
    train.add_argument("--plan", default=None, help="run this plan file (conveyor plan --json) as is")
    train.add_argument(
        "--microbatches",
        type=positive,
        default=None,
        help="microbatches per batch (default 4, or 1 for a job of one worker)",
    )
    train.add_argument(
        "--batch-size",
        type=_batch_size,
        default=64,
        help="samples per batch, or auto[=B0]: learnt over recurrences of --job from B0 (default "
        "64), the learning rate scaled with it (linear for SGD, square root for Adam)",
    )
    train.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="the optimizer every stage uses")
    train.add_argument("--lr", type=float, default=0.05, help="learning rate, above 0")
    train.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, in [0, 1)")
    train.add_argument(
        "--no-stale-correction",
        dest="stale_correction",
        action="store_false",
        help="run pipedream, pipedream-vs and 2bw by their plain update rules, without weight prediction and "
        "without scaling PipeDream's per-minibatch learning rate",
    )
    train.add_argument(
        "--epoch-factors",
        default=None,
        help="a conveyor bench convergence --json report: the epochs each schedule needs, to rank them by time to "
        "accuracy (default: the table shipped with Conveyor)",
    )
    train.add_argument("--epochs", type=positive, default=10, help="epochs to run (with --resume: epochs more)")
    train.add_argument("--target-accuracy", type=float, default=None, help="stop once test accuracy reaches it")
    train.add_argument("--run-dir", default=None, help="the run folder (default runs/MODEL-TIME)")
    train.add_argument("--checkpoint", default=None, help="write the final model here (default RUN_DIR/checkpoint.pt)")
    train.add_argument(
        "--checkpoint-every",
        type=positive,
        default=None,
        metavar="N",
        help="also save the checkpoint every N epochs, so a run killed outright loses at most N (default: at the end, "
        "and when Ctrl-C or SIGTERM stops it)",
    )
    train.add_argument(
        "--resume",
        default=None,
        help="start from this checkpoint (it may be the --checkpoint path too: it is read before it is replaced)",
    )
    train.add_argument(
        "--lease",
        default=None,
        metavar="FILE",
        help='run only while a lease lasts: FILE holds JSON {"until": UNIX_SECONDS} (replace it atomically to '
        "extend it). After each epoch worker 0 (elastic: the worker that evaluates) re-reads it; when one more "
        "epoch as long as the last one (elastic: the mean one) would end past until, the job stops there, saves "
        'its checkpoint and exits 0 (summary.json: "stopped_by_lease": true). At least one epoch runs; saving '
        "takes time beyond until",
    )
    train.add_argument("--seed", type=int, default=0, help="initial weights, data order and dropout")
    train.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="cuda: one worker per GPU (default where there is one); cpu; auto",
    )
    train.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="nccl (CUDA) or gloo (CPU) by default; gloo with --device cuda lets several workers share "
        "each GPU (for tests and one-GPU machines: slower)",
    )
    train.add_argument(
        "--autocast",
        choices=("off", "bf16"),
        default="off",
        help="bf16: forwards and the loss in bfloat16 under torch.autocast (weights stay float32)",
    )
    train.add_argument(
        "--torch-profile",
        default=None,
        metavar="DIR",
        help="profile the second epoch's training with torch.profiler: DIR/workerN.txt (operators by time) and "
        ".json (timeline) per worker",
    )
    train.add_argument(
        "--resources-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="every SECONDS, each worker's memory, open descriptors, threads and the store's keys to RUN_DIR/"
        "resources.jsonl (Linux; to see that a long run holds steady)",
    )
    train.add_argument(
        "--loader-workers",
        type=int,
        default=0,
        help="DataLoader processes per reading worker, reading host memory (default 0: the dataset "
        "moves to the device once)",
    )
    train.add_argument(  # conveyor.stragglers.MODES written out: importing it would load torch at start-up
        "--stragglers",
        choices=["live", "flexrr", "slack", "reassign", "backup", "off"],
        default="off",
        help="layouts whose first stage alone is replicated (data parallelism, 2-1): take slow replicas' work "
        "(reassign), let replicas run --slack steps ahead (slack), both (flexrr), take their unstarted work and "
        "run again a chunk a stalled replica holds, synchronously (backup), the same reduced among the replicas "
        "whose runs were used, never waiting for a stalled one (live), or none (off)",
    )
    train.add_argument("--slack", type=int, default=1, help="steps a replica may run ahead of the slowest")
    train.add_argument(
        "--chunks",
        type=positive_or_auto,
        default=2,
        help="chunks each replica owns per batch (reassignment), or auto: weigh the chunks' fixed costs against the "
        "work a stalled replica holds, timed on the first batch",
    )
    train.add_argument(
        "--equal-shares",
        action="store_true",
        help="every replica owns as many of a batch's chunks (default: shares in proportion to the replicas' "
        "measured speeds, one chunk each at least)",
    )
    wan = train.add_argument_group("data centres joined by a WAN: the outer level of --network (conveyor.gaia)")
    wan.add_argument(  # conveyor.job's WAN_MODES written out: importing it would load torch at start-up
        "--wan",
        choices=["gaia", "diloco", "off"],
        default="off",
        help="synchronous inside each data centre; across them gaia sends only significant updates, diloco "
        "takes --local-steps steps then an outer Nesterov step, off all-reduces every update across the WAN",
    )
    wan.add_argument(
        "--wan-threshold",
        type=float,
        default=0.05,
        help="gaia: an update crosses once its step is this fraction of the weight it moves (Gaia used 1%%)",
    )
    wan.add_argument(
        "--wan-staleness",
        type=int,
        default=1,
        help="gaia's mirror clock: an update is read at most this many - 1 updates after it is sent (1: at once, "
        "no overlap of the WAN with training)",
    )
    wan.add_argument("--local-steps", type=int, default=16, help="diloco: updates between outer steps")
    wan.add_argument("--outer-lr", type=float, default=0.7, help="diloco: the outer Nesterov step's rate")
    elastic = train.add_argument_group("elastic training on revocable workers (conveyor.elastic)")
    elastic.add_argument(
        "--reliable",
        type=positive,
        default=None,
        help="the first K workers are reliable, the rest transient: keep training through revocations",
    )
    elastic.add_argument(
        "--join", default=None, metavar="HOST:PORT", help="join the elastic job whose worker 0 is here"
    )
    elastic.add_argument(
        "--lost-s", type=float, default=10.0, help="a worker silent this long is lost (one that dies: at once)"
    )
    elastic.add_argument("--backup-every", type=positive, default=4, help="steps between backups to the reliable tier")
    elastic.add_argument(
        "--sync-max",
        type=float,
        default=2.0,
        help="transient:reliable ratio up to which reliable workers own the state (AgileML stage 1)",
    )
    elastic.add_argument(
        "--backup-only-min",
        type=float,
        default=3.0,
        help="ratio from which reliable workers only keep backups (AgileML stage 3)",
    )
    elastic.add_argument(
        "--elastic-layout",
        choices=("data", "pipeline"),
        default="data",
        help="data parallelism, or a pipeline whose stages and replicas the planner re-plans at every change",
    )
    train.add_argument(
        "--energy-meter",
        default="auto",
        metavar="auto|off|replay:PATH",
        help="measure each epoch's energy, all workers summed: auto (Zeus: each worker's GPU through NVML, each "
        "host's CPU and DRAM through RAPL on its local rank 0; null where none is readable), off, or replay:PATH (a "
        "Zeus CSV log replayed, one row per epoch; {rank} in PATH: one log per worker)",
    )
    zeus = train.add_argument_group("energy knobs (Zeus: cost = eta * energy + (1 - eta) * max power * time)")
    zeus.add_argument(
        "--power-limit",
        default=None,
        metavar="auto|max|WATTS",
        help="CUDA: each GPU's power limit; auto profiles the candidates in the first epoch and keeps "
        "the cheapest for --eta; every GPU's own limit is restored at exit",
    )
    zeus.add_argument("--eta", type=float, default=0.5, help="weight of energy against time in the cost, 0..1")
    zeus.add_argument("--job", default=None, help="the recurring job's name (--batch-size auto)")
    zeus.add_argument("--recurrences", default=None, help="the recurrences' SQLite file (default: the user's data dir)")
    zeus.add_argument("--beta", type=float, default=2.0, help="stop a recurrence past beta x the least cost so far")
    zeus.add_argument(
        "--max-power",
        type=float,
        default=None,
        help="watts that price a second (default: the GPUs' largest power limits)",
    )
    keeper = train.add_argument_group("warm starts from trained models (ModelKeeper)")
    keeper.add_argument(
        "--warm-start",
        default=None,
        metavar="auto|CHECKPOINT",
        help="start from the weights of the store's most similar, most accurate model (auto), or of "
        "a checkpoint, transformed to this model's shapes",
    )
    keeper.add_argument("--register", action="store_true", help="put the final model into the model store")
    keeper.add_argument("--store", default=None, help="the model store's folder (default: the user's data dir)")
    train.add_argument("--json", type=Path, default=None, help="also write the run's summary here")
    add_emulation(train, cpu_slice=True)


def _batch_size(text: str) -> int | tuple[str, int]:
    """``64``, or ``auto`` / ``auto=128`` (tuned over recurrences from that default)."""
    name, _, default = text.partition("=")
    if name == "auto":
        return ("auto", positive(default) if default else 64)
    return positive(text)


def run(args: argparse.Namespace) -> int:
    if not args.join and not under_torchrun():
        start_worker_server()  # it imports torch for the workers while this process does for itself
    from conveyor.job import (
        OPTION_FIELDS,
        ElasticSummary,
        RunSummary,
        TrainConfig,
        check_against_data,
        explicit_workers,
        fixed_layout,
        job_devices,
        model_and_data,
        read_lease,
        train,
        train_elastic,
    )
    from conveyor.plan import EpochFactors

    if args.join:
        from conveyor.job import join_elastic

        if args.lease:
            raise InputError("--lease bounds the job its worker 0 starts: drop --join (the job's own lease holds)")

        console.print(f"joining the elastic job at {args.join}")
        join_elastic(args.join, args.run_dir)
        return 0
    if args.lease:
        read_lease(args.lease)  # a missing or unreadable lease fails here, with one line
    EpochFactors.load(args.epoch_factors)  # and so does a bad table of epochs
    if isinstance(args.batch_size, tuple):  # --batch-size auto[=B0]
        args.batch_size, args.tune_batch_size = args.batch_size[1], True
    cfg = TrainConfig.from_options(
        **{option: getattr(args, option) for option in OPTION_FIELDS if hasattr(args, option)}
    )
    _, _, workers = job_devices(cfg)  # a device, backend or worker count this machine cannot run fails here
    model, data = model_and_data(cfg)  # so does an unknown model or dataset, before any worker starts
    check_against_data(cfg, model, data.samples)  # a batch, microbatches or checkpoint that cannot fit
    if cfg.elastic is not None:
        data.tensor_inputs("an elastic job")  # its steps take one input tensor
    # and a layout that cannot work
    fixed_layout(cfg, len(model), cfg.layout.workers or explicit_workers(cfg.layout) or 0)
    cfg.emulation.emulation().check(workers)  # and so on
    if os.environ.get("RANK", "0") == "0":  # under torchrun, say it once
        console.print(
            f"training {cfg.model.name} on {data.name}: {data.samples} training samples, "
            f"batch {cfg.optimizer.batch_size}"
        )
    result = train_elastic(cfg) if cfg.elastic is not None else train(cfg)
    if result is None:  # a torchrun worker without the output: that one prints
        return 0
    if isinstance(result, ElasticSummary):
        _print_elastic(result)
    else:
        _print_run(result)
    if args.json:
        write_json(args.json, result.to_dict())
    if isinstance(result, RunSummary) and result.interrupted:
        _print_go_on(args.argv, result, cfg.run.epochs - result.epochs, recurring=cfg.energy.tune_batch_size)
        return 130  # as a shell reports a command stopped by Ctrl-C
    return 0


def _print_go_on(argv: list[str], result: RunSummary, left: int, *, recurring: bool) -> None:
    """What an interrupted run saved, and the command that trains its other ``left`` epochs (into a new run
    folder: the old one keeps its logs). A recurrence of ``--batch-size auto`` is not continued: it is recorded
    as interrupted, and its next run begins the next recurrence."""
    said = f"interrupted after {result.epochs} epochs; saved to {result.checkpoint}"
    if recurring:
        console.print(f"{said}. This recurrence counts for nothing; run the job again", highlight=False, soft_wrap=True)
        return
    go_on = shlex.join([*_without(argv, "--resume", "--epochs", "--run-dir"), "--resume", result.checkpoint])
    console.print(f"{said}. The other {left}: conveyor {go_on} --epochs {left}", highlight=False, soft_wrap=True)


def _without(argv: list[str], *options: str) -> list[str]:
    """``argv`` less ``options`` and their values (``--opt VALUE`` or ``--opt=VALUE``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif arg.split("=", 1)[0] not in options:
            kept.append(arg)
    return kept


def _print_elastic(result: ElasticSummary) -> None:
    table = Table("generation", "why", "stage", "workers", "pipeline", "resumed at step", "steps redone", "seconds")
    for g in result.generations:
        layout = g.get("layout")  # a pipeline's replicas per stage, PipeDream-style: 2-1
        pipeline = "-".join(map(str, layout["replicas"])) if layout else "-"
        row = (g["gen"], g["reason"], g["stage"], len(g["compute"]), pipeline, g["resume_step"] + 1, g["steps_redone"])
        table.add_row(*map(str, row), f"{g['recover_s']:.2f}")
    console.print(table)
    accuracy = result.accuracy[-1] if result.accuracy else float("nan")
    console.print(f"{result.epochs} epochs, test accuracy {accuracy:.3f}, {result.seconds:.1f} s")
    console.print(f"run folder: {result.run_dir}", highlight=False, soft_wrap=True)


def _print_run(result: RunSummary) -> None:
    table = Table("epochs", "test accuracy", "final loss", "seconds", "samples/s", "energy")
    energy = "n/a" if result.energy_j is None else f"{result.energy_j / 1e3:.1f} kJ"
    table.add_row(
        str(result.epochs),
        f"{result.accuracy[-1]:.3f}",
        f"{result.loss[-1]:.3f}",
        f"{result.seconds:.1f}",
        f"{result.samples_per_s:.0f}",
        energy,
    )
    console.print(table)
    console.print(f"run folder: {result.run_dir}", highlight=False, soft_wrap=True)  # whole, to copy
    if result.energy_note:
        console.print(result.energy_note, markup=False, highlight=False)
    if result.recurrence is not None:
        r = result.recurrence
        console.print(
            f"recurrence {r['number']} of job {r['job']}: batch size {r['batch_size']} ({r['phase']}), learning rate "
            f"{r['lr']:g}, cost {result.cost:.4g}; target {'reached' if r['reached'] else 'not reached'}"
        )
    if result.registered:
        console.print(f"stored the model as {result.registered} (conveyor models list)")
    if result.power_limit_w:
        console.print(f"GPU power limit: {result.power_limit_w} W")
    if result.power_limit_note:
        console.print(result.power_limit_note, markup=False, highlight=False)
    for note in result.notes():
        console.print(note)
