"""``conveyor bench overhead``: its options and its table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import config, console, finish_report, names, positive

__all__ = ["add_overhead", "run_overhead"]


def add_overhead(which: Any) -> None:
    """The ``overhead`` benchmark's parser under ``conveyor bench``."""
    over = which.add_parser("overhead", help="one worker of conveyor train against a plain PyTorch loop")
    over.add_argument("--models", type=names, default=None, help="on the CPU (default: mlp,vgg16,gpt)")
    over.add_argument(
        "--gpu-models",
        type=names,
        default=None,
        help="on CUDA, where there is a GPU (default: mlp,vgg16,gpt,resnet18,gpt2)",
    )
    over.add_argument(
        "--devices", type=names, default=None, help="cpu, cuda or both (default: both, cuda where present)"
    )
    over.add_argument(
        "--no-contended",
        dest="contended",
        action="store_false",
        default=None,
        help="skip the CPU runs beside a busy process",
    )
    over.add_argument("--repeats", type=positive, default=None, help="runs of each, alternating (default 3)")
    over.add_argument("--epochs", type=positive, default=None, help="every case's epochs (default: each its own)")
    over.add_argument(
        "--profile", default=None, metavar="DIR", help="each case under torch.profiler: tables, timelines"
    )
    over.add_argument("--json", type=Path, default=None, help="write the report here")
    over.add_argument("--plot", type=Path, default=None, help="Conveyor's speed over the plain loop's, per case (PNG)")


def run_overhead(args: argparse.Namespace) -> None:
    """Run the benchmark, print its table and goals, write the JSON and the plot."""
    from conveyor.bench.overhead import OverheadBenchConfig, plot, run

    given = {k: v for k, v in vars(args).items() if v is not None}  # unset options keep the config's defaults
    result = run(config(OverheadBenchConfig, argparse.Namespace(**given)))
    columns = ("model", "device", "busy process", "plain samples/s", "threads", "conveyor samples/s", "ratio")
    title = f"one worker against a plain loop ({result['machine']['gpu'] or 'CPU'})"
    table = Table(*columns, "same threads", "paired", "predicted", "error", title=title)
    for r in result["results"]:
        table.add_row(
            r["model"],
            r["device"],
            "yes" if r["contended"] else "no",
            f"{r['plain_samples_per_s']:.0f}",
            str(r["plain_threads"] or "-"),
            f"{r['conveyor_samples_per_s']:.0f}",
            f"{r['ratio']:.2f}x",
            "-" if r["same_threads_ratio"] is None else f"{r['same_threads_ratio']:.2f}x",
            f"{r['paired_ratio']:.2f}x",
            f"{r['predicted_samples_per_s']:.0f}",
            f"{r['prediction_error']:+.0%}",
        )
    console.print(table)
    finish_report(args, result, plot)
