"""``conveyor train``: the main job, with its options."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import add_emulation, config, console, positive, write_json
from conveyor.schedule import KINDS

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    train = sub.add_parser("train", help="profile, plan and train a model; writes a run folder")
    train.add_argument("--model", default="mlp", help="mlp, vgg, resnet, gpt, or package.module:factory")
    train.add_argument("--dataset", default=None, help="digits, digit-images, text, text:PATH, torchvision:NAME:ROOT")
    train.add_argument("--width", type=positive, default=None, help="scale a zoo model's width")
    train.add_argument("--depth", type=positive, default=None, help="scale a zoo model's depth")
    train.add_argument("--workers", type=positive, default=None, help="worker processes (default 4 when planning)")
    train.add_argument("--schedule", choices=["auto", *sorted(KINDS)], default="auto", help="auto: the planner's")
    train.add_argument("--stages", type=positive, default=None, help="fix the stage count instead of planning")
    train.add_argument("--replicas", default=None, help="fix workers per stage, e.g. 2-1, instead of planning")
    train.add_argument("--plan", default=None, help="run this plan file (conveyor plan --json) as is")
    train.add_argument("--microbatches", type=positive, default=4)
    train.add_argument("--batch-size", type=positive, default=64)
    train.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    train.add_argument("--lr", type=float, default=0.05)
    train.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    train.add_argument(
        "--no-stale-correction", dest="stale_correction", action="store_false",
        help="run pipedream, pipedream-vs and 2bw by their plain update rules, without weight prediction and "
        "without scaling PipeDream's per-minibatch learning rate",
    )  # fmt: skip
    train.add_argument(
        "--epoch-factors", default=None,
        help="a conveyor bench convergence --json report: the epochs each schedule needs, to rank them by time to "
        "accuracy (default: the table shipped with Conveyor)",
    )  # fmt: skip
    train.add_argument("--epochs", type=positive, default=10)
    train.add_argument("--target-accuracy", type=float, default=None, help="stop once test accuracy reaches it")
    train.add_argument("--run-dir", default=None, help="the run folder (default runs/MODEL-TIME)")
    train.add_argument("--checkpoint", default=None, help="write the final model here (default RUN_DIR/checkpoint.pt)")
    train.add_argument("--resume", default=None, help="start from this checkpoint")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--loader-workers", type=int, default=None, help="DataLoader processes per reading worker (default 2 with CUDA)"
    )
    train.add_argument(  # conveyor.stragglers.MODES written out: importing it would load torch at start-up
        "--stragglers", choices=["flexrr", "slack", "reassign", "off"], default="off",
        help="layouts whose first stage alone is replicated (data parallelism, 2-1): take slow replicas' work "
        "(reassign), let replicas run --slack steps ahead (slack), both (flexrr), or neither (off)",
    )  # fmt: skip
    train.add_argument("--slack", type=int, default=1, help="steps a replica may run ahead of the slowest")
    train.add_argument("--chunks", type=positive, default=2, help="chunks each replica owns per batch (reassignment)")
    train.add_argument("--json", type=Path, default=None, help="also write the run's summary here")
    add_emulation(train)


def run(args: argparse.Namespace) -> None:
    from conveyor.emulate import Emulation
    from conveyor.job import TrainConfig, closing_notes, explicit_workers, fixed_layout, model_and_data, train
    from conveyor.plan import EpochFactors
    from conveyor.runtime import load_checkpoint

    if args.resume:
        load_checkpoint(args.resume)  # fail here, with one line, rather than in every worker
    EpochFactors.load(args.epoch_factors)  # and so does a bad table of epochs
    cfg = config(TrainConfig, args)
    model, data = model_and_data(cfg)  # an unknown model or dataset fails here, before any worker starts
    fixed_layout(cfg, len(model), cfg.workers or explicit_workers(cfg) or 0)  # so does a layout that cannot work
    Emulation(cfg.network, cfg.devices, cfg.faults).check(cfg.workers or explicit_workers(cfg) or 4)  # and so on
    if os.environ.get("RANK", "0") == "0":  # under torchrun, say it once
        console.print(
            f"training {cfg.model} on {data.name}: {len(data.train_x)} training samples, batch {cfg.batch_size}"
        )
    result = train(cfg)
    if result:
        table = Table("epochs", "test accuracy", "final loss", "seconds", "samples/s", "run folder")
        table.add_row(
            str(result["epochs"]), f"{result['accuracy'][-1]:.3f}", f"{result['loss'][-1]:.3f}",
            f"{result['seconds']:.1f}", f"{result['samples_per_s']:.0f}", result["run_dir"],
        )  # fmt: skip
        console.print(table)
        for note in closing_notes(result):
            console.print(note)
        if args.json:
            write_json(args.json, result)
