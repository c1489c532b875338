"""``conveyor emulate check``: measure an emulated cluster's links and devices against their spec."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import add_emulation, console, positive, write_json
from conveyor.errors import InputError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    emulate = sub.add_parser("emulate", help="an emulated shared cluster on this machine (needs root)")
    which = emulate.add_subparsers(dest="emulate", required=True)
    check = which.add_parser("check", help="measure every emulated link and device and print them beside the spec")
    add_emulation(check, faults=False, cpu_slice=True)
    check.add_argument("--workers", type=positive, default=None, help="default: the topology's or the devices' count")
    check.add_argument("--json", type=Path, default=None, help="write the report here")


def run(args: argparse.Namespace) -> None:
    from conveyor.emulate import Emulation, check_cluster
    from conveyor.plan import Topology

    if not (args.network or args.devices):
        raise InputError("conveyor emulate check needs --network, --devices or both")
    workers = args.workers or (Topology.parse(args.network).workers if args.network else len(args.devices.split(",")))
    report = check_cluster(Emulation(network=args.network, devices=args.devices, cpu_slice=args.cpu_slice), workers)
    if report["links"]:
        links = Table("from", "to", "spec MB/s", "measured MB/s", "error", "spec latency", "measured latency")
        for link in report["links"]:
            error = link["measured_bytes_per_s"] / link["spec_bytes_per_s"] - 1
            links.add_row(
                str(link["from"]),
                str(link["to"]),
                f"{link['spec_bytes_per_s'] / 1e6:.2f}",
                f"{link['measured_bytes_per_s'] / 1e6:.2f}",
                f"{error:+.1%}",
                f"{link['spec_latency_s'] * 1e6:.0f} us",
                f"{link['measured_latency_s'] * 1e6:.0f} us",
            )
        console.print(links)
    devices = Table(
        "worker",
        "device",
        "spec cores",
        "measured cores (alone)",
        "share of a core (alone)",
        "measured cores (all busy)",
    )
    for row in report["devices"]:
        spec = "unlimited" if row["spec_cores"] is None else f"{row['spec_cores']:g}"
        devices.add_row(
            str(row["worker"]),
            row["device"],
            spec,
            f"{row['measured_cores']:.3f}",
            f"{row['measured_share']:.3f}",
            f"{row['measured_cores_all_busy']:.3f}",
        )
    console.print(devices)
    if args.json:
        write_json(args.json, report)
