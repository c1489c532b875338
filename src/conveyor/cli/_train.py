"""``conveyor train``: the main job, with its options."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from conveyor.cli._common import console, write_json
from conveyor.config import OPTION_FIELDS, SECTIONS, TrainConfig, add_options, read_config_file
from conveyor.processes import start_worker_server, under_torchrun

if TYPE_CHECKING:
    from conveyor.job import ElasticSummary, RunSummary

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """``conveyor train``: one option per field of :class:`~conveyor.config.TrainConfig`'s sections (made from
    their definitions), ``--config`` to read a run's ``config.toml``, and ``--json``."""
    train = sub.add_parser("train", help="profile, plan and train a model; writes a run folder")
    train.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="start from this config.toml (a run folder's, or your own: [section] field = value); options given on "
        "the command line override it",
    )
    train.add_argument("--json", type=Path, default=None, help="also write the run's summary here")
    for section in SECTIONS.values():
        add_options(train.add_argument_group(section.TITLE), section)


def run(args: argparse.Namespace) -> int:
    cfg = _train_config(args)  # every option checked on its own and against the others, before anything starts
    join = cfg.elastic.join if cfg.elastic is not None else None
    if not join and not under_torchrun():
        start_worker_server()  # it imports torch for the workers while this process does for itself
    if join:
        from conveyor.job import join_elastic

        console.print(f"joining the elastic job at {join}")
        join_elastic(join, cfg.run.run_dir)
        return 0
    data_name, samples = _checked(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, say it once
        console.print(
            f"training {cfg.model.name} on {data_name}: {samples} training samples, batch {cfg.optimizer.batch_size}"
        )
    from conveyor.job import train, train_elastic

    result = train_elastic(cfg) if cfg.elastic is not None else train(cfg)
    if result is None:  # a torchrun worker without the output: that one prints
        return 0
    return _reported(args, cfg, result)


def _checked(cfg: TrainConfig) -> tuple[str, int]:
    """Every check that needs torch, the model or the data, before any worker starts (each fails with one line);
    the dataset's name and training samples."""
    from conveyor.emulate import Emulation
    from conveyor.job import check_against_data, model_and_data, read_lease
    from conveyor.job.parts import explicit_workers, fixed_layout, job_devices, scored_classes
    from conveyor.plan.parts import EpochFactors

    if cfg.run.lease:
        read_lease(cfg.run.lease)  # a missing or unreadable lease fails here, with one line
    EpochFactors.load(cfg.optimizer.epoch_factors)  # and so does a bad table of epochs
    _, _, workers = job_devices(cfg)  # a device, backend or worker count this machine cannot run fails here
    model, data = model_and_data(cfg)  # so does an unknown model or dataset, before any worker starts
    check_against_data(cfg, model, data.samples)  # a batch, microbatches or checkpoint that cannot fit
    if (scores := scored_classes(model)) is not None and scores > data.classes:
        console.print(
            f"{cfg.model.name} scores {scores} classes and {data.name} has {data.classes}: the other "
            f"{scores - data.classes} are never a target (as in a vocabulary padded for speed)",
            highlight=False,
        )
    if cfg.elastic is not None:
        data.tensor_inputs("an elastic job")  # its steps take one input tensor
    # and a layout that cannot work
    world = int(os.environ.get("WORLD_SIZE", "0")) if under_torchrun() else 0  # torchrun's workers, all machines'
    fixed_layout(cfg, len(model), world or cfg.layout.workers or explicit_workers(cfg.layout) or 0)
    Emulation.of(cfg.emulation).check(workers)  # and so on
    return data.name, data.samples


def _reported(args: argparse.Namespace, cfg: TrainConfig, result: RunSummary | ElasticSummary) -> int:
    """Print the run's result (and write ``--json``); the command's exit status: 1 where the weights diverged, 130
    where the run was interrupted (saying how to go on), else 0."""
    from conveyor.job import ElasticSummary, RunSummary

    if isinstance(result, ElasticSummary):
        _print_elastic(result)
    else:
        _print_run(result, cfg.run.target_accuracy)
    if args.json:
        write_json(args.json, result.to_dict())
    if isinstance(result, RunSummary) and result.diverged is not None:
        print(
            f"conveyor: error: {result.diverged}: try a lower --lr (this run's: {cfg.optimizer.lr:g}). The run stopped "
            f"there; its checkpoint was not written (the weights are not finite), its summary is in {result.run_dir}",
            file=sys.stderr,
        )
        return 1
    if isinstance(result, RunSummary) and result.interrupted:
        _print_go_on(args.argv, result, cfg.run.epochs - result.epochs, recurring=cfg.energy.tune_batch_size)
        return 130  # as a shell reports a command stopped by Ctrl-C
    return 0


def _train_config(args: argparse.Namespace) -> TrainConfig:
    """The run's config: ``--config``'s file, then the options given on the command line (``--batch-size
    auto[=B0]``: B0, tuned over recurrences)."""
    options = read_config_file(args.config) if args.config else {}
    options.update({option: getattr(args, option) for option in OPTION_FIELDS if hasattr(args, option)})
    if isinstance(options.get("batch_size"), tuple):
        options["batch_size"], options["tune_batch_size"] = options["batch_size"][1], True
    return TrainConfig.from_options(**options)


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


def _print_run(result: RunSummary, target: float | None) -> None:
    table = Table("epochs", "test accuracy", "final loss", "seconds", "samples/s", "energy")
    energy = "n/a" if result.energy_j is None else f"{result.energy_j / 1e3:.1f} kJ"
    epochs = str(result.epochs)
    if result.epochs_before:  # a resumed run: the whole run's epochs
        epochs = f"{result.epochs_before + result.epochs} ({result.epochs_before} resumed)"
    table.add_row(
        epochs,
        f"{result.accuracy[-1]:.3f}",
        f"{result.loss[-1]:.3f}",
        f"{result.seconds:.1f}",
        f"{result.samples_per_s:.0f}",
        energy,
    )
    console.print(table)
    console.print(f"run folder: {result.run_dir}", highlight=False, soft_wrap=True)  # whole, to copy
    if target is not None:
        console.print(_target_line(result, target), highlight=False)
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


def _target_line(result: RunSummary, target: float) -> str:
    """Whether the run reached ``--target-accuracy`` (and stopped there), and when."""
    reached = next((n for n, a in enumerate(result.accuracy, 1) if a >= target), None)
    if reached is None:
        return f"target accuracy {target:g} not reached in {result.epochs} epochs (best {max(result.accuracy):.3f})"
    seconds = result.time_to_accuracy_s
    when = "" if seconds is None else f", {seconds:.1f} s"
    return f"target accuracy {target:g} reached at epoch {result.epochs_before + reached}{when}: the run stopped there"
