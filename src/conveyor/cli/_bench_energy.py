"""``conveyor bench energy``: its options and its table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import config, console, finish_report, names, positive, sizes

__all__ = ["add_energy", "run_energy"]


def add_energy(which: Any) -> None:
    """The ``energy`` benchmark's parser under ``conveyor bench``."""
    energy = which.add_parser("energy", help="Zeus: batch size and power limit over recurrences, on Zeus' traces")
    energy.add_argument(
        "--traces", type=Path, default=None, help="the folder of Zeus' published traces (default ../shared/zeus-traces)"
    )
    energy.add_argument("--gpus", type=names, default=None, help="e.g. v100,a40 (default: v100,a40,rtx6000,p100)")
    energy.add_argument("--recurrences", type=positive, default=50, help="recurrences of each job")
    energy.add_argument("--seeds", type=sizes, default=None, help="seeds to average over (default 1,2,3,4,5)")
    energy.add_argument("--eta", type=float, default=0.5, help="cost = eta * energy + (1 - eta) * max power * time")
    energy.add_argument("--beta", type=float, default=2.0, help="stop a recurrence past beta x the least cost")
    energy.add_argument("--json", type=Path, default=None, help="write the report here")
    energy.add_argument("--plot", type=Path, default=None, help="energy relative to the default's (PNG)")


def run_energy(args: argparse.Namespace) -> None:
    """Replay Zeus' traces, print the table and goals, write JSON and plot."""
    from conveyor.bench.energy import EnergyBenchConfig, default_traces, plot, report, run

    given = {k: v for k, v in vars(args).items() if v is not None}  # unset options keep the config's defaults
    cfg = config(EnergyBenchConfig, argparse.Namespace(**{**given, "traces": str(args.traces or default_traces())}))
    result = report(cfg, run(cfg))
    table = Table(
        "workload",
        "gpu",
        "b0",
        "default",
        "conveyor",
        "zeus",
        "oracle",
        "saved",
        "cost/zeus",
        title=f"energy to accuracy (MJ) over {cfg.recurrences} recurrences, eta {cfg.eta}",
    )
    by = {(r["workload"], r["gpu"], r["policy"]): r for r in result["results"]}
    for check in result["checks"]:
        key = (check["workload"], check["gpu"])
        mj = [
            f"{by[(*key, p)]['energy_j'] / 1e6:.1f}" if (*key, p) in by else "-"
            for p in ("default", "conveyor", "zeus", "oracle")
        ]
        versus = f"{check['cost_vs_zeus']:+.1%}" if "cost_vs_zeus" in check else "-"
        table.add_row(
            key[0].split("/")[0],
            key[1],
            str(by[(*key, "default")]["default_batch_size"]),
            *mj,
            f"{check['energy_reduction']:.1%}",
            versus,
        )
    console.print(table)
    finish_report(args, result, plot)
