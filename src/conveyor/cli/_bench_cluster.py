"""``conveyor bench cluster``: its options and its table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import console, floats, names, sizes, write_json

__all__ = ["add_cluster", "run_cluster"]


def add_cluster(which: Any) -> None:
    """The ``cluster`` benchmark's parser under ``conveyor bench``."""
    clus = which.add_parser("cluster", help="Gavel: agnostic against aware LAS under load, solve times, fidelity")
    clus.add_argument("--rates", type=floats, default=None, help="jobs per hour (default 0.5,1,...,3.5)")
    clus.add_argument("--window", type=sizes, default=None, help="job ids START,END that count (default 1000,1500)")
    clus.add_argument(
        "--parts",
        type=names,
        default=("sweep", "solve", "fidelity"),
        help="sweep, solve, fidelity (root: runs real jobs on emulated devices)",
    )
    clus.add_argument("--reuse", type=Path, default=None, help="take the parts not run from this earlier report")
    clus.add_argument("--keep", type=Path, default=None, help="the real run's folder (default a temporary one)")
    clus.add_argument("--json", type=Path, default=None, help="write the report here")
    clus.add_argument("--plot", type=Path, default=None, help="average JCT against load (PNG)")


def run_cluster(args: argparse.Namespace) -> None:
    """Run the chosen parts (or reuse an earlier report's), print the table and goals, write JSON and plot."""
    import tempfile

    from conveyor.bench.cluster import ClusterBenchConfig, fidelity, jct_vs_load, load_report, plot, report, solve_times

    given: dict[str, Any] = {}
    if args.rates:
        given["rates"] = args.rates
    if args.window:
        given["window"] = tuple(args.window)
    cfg = ClusterBenchConfig(**given)
    old = load_report(args.reuse) if args.reuse else {}
    rows = jct_vs_load(cfg) if "sweep" in args.parts else old.get("jct_vs_load", [])
    solves = solve_times(cfg, cfg.policies) if "solve" in args.parts else old.get("solve_s_by_policy", {})
    sweep_solves = (
        solve_times(cfg, cfg.policies, sweep_cluster=True)
        if "solve" in args.parts
        else old.get("solve_s_sweep_cluster", {})
    )
    fid = old.get("fidelity")
    if "fidelity" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            fid = fidelity(cfg, args.keep or Path(tmp))
    result = report(cfg, rows, solves, fid, sweep_solves)
    table = Table("jobs/h", *cfg.policies, "agnostic / aware", title="average JCT of the window's jobs (hours)")
    for rate, ratio in result.get("jct_ratio_by_load", {}).items():
        jcts = [
            next(r["average_jct_s"] for r in rows if r["policy"] == p and r["jobs_per_hour"] == float(rate))
            for p in cfg.policies
        ]
        table.add_row(rate, *(f"{j / 3600:.1f}" for j in jcts), f"{ratio:.2f}")
    if rows:
        console.print(table)
        base = result["sustained_base_jct_s"] / 3600
        console.print(f"sustained jobs/h (avg JCT <= m x {base:.1f} h, by m): {result['sustained_jobs_per_hour']}")
    console.print(f"solve seconds: {result['solve_s_by_policy']}")
    console.print(f"solve seconds on n/4 devices per type (Gavel's Figure 12 setup): {sweep_solves}")
    if fid:
        console.print(f"fidelity: real {fid['real_jct_s']:.1f} s, simulated {fid['simulated_jct_s']:.1f} s")
    console.print(f"goals: {result['goals']}")
    if args.plot and rows:
        plot(rows, args.plot)
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, result)
