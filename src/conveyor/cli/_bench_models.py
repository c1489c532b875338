"""``conveyor bench models``: its options and its tables."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import config, console, names, positive, write_json

__all__ = ["add_models", "run_models"]


def add_models(which: Any) -> None:
    """The ``models`` benchmark's parser under ``conveyor bench``."""
    bench = which.add_parser("models", help="users' own models split by torch.export against them unsplit")
    bench.add_argument("--models", type=names, default=None, help="cases (default: module-mlp,gpt2,resnet)")
    bench.add_argument("--workers", type=positive, default=None, help="for the planner's layout (default 4)")
    bench.add_argument("--epochs", type=positive, default=None, help="every case's epochs (default: each its own)")
    bench.add_argument(
        "--memory-args",
        default=None,
        metavar="NAME=VALUE,...",
        help="the memory case's TwinMLP (default width=4096,depth=4: 202 MB of weights); off: none",
    )
    bench.add_argument("--json", type=Path, default=None, help="write the report here")


def run_models(args: argparse.Namespace) -> None:
    """Run the benchmark, print its tables, write the JSON."""
    from conveyor.bench.models import MEMORY, ModelsBenchConfig, run

    given = {k: v for k, v in vars(args).items() if v is not None and k != "memory_args"}  # unset: the defaults
    if args.memory_args is not None:
        given["memory"] = None if args.memory_args == "off" else replace(MEMORY, model_args=args.memory_args)
    result = run(config(ModelsBenchConfig, argparse.Namespace(**given)))
    speed = Table("case", "plain unsplit", "plain split", "split/unsplit", "conveyor 1 worker", "zoo twin", "planned")
    speed.title = "training samples/s (one worker unless planned)"
    layouts = Table("case", "planned layout", "peak MB per worker", "accuracy: plain", "2 stages")
    for r in result["results"]:
        planned, twin = r["planned"], r["twin"]
        speed.add_row(
            r["case"],
            f"{r['plain_unsplit_samples_per_s']:.0f}",
            f"{r['plain_split_samples_per_s']:.0f}",
            f"{r['split_over_unsplit']:.2f}",
            f"{r['conveyor_one_worker']['samples_per_s']:.0f}",
            "-" if twin is None else f"{twin['samples_per_s']:.0f} ({twin['model']})",
            f"{planned['samples_per_s']:.0f}",
        )
        layout = planned["layout"]
        layouts.add_row(
            r["case"],
            f"{layout['schedule']} {layout['balance']} x {layout['replicas']}",
            " ".join(f"{b / 1e6:.0f}" for b in planned["peak_rss_bytes"]),
            " ".join(f"{a:.2f}" for a in r["plain_accuracy"]),
            " ".join(f"{a:.2f}" for a in r["two_stages"]["accuracy"]),
        )
    console.print(speed)
    console.print(layouts)
    memory = result["memory"]
    if memory is not None:
        built = Table("built", "peak MB per worker", "samples/s", "accuracy")
        built.title = (
            f"{memory['model']} {memory['model_args']} ({memory['weight_bytes'] / 1e6:.0f} MB of weights), 2 stages"
        )
        for how in ("whole", "stage"):
            job = memory[how]
            built.add_row(
                "whole model in every worker" if how == "whole" else "each worker its stage",
                " ".join(f"{b / 1e6:.0f}" for b in job["peak_rss_bytes"]),
                f"{job['samples_per_s']:.0f}",
                " ".join(f"{a:.2f}" for a in job["accuracy"]),
            )
        console.print(built)
    if args.json:
        write_json(args.json, result)
