"""``conveyor bench wan``: its options and its table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import config, console, floats, names, positive, write_json

__all__ = ["add_gaia_filter", "add_wan", "run_gaia_filter", "run_wan"]


def add_wan(which: Any) -> None:
    """The ``wan`` benchmark's parser under ``conveyor bench``."""
    bench = which.add_parser("wan", help="data centres joined by a slow WAN: gaia, diloco, BSP and one LAN (root)")
    bench.add_argument("--models", type=names, default=None, help="zoo models (default: vgg16,gpt)")
    bench.add_argument("--targets", type=floats, default=None, help="target accuracy per model (default: 0.95,0.33)")
    bench.add_argument(
        "--wan-bytes-per-s", type=floats, default=None, help="WAN bandwidths (default 6.25e6,3.125e7: 50, 250 Mbit/s)"
    )
    bench.add_argument("--sites", type=positive, default=None, help="data centres (default 3)")
    bench.add_argument("--per-site", type=positive, default=None, help="workers per data centre (default 2)")
    bench.add_argument("--modes", type=names, default=None, help="lan,bsp,gaia,diloco (default: all)")
    bench.add_argument("--epochs", type=positive, default=None, help="at most, per run (default 16)")
    bench.add_argument("--threshold", type=float, default=None, help="gaia's --wan-threshold (default 0.05)")
    bench.add_argument("--staleness", type=positive, default=None, help="gaia's --wan-staleness (default 1)")
    bench.add_argument("--period", type=positive, default=None, help="gaia's --wan-period (default 2)")
    bench.add_argument(
        "--estimate", choices=("auto", "on", "off"), default=None, help="gaia's --wan-estimate (default auto)"
    )
    bench.add_argument(
        "--seeds", type=positive, default=None, help="train from this many seeds from --seed on (default 1)"
    )
    bench.add_argument("--seed", type=int, default=None, help="the first of those seeds (default 0)")
    bench.add_argument("--json", type=Path, default=None, help="write the report here")
    bench.add_argument("--plot", type=Path, default=None, help="write accuracy against time here (PNG)")


def run_wan(args: argparse.Namespace) -> None:
    """Run the benchmark, print its table, write the JSON and the plot."""
    from conveyor.bench.wan import WanBenchConfig, run

    given = argparse.Namespace(**{k: v for k, v in vars(args).items() if v is not None})  # unset: the defaults
    result = run(config(WanBenchConfig, given), plot=str(args.plot) if args.plot else None)
    table = Table("model", "Mbit/s", "mode", "seed", "s", "epochs", "acc", "WAN B/sample", "x LAN", "vs bsp", "saved")
    table.title = "seconds to the target across data centres"
    for r in result["results"]:
        table.add_row(
            r["model"],
            f"{r['wan_bytes_per_s'] * 8 / 1e6:g}",
            r["mode"],
            str(r["seed"]),
            _num(r["seconds_to_target"], ".1f"),
            _num(r["epochs_to_target"], "d"),
            f"{r['final_accuracy']:.3f}",
            _num(r["wan_bytes_per_sample"], ".0f"),
            _num(r["lan_ratio"], ".2f"),
            _num(r["speedup_vs_bsp"], ".2f"),
            _num(r["bytes_saved"], ".1%"),
        )
    console.print(table)
    for case in result["over_seeds"] if result["config"]["seeds"] > 1 else []:
        console.print(
            f"{case['model']} at {case['wan_bytes_per_s'] * 8 / 1e6:g} Mbit/s, {case['mode']}: "
            f"x LAN {_num(case['lan_ratio_median'], '.2f')} median ({_num(case['lan_ratio_min'], '.2f')}-"
            f"{_num(case['lan_ratio_max'], '.2f')}), the target reached in {case['reached']} of {case['seeds']} seeds"
        )
    if args.plot:
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, result)


def add_gaia_filter(which: Any) -> None:
    """The ``gaia-filter`` benchmark's parser under ``conveyor bench``."""
    bench = which.add_parser("gaia-filter", help="Gaia's significance filter per update: fused against packed copies")
    bench.add_argument("--weights", type=positive, default=2_300_000, help="entries (default: vgg16's 2.3M)")
    bench.add_argument("--updates", type=positive, default=20, help="timed updates (the median counts)")
    bench.add_argument("--device", default="cpu", help="cpu or cuda")
    bench.add_argument("--json", type=Path, default=None, help="write the report here")


def run_gaia_filter(args: argparse.Namespace) -> None:
    """Run the filter benchmark and print its figures."""
    from conveyor.bench.gaia_filter import FilterBenchConfig, run

    result = run(config(FilterBenchConfig, args))
    console.print(
        f"{result['config']['weights']:,} weights: {1e3 * result['fused_s_per_update']:.2f} ms an update fused and "
        f"in place, {1e3 * result['packed_s_per_update']:.2f} ms on packed copies ({result['speedup']:.2f}x); "
        f"the same entries selected: {result['same_selection']}"
    )
    if args.json:
        write_json(args.json, result)


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)
