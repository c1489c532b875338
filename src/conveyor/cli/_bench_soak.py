"""``conveyor bench soak``: its options and its tables."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import config, console, names, positive, write_json

__all__ = ["add_soak", "run_soak"]


def add_soak(which: Any) -> None:
    """The ``soak`` benchmark's parser under ``conveyor bench`` (unset options: the config's defaults)."""
    bench = which.add_parser("soak", help="long runs: memory, descriptors, threads and store keys hold steady (root)")
    bench.add_argument("--minutes", type=float, default=None, help="each job's length (default 20)")
    bench.add_argument("--jobs", type=names, default=None, help="data-parallel,elastic (default: both)")
    bench.add_argument("--workers", type=positive, default=None, help="each job's (default 3)")
    bench.add_argument("--every", type=float, default=None, help="seconds between a worker's samples (default 10)")
    bench.add_argument("--warmup", type=float, default=None, help="minutes not judged (default 2)")
    bench.add_argument("--cores", type=float, default=None, help="data-parallel: each device's cores (default 0.45)")
    bench.add_argument("--stragglers", default=None, help="data-parallel: the mode (default flexrr)")
    bench.add_argument(
        "--change-every", type=float, default=None, help="elastic: seconds between revocations and additions (15)"
    )
    bench.add_argument("--busy", type=int, default=None, help="elastic: processes beside it that want a core (2)")
    bench.add_argument("--seed", type=int, default=None, help="the patterns', weights' and data's (default 0)")
    bench.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    bench.add_argument(
        "--judge", type=Path, default=None, help="run nothing: judge again the soak kept in this --keep folder"
    )
    bench.add_argument("--json", type=Path, default=None, help="write the report here")
    bench.add_argument("--plot", type=Path, default=None, help="write the series over time here (PNG)")


def run_soak(args: argparse.Namespace) -> None:
    """Run the soak, print its tables, write the JSON and the plot."""
    from conveyor.bench.soak import GOALS, SERIES, SoakConfig, judge, run

    given = argparse.Namespace(**{k: v for k, v in vars(args).items() if v is not None})  # unset: the defaults
    cfg = config(SoakConfig, given)
    plot = str(args.plot) if args.plot else None
    if args.judge:
        report = judge(cfg, args.judge, plot)
    else:
        console.print(f"soaking {', '.join(cfg.jobs)}: {cfg.minutes:g} minutes each")
        report = run(cfg, plot, str(args.keep) if args.keep else None)
    runs = Table("job", "seconds", "epochs", "final acc", "committed steps lost", "false losses", "error")
    for r in report["runs"]:
        seconds, acc = ("-", "-") if r["error"] else (f"{r['seconds']:.0f}", f"{r['final_accuracy']:.3f}")
        lost = [str(r.get(k, "-")) for k in ("committed_steps_lost", "false_losses")]
        runs.add_row(r["job"], seconds, str(r["epochs"]), acc, *lost, r["error"] or "")
    runs.columns[0].no_wrap = True
    console.print(runs)
    title = f"peak after {cfg.warmup:g} minutes -> peak at the end: growth (goal < {GOALS['growth']:.0%})"
    growths = Table("job", "worker", "RSS MB", "descriptors", "threads", "store keys", title=title)
    for job, worker, pid in sorted({(g["job"], g["worker"], g["pid"]) for g in report["growth"]}):
        per = {g["series"]: g for g in report["growth"] if g["pid"] == pid}
        growths.add_row(job, str(worker), *(_growth(per.get(s), 1e-6 if s == "rss_bytes" else 1) for s in SERIES))
    growths.columns[0].no_wrap = True
    console.print(growths)
    console.print(f"goals met: {report['goals']['met']}")
    if args.plot:
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)


def _growth(g: dict[str, Any] | None, scale: float) -> str:
    """A series' cell: its first and last peaks and their growth, then its first and last floors."""
    if g is None:
        return "-"
    floor = f"{g['floor_first'] * scale:.0f} -> {g['floor_last'] * scale:.0f}"
    return f"{g['first'] * scale:.0f} -> {g['last'] * scale:.0f}: {g['growth']:+.1%} (floor {floor})"
