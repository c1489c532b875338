"""``conveyor bench stragglers``: FlexRR's modes under injected stragglers, its options and table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import config, console, names, positive, positive_or_auto, write_json

__all__ = ["add_stragglers", "run_stragglers"]


def add_stragglers(which: Any) -> None:
    """The ``stragglers`` benchmark's parser under ``conveyor bench``."""
    stragglers = which.add_parser("stragglers", help="FlexRR's modes under injected stragglers, against the ideal")
    stragglers.add_argument(
        "--cases",
        type=names,
        default=("resnet:4", "vgg:2-1:64"),
        help="model:replicas per stage[:batch size], e.g. resnet:4,vgg:2-1:64",
    )
    stragglers.add_argument("--cores", type=float, default=0.45, help="each worker's device, in CPU cores")
    stragglers.add_argument("--network", default="2:1.25e9,2:1.25e8", help="the emulated topology")
    stragglers.add_argument("--epochs", type=positive, default=20)
    stragglers.add_argument("--batch-size", type=positive, default=256, help="where a case gives none")
    stragglers.add_argument(
        "--chunks", type=positive_or_auto, default=2, help="chunks each replica owns per batch, or auto"
    )
    stragglers.add_argument("--slack", type=positive, default=1, help="flexrr's and slack's")
    stragglers.add_argument(
        "--no-stale-correction",
        dest="stale_correction",
        action="store_false",
        help="take slack's gradients at the current weights, not the weights predicted slack updates ahead",
    )
    stragglers.add_argument(
        "--equal-shares", action="store_true", help="every replica owns as many chunks (default: weighted by speed)"
    )
    stragglers.add_argument(
        "--cpu-slice",
        type=float,
        default=0.005,
        help="seconds an emulated device runs before each stop of its quota (short: a slowed device is slowed "
        "within a step, not stopped for one)",
    )
    stragglers.add_argument("--period", type=float, default=1.0, help="seconds between the patterns' events")
    stragglers.add_argument("--seed", type=int, default=0, help="the patterns', the weights' and the data's seed")
    stragglers.add_argument("--patterns", type=names, default=None, help="e.g. slow-worker,none (default: all)")
    stragglers.add_argument(
        "--modes",
        type=names,
        default=None,
        help="e.g. off,flexrr; ddp: PyTorch's DistributedDataParallel (default: live, flexrr, backup, off, ddp)",
    )
    stragglers.add_argument("--repeats", type=positive, default=2, help="runs of each case, pattern and mode")
    stragglers.add_argument("--keep", type=Path, default=None, help="keep every run's folder here")
    stragglers.add_argument("--json", type=Path, default=None, help="write the report here")
    stragglers.add_argument("--plot", type=Path, default=None, help="write the ratios to the ideal here (PNG)")


def run_stragglers(args: argparse.Namespace) -> None:
    """Every case, pattern and mode against the ideal; prints the table and the goals."""
    from conveyor.bench.stragglers import PATTERNS, StragglersConfig, run

    given = {"patterns": args.patterns or tuple(PATTERNS), "modes": args.modes or StragglersConfig.modes}
    cfg = config(StragglersConfig, argparse.Namespace(**{**vars(args), **given}))
    report = run(cfg, str(args.plot) if args.plot else None, str(args.keep) if args.keep else None)
    table = Table(
        "case",
        "pattern",
        "mode",
        "seconds (median)",
        "runs' spread",
        "ideal s",
        "ratio",
        "final acc",
        "samples moved",
        "backed up",
        "dropped",
        "wait s",
        title=f"{cfg.epochs} epochs, each worker {cfg.cores:g} cores, {cfg.repeats} runs each",
    )
    for r in report["results"]:
        table.add_row(
            f"{r['model']}:{r['layout']}",
            r["pattern"],
            r["mode"],
            f"{r['seconds']:.1f}",
            f"{100 * r['spread']:.0f}%",
            f"{r['ideal_seconds']:.1f}",
            f"{r['ratio_to_ideal']:.2f}",
            f"{r['final_accuracy']:.3f}",
            *(_median(r[k], "{:.0f}") for k in ("samples_moved", "samples_backed_up", "samples_dropped")),
            _median(r["wait_s"], "{:.1f}"),
        )
    console.print(table)
    for f in report["failed"]:
        console.print(f"[red]failed[/red] {f['model']}:{f['layout']} {f['pattern']} {f['mode']}: {f['error']}")
    goals, targets = report["goals"], report["goals"]["targets"]
    for where, best in goals["best_mode"].items():
        console.print(f"best on {where}: {best['mode']} at {best['ratio_to_ideal']:.2f}x the ideal")
    within = ", ".join(f"{p} {x}x" for p, x in targets["ratio_to_ideal"].items())
    console.print(f"modes within {within} of the ideal, {targets['accuracy_points']} point of accuracy: {goals['met']}")
    console.print(f"off at least {targets['off_ratio_to_ideal_at_least']}x on slowed workers: {goals['off_met']}")
    spread = targets["no_jitter_spread_at_most"]
    console.print(f"every mode's no-jitter runs within {100 * spread:.0f}%: {goals['no_jitter_spread_met']}")
    if args.plot:
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)


def _median(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)
