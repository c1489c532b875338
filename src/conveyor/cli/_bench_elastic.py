"""``conveyor bench elastic`` and ``conveyor bench spot``: Proteus' benchmarks, their options and tables."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import config, console, names, positive, sizes, write_json

__all__ = ["add_elastic", "add_spot", "run_elastic", "run_spot"]


def add_elastic(which: Any) -> None:
    """The ``elastic`` benchmark's parser under ``conveyor bench``."""
    elastic = which.add_parser("elastic", help="revocations and additions, against torchrun's checkpoint-restart")
    elastic.add_argument("--model", default="vgg16")
    elastic.add_argument("--workers", type=positive, default=6)
    elastic.add_argument("--reliable", type=positive, default=1, help="reliable workers (the first ones)")
    elastic.add_argument("--revoke", type=positive, default=3, help="transient workers revoked at once (the last)")
    elastic.add_argument("--grace", type=float, default=5.0, help="seconds from a notice to the kill")
    elastic.add_argument("--epochs", type=int, default=24, help="0: measure the stages only (--stage-workers)")
    elastic.add_argument("--batch-size", type=positive, default=64)
    elastic.add_argument("--lr", type=float, default=0.05)
    elastic.add_argument("--seed", type=int, default=0)
    elastic.add_argument("--checkpoint-every", type=positive, default=None, help="torchrun's (default: an epoch)")
    elastic.add_argument("--max-restarts", type=positive, default=5, help="torchrun's")
    elastic.add_argument(
        "--stage-workers",
        type=sizes,
        default=(),
        help="also measure each AgileML stage's "
        "samples/s at these worker counts, e.g. 2,3,4,6 (with --epochs 0: only that)",
    )
    elastic.add_argument("--stage-epochs", type=positive, default=3, help="epochs per stage measurement")
    elastic.add_argument(
        "--elastic-layout",
        choices=("data", "pipeline"),
        default="data",
        help="conveyor's layout (torchrun's baseline stays data parallel)",
    )
    elastic.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    elastic.add_argument("--json", type=Path, default=None, help="write the report here")


def add_spot(which: Any) -> None:
    """The ``spot`` benchmark's parser under ``conveyor bench``."""
    spot = which.add_parser("spot", help="on-demand, checkpoint-restart, elastic and BidBrain over spot traces")
    spot.add_argument(
        "--trace",
        action="append",
        type=names,
        default=None,
        help="a trace file, repeatable or comma-separated (default: the four of ../shared)",
    )
    spot.add_argument("--billing", choices=("per-second", "hourly-2016"), default="per-second")
    spot.add_argument("--work", type=float, default=5e6, help="samples to train")
    spot.add_argument("--fleet", type=positive, default=8, help="machines of the fixed-fleet policies")
    spot.add_argument("--reliable", type=positive, default=1, help="on-demand machines of the reliable tier")
    spot.add_argument("--machines", type=positive, default=16, help="at most this many machines per market")
    spot.add_argument("--policies", type=names, default=None, help="e.g. on-demand,bidbrain (default: all)")
    spot.add_argument("--elastic", type=Path, default=None, help="measured costs: a conveyor bench elastic report")
    spot.add_argument("--json", type=Path, default=None, help="write the report here")
    spot.add_argument("--plot", type=Path, default=None, help="write machines held over time here (PNG)")


def run_elastic(args: argparse.Namespace) -> None:
    """Revocations and additions against torchrun's checkpoint-restart; prints the tables."""
    import tempfile

    from conveyor.bench.elastic import ElasticBenchConfig, run

    cfg = config(ElasticBenchConfig, args)
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-elastic-") as tmp:
        report = run(cfg, args.keep or Path(tmp))
    if report.get("stages"):
        stages = Table("workers", "transient:reliable", "stage", "samples/s", title="AgileML's stages, forced")
        for r in report["stages"]:
            stages.add_row(
                str(r["workers"]), f"{r['transient_per_reliable']:g}", str(r["stage"]), f"{r['samples_per_s']:.0f}"
            )
        console.print(stages)
    if "uninterrupted" not in report:
        if args.json:
            write_json(args.json, report)
        return
    table = Table(
        "job",
        "event",
        "notice",
        "recovery s",
        "steps redone",
        title=f"{cfg.model}: {cfg.workers} workers, {cfg.reliable} reliable; {cfg.revoke} revoked at once",
    )
    for job in ("conveyor", "torchrun"):
        for e in report[job]["events"]:
            recovery = "-" if e["recovery_s"] is None else f"{e['recovery_s']:.2f}"
            table.add_row(job, e["kind"], str(e["notice"]), recovery, str(e["steps_redone"]))
    console.print(table)
    if cfg.elastic_layout == "pipeline":
        layouts = Table("generation", "why", "blocks per stage", "replicas", "state from", title="conveyor's pipelines")
        for g in report["conveyor"]["generations"]:
            layouts.add_row(
                str(g["gen"]),
                g["reason"],
                "-".join(map(str, g["layout"]["balance"])),
                "-".join(map(str, g["layout"]["replicas"])),
                g["from"],
            )
        console.print(layouts)
    for job in ("uninterrupted", "conveyor", "torchrun"):
        r = report[job]
        console.print(f"{job}: final accuracy {r['final_accuracy']}, {r['seconds']:.1f} s")
    console.print(f"goals: {report['goals']}")
    if args.json:
        write_json(args.json, report)


def run_spot(args: argparse.Namespace) -> None:
    """Acquisition policies over spot traces; prints the costs."""
    from conveyor.bench.spot import MEASURED, SpotConfig, costs_from_elastic, run
    from conveyor.elastic import SPOT_POLICIES

    measured = {**MEASURED, **(costs_from_elastic(args.elastic) if args.elastic else {})}
    given: dict[str, Any] = {"policies": args.policies or SPOT_POLICIES, "measured": measured}
    if args.trace:
        given["traces"] = tuple(t for group in args.trace for t in group)
    cfg = config(SpotConfig, argparse.Namespace(**{**vars(args), **given}))
    report = run(cfg, str(args.plot) if args.plot else None)
    table = Table(
        "policy",
        "cost $",
        "hours",
        "$ per 1M samples",
        "revocations",
        "additions",
        "samples lost",
        title=f"{cfg.work:.3g} samples, {cfg.billing} billing",
    )
    for r in report["results"]:
        hours = f"{r['seconds'] / 3600:.2f}" + ("" if r["finished"] else " (unfinished)")
        table.add_row(
            r["policy"],
            f"{r['cost']:.2f}",
            hours,
            f"{r['cost_per_work']:.3f}",
            str(r["revocations"]),
            str(r["additions"]),
            f"{r['work_lost']:.3g}",
        )
    console.print(table)
    goals = report["goals"]
    if "vs_on_demand" in goals:
        console.print(
            f"bidbrain / on-demand cost per work {goals['vs_on_demand']:.2f} (goal <= 0.4): {goals['vs_on_demand_met']}"
        )
    if "vs_checkpoint_restart" in goals:
        console.print(
            f"bidbrain / checkpoint-restart cost per work {goals['vs_checkpoint_restart']:.2f} (<= 0.7): "
            f"{goals['vs_checkpoint_restart_met']}; time {goals['time_vs_checkpoint_restart']:.2f}x "
            f"(goal <= 1): {goals['time_met']}"
        )
    if args.plot:
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)
