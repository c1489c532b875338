"""``conveyor markets simulate`` and ``conveyor bench markets``: deadline-aware spot policies over SkyPilot's traces."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import config, console, floats, names, positive, write_json

__all__ = ["add_bench", "add_parser", "run", "run_bench"]


def _policy_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--starts", type=positive, default=30, help="evenly spaced start points in the trace")
    parser.add_argument("--work-h", type=float, default=24.0, help="the job's hours on its on-demand machines")
    parser.add_argument("--deadline", type=float, default=1.5, help="the deadline, x the on-demand time")
    parser.add_argument("--warmup-h", type=float, default=72.0, help="trace before the first start (the model's past)")
    parser.add_argument("--discount", type=float, default=0.3, help="spot price / on-demand price")
    parser.add_argument("--target", type=float, default=0.99, help="the portfolio's survival probability")
    parser.add_argument("--move-every-h", type=float, default=6.0, help="the least hours between two moves")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--plot", type=Path, default=None, help="machines held and cost per work per policy (PNG)")


def add_parser(sub: Any) -> None:
    from conveyor.config import MARKET_POLICIES  # not conveyor.markets: its SciPy takes a second to import

    markets = sub.add_parser("markets", help="buy a job with a deadline from spot markets (Tributary, DISPA)")
    which = markets.add_subparsers(dest="markets_command", required=True)
    sim = which.add_parser("simulate", help="replay deadline-aware policies over a trace set")
    sim.add_argument(
        "--traces",
        type=Path,
        default=None,
        help="a folder of ZONE_TYPE_N.json traces (default: ../shared's 9 V100 zones, 45 days)",
    )
    sim.add_argument("--instances", type=names, default=(), help="keep these kinds, e.g. v100_1,k80_1 (default: all)")
    sim.add_argument("--machines", type=positive, default=1, help="the job's on-demand V100 machines")
    sim.add_argument(
        "--policies", type=names, default=MARKET_POLICIES, help=f"comma-separated from {', '.join(MARKET_POLICIES)}"
    )
    sim.add_argument("--billing", choices=("per-second", "hourly-2016"), default="per-second")
    _policy_options(sim)


def add_bench(which: Any) -> None:
    """The ``markets`` benchmark's parser under ``conveyor bench``."""
    bench = which.add_parser("markets", help="deadline policies over SkyPilot's spot traces, against their goals")
    bench.add_argument("--trace-sets", type=names, default=None, help="e.g. v100-9-zones (default: all three)")
    bench.add_argument("--policies", type=names, default=None, help="comma-separated (default: all)")
    bench.add_argument("--discounts", type=floats, default=(0.2, 0.3, 0.4, 0.5), help="the sweep's spot discounts")
    bench.add_argument(
        "--real", action="store_true", help="also drive a real elastic job with the portfolio (root: emulated cluster)"
    )
    bench.add_argument("--day-s", type=float, default=300.0, help="the real run's seconds per trace day")
    bench.add_argument("--keep", type=str, default=None, help="keep the real run's folders here")
    _policy_options(bench)


def run(args: argparse.Namespace) -> None:
    """``conveyor markets simulate``: every policy from every start; the table, and the JSON and plot asked for."""
    from conveyor.bench.markets import AVAILABILITY, TRACE_SETS, MarketsConfig, plot, simulate_set

    cfg = config(MarketsConfig, args)
    folder = args.traces or AVAILABILITY / TRACE_SETS["v100-9-zones"][0]
    report = simulate_set(cfg, folder, instances=tuple(args.instances), machines=args.machines, billing=args.billing)
    _table(report["summary"], f"{folder.name}: {cfg.starts} starts, deadline {cfg.deadline:g}x the on-demand time")
    if args.plot:
        plot(report, args.plot)
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)


def run_bench(args: argparse.Namespace) -> None:
    """``conveyor bench markets``: the benchmark's tables, goals, plot and report."""
    from conveyor.bench.markets import TRACE_SETS, MarketsConfig, plot
    from conveyor.bench.markets import run as bench

    given = {k: v for k, v in vars(args).items() if v is not None}
    cfg = config(MarketsConfig, argparse.Namespace(**given))
    report = bench(cfg)
    _table(report["summary"], f"cost per work and deadlines, spot at {cfg.discount:g}x on-demand")
    _table([r for r in report["sweep"] if r["billing"] == "hourly-2016"], "AWS's 2016 hourly billing")
    console.print(f"trace sets: {', '.join(cfg.trace_sets)} of {', '.join(TRACE_SETS)}")
    if report["real_mode"]:
        console.print(f"real mode: {report['real_mode']}")
    console.print(f"goals: {report['goals']}")
    if args.plot:
        plot(report, args.plot)
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)


def _table(rows: list[dict[str, Any]], title: str) -> None:
    table = Table(
        "trace set", "policy", "$ per V100-h (median)", "range", "x limit", "deadlines met", "finish h", title=title
    )
    for r in rows:
        span = f"{r['min_cost_per_work']:.3f}-{r['max_cost_per_work']:.3f}"
        rate = f"{r['deadline_rate']:.0%} of {r['starts']}"
        cost = f"{r['median_cost_per_work']:.3f}"
        table.add_row(
            r["trace_set"], r["policy"], cost, span, f"{r['vs_limit']:.2f}", rate, f"{r['median_finish_h']:.1f}"
        )
    console.print(table)
