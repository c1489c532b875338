"""``conveyor bench ...``: the benchmarks' options and their tables."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._bench_cluster import add_cluster, run_cluster
from conveyor.cli._bench_elastic import add_elastic, add_spot, run_elastic, run_spot
from conveyor.cli._bench_energy import add_energy, run_energy
from conveyor.cli._bench_models import add_models, run_models
from conveyor.cli._bench_overhead import add_overhead, run_overhead
from conveyor.cli._bench_soak import add_soak, run_soak
from conveyor.cli._bench_stragglers import add_stragglers, run_stragglers
from conveyor.cli._bench_wan import add_gaia_filter, add_wan, run_gaia_filter, run_wan
from conveyor.cli._bench_warmstart import add_warmstart, run_warmstart
from conveyor.cli._common import add_emulation, config, console, floats, names, positive, sizes, write_json
from conveyor.cli._markets import add_bench as add_markets
from conveyor.cli._markets import run_bench as run_markets

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks that write JSON")
    which = bench.add_subparsers(dest="bench", required=True)
    for add in (_add_pipedream, _add_predictions, _add_emulated):
        add(which)
    add_stragglers(which)
    add_elastic(which)
    add_spot(which)
    add_cluster(which)
    add_energy(which)
    add_warmstart(which)
    add_overhead(which)
    add_models(which)
    add_wan(which)
    add_gaia_filter(which)
    add_soak(which)
    add_markets(which)


def _add_pipedream(which: Any) -> None:
    """PipeDream's benchmarks: the schedules, plans against runs, time to accuracy, convergence."""
    sched = which.add_parser("schedules", help="pipeline efficiency of every schedule on fixed-latency stages")
    sched.add_argument("--stages", type=positive, default=4)
    sched.add_argument("--microbatches", type=positive, default=8)
    sched.add_argument("--steps", type=positive, default=20)
    sched.add_argument("--forward-ms", type=float, default=10.0)
    sched.add_argument("--backward-ms", type=float, default=20.0)
    sched.add_argument("--repeats", type=positive, default=3, help="interleaved rounds; the median is reported")
    sched.add_argument("--json", type=Path, default=None, help="write the report here")
    add_emulation(sched, faults=False)
    pvr = which.add_parser("plan-vs-run", help="run planned pipelines and compare their throughput with the plan")
    pvr.add_argument("--minibatches", type=positive, default=60, help="minibatches per timed run")
    pvr.add_argument("--repeats", type=positive, default=3, help="timed runs per plan; the median is reported")
    pvr.add_argument("--up-to", type=positive, default=6, help="the shortlist's workers: 1 to this many")
    pvr.add_argument("--candidates", type=positive, default=4, help="the shortlist's fastest layouts run")
    pvr.add_argument("--json", type=Path, default=None, help="write the report here")
    add_emulation(pvr, faults=False)
    tta = which.add_parser("tta", help="time to accuracy of data parallelism and each pipeline schedule")
    tta.add_argument("--model", default="mlp")
    tta.add_argument("--dataset", default=None)
    tta.add_argument("--workers", type=positive, default=4)
    tta.add_argument("--target", type=float, default=0.9, help="test accuracy to reach")
    tta.add_argument("--epochs", type=positive, default=20, help="give up after this many")
    tta.add_argument("--batch-size", type=positive, default=64)
    tta.add_argument("--microbatches", type=positive, default=4)
    tta.add_argument("--lr", type=float, default=0.05)
    tta.add_argument("--strategies", type=names, default=None, help="e.g. dp,ddp,pipedream (default: all)")
    tta.add_argument("--local-epochs", type=int, default=2, help="epochs on local processes for comm_fraction")
    tta.add_argument("--seed", type=int, default=0, help="the initial weights and the data order")
    tta.add_argument("--seeds", type=positive, default=1, help="train from --seed, --seed + 1, ...: this many")
    tta.add_argument("--json", type=Path, default=None, help="write the report here")
    add_emulation(tta, faults=False)
    tta.add_argument("--plot", type=Path, default=None, help="write accuracy against time here (PNG)")

    conv = which.add_parser("convergence", help="epochs to target per zoo model, schedule and correction, over seeds")
    conv.add_argument("--models", type=names, default=("mlp", "vgg", "resnet", "gpt", "vgg16"), help="e.g. mlp,vgg")
    conv.add_argument("--strategies", type=names, default=None, help="e.g. dp,2bw,2bw/plain (default: all)")
    conv.add_argument("--seeds", type=positive, default=3)
    conv.add_argument("--workers", type=positive, default=4)
    conv.add_argument("--json", type=Path, default=None, help="write the report (and its epoch factors) here")
    conv.add_argument("--plot", type=Path, default=None, help="write median epochs per strategy here (PNG)")


def _add_predictions(which: Any) -> None:
    pred = which.add_parser(
        "predictions", help="conveyor train's predicted against measured throughput, zoo models or your own"
    )
    pred.add_argument(
        "--models",
        type=names,
        default=("mlp", "vgg", "resnet", "gpt"),
        help="zoo models or your own (module:callable), e.g. mlp,examples.models:factory",
    )
    pred.add_argument("--dataset", default=None, help="every model's dataset (default: each model's own)")
    pred.add_argument(
        "--workers", type=positive, default=None, help="a fixed count (default: conveyor train's, fewer if faster)"
    )
    pred.add_argument("--epochs", type=positive, default=3, help="at least, per run")
    pred.add_argument(
        "--seconds", type=float, default=2.0, help="each run trains this long after its first epoch (default 2)"
    )
    pred.add_argument("--repeats", type=positive, default=2, help="runs per model")
    pred.add_argument(
        "--schedules", type=names, default=("auto",), help="auto, dp or schedules, e.g. flush,pipedream,dp"
    )
    pred.add_argument("--json", type=Path, default=None, help="write the report here")
    add_emulation(pred)


def _add_emulated(which: Any) -> None:
    """The emulated cluster's own benchmarks, and the planner's time."""
    emulate = which.add_parser("emulate", help="emulated links, quotas and set-up time against their spec (root)")
    emulate.add_argument("--devices", default="1,0.5,0.25,0.1", help="the CPU quotas to measure")
    emulate.add_argument("--seconds-per-link", type=float, default=2.0, help="each transfer's length at its rate")
    emulate.add_argument("--repeats", type=positive, default=3)
    emulate.add_argument("--json", type=Path, default=None, help="write the report here")
    costs = which.add_parser("costs", help="the planner's all-reduce and transfer terms on the emulated cluster (root)")
    costs.add_argument("--bandwidths", type=floats, default=(1.25e7, 1.25e8), help="bytes/s per link: 1.25e7,1.25e8")
    costs.add_argument("--replicas", type=sizes, default=(2, 4, 8), help="all-reduce group sizes")
    costs.add_argument("--sizes-mb", type=floats, default=(1.0, 10.0, 100.0), help="all-reduce sizes in MB")
    costs.add_argument("--repeats", type=positive, default=3)
    costs.add_argument("--json", type=Path, default=None, help="write the report here")
    planner = which.add_parser("planner", help="planning time for synthetic chains on growing clusters")
    planner.add_argument("--json", type=Path, default=None, help="write the report here")


def run(args: argparse.Namespace) -> None:
    """Run the benchmark ``args.bench`` names."""
    {
        "schedules": _schedules,
        "plan-vs-run": _plan_vs_run,
        "tta": _tta,
        "stragglers": run_stragglers,
        "predictions": _predictions,
        "planner": _planner,
        "emulate": _emulate,
        "costs": _costs,
        "convergence": _convergence,
        "spot": run_spot,
        "elastic": run_elastic,
        "cluster": run_cluster,
        "energy": run_energy,
        "warmstart": run_warmstart,
        "overhead": run_overhead,
        "models": run_models,
        "wan": run_wan,
        "gaia-filter": run_gaia_filter,
        "soak": run_soak,
        "markets": run_markets,
    }[args.bench](args)


def _convergence(args: argparse.Namespace) -> None:
    from conveyor.bench.convergence import STRATEGIES, ConvergenceConfig, run

    cfg = ConvergenceConfig(tuple(args.models), tuple(args.strategies or STRATEGIES), args.seeds, args.workers)
    report = run(cfg, plot=str(args.plot) if args.plot else None, progress=lambda what: console.print(f"[dim]{what}"))
    table = Table("model", "strategy", "epochs per seed", "median", "x dp", "goal", title="epochs to target")
    for model, per in report["results"].items():
        cap = report["targets"][model][1]
        for strategy, r in per.items():
            seeds = " ".join("-" if x["epochs_to_target"] is None else str(x["epochs_to_target"]) for x in r["runs"])
            median = f"{r['median_epochs']:g}" if r["reached"] else f"> {cap}"
            goal = {None: "", True: "met", False: "missed"}[r["goal_met"]]
            table.add_row(model, strategy, seeds, median, f"{r['factor']:.2f}", goal)
    console.print(table)
    if args.plot:
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)


def _schedules(args: argparse.Namespace) -> None:
    from conveyor.bench.schedules import BenchConfig, run

    cfg = config(BenchConfig, args)
    report = run(cfg)
    table = Table(
        "schedule",
        "efficiency",
        "theory",
        "vs theory",
        "samples/s",
        "vs torch 1F1B",
        "peak stash",
        "peak versions",
        title=f"P={cfg.stages} M={cfg.microbatches}, t_f={cfg.forward_ms} ms, t_b={cfg.backward_ms} ms",
    )
    for name, r in report["results"].items():
        table.add_row(
            name,
            f"{r['efficiency']:.4f}",
            f"{r['theory']:.4f}",
            f"{r['efficiency_vs_theory']:.4f}",
            f"{r['samples_per_s']:.1f}",
            f"{r['speedup_vs_torch_1f1b']:.2f}x",
            str(r.get("peak_stashed_per_worker", "")),
            str(r.get("peak_weight_versions_per_worker", "")),
        )
    console.print(table)
    if args.json:
        write_json(args.json, report)


def _planner(args: argparse.Namespace) -> None:
    from conveyor.bench.planner import run

    report = run()
    table = Table(
        "layers",
        "workers",
        "topology",
        "seconds",
        "config",
        "seconds, memory limit",
        "config",
        title=f"planning time (memory limit {report['config']['memory_bytes']:.3g} bytes per worker)",
    )
    for r in report["results"]:
        table.add_row(
            str(r["layers"]),
            str(r["workers"]),
            r["topology"],
            f"{r['seconds']:.3f}",
            r["config"][:24],
            f"{r['seconds_with_memory_limit']:.3f}",
            r["config_with_memory_limit"][:24],
        )
    console.print(table)
    if args.json:
        write_json(args.json, report)


def _tta(args: argparse.Namespace) -> None:
    from conveyor.bench.tta import STRATEGIES, TTAConfig, run

    cfg = config(TTAConfig, argparse.Namespace(**{**vars(args), "strategies": args.strategies or STRATEGIES}))
    report = run(cfg, plot=str(args.plot) if args.plot else None)

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    table = Table(
        "strategy",
        "layout",
        "s to target",
        "epochs",
        "final acc",
        "samples/s",
        "comm",
        "B/sample between",
        "speedup (predicted)",
        "peak MB",
        title=f"time to {cfg.target:g} test accuracy",
    )
    for name, r in report["results"].items():
        table.add_row(
            name,
            "-".join(map(str, r["layout"] or [])),
            num(r["seconds_to_target"], ".1f"),
            num(r["epochs_to_target"], "d"),
            f"{r['final_accuracy']:.3f}",
            f"{r['samples_per_s']:.0f}",
            num(r["comm_fraction"], ".0%"),
            num(r["bytes_between_servers_per_sample"], ".0f"),
            f"{num(r['measured_speedup'], '.2f')} ({num(r['predicted_speedup'], '.2f')})",
            f"{r['peak_rss_mb']:.0f}",
        )
    console.print(table)
    if goals := report["goals"]:
        console.print("PipeDream: " + ", ".join(f"{k} {v:.3g}" for k, v in goals.items() if isinstance(v, float)))
    if cfg.seeds > 1:
        for s in report["seeds"]:
            reached = f"seconds to target {s['seconds_to_target']}, epochs {s['epochs_to_target']}"
            console.print(f"seed {s['seed']}: {reached}")
        over = report["over_seeds"]
        console.print(f"over {cfg.seeds} seeds: {over['strategies']}; goals {over['targets']} met: {over.get('met')}")
    if args.plot:
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)


def _plan_vs_run(args: argparse.Namespace) -> None:
    from conveyor.bench.plan_vs_run import PlanVsRunConfig, run

    report = run(config(PlanVsRunConfig, args))
    table = Table("plan", "config", "measured samples/s", "simulated", "error", "planner (steady state)", "error")
    for r in report["results"] + report["candidates"]:
        table.add_row(
            r["case"],
            r["config"],
            f"{r['measured_samples_per_s']:.1f}",
            f"{r['simulated_samples_per_s']:.1f}",
            f"{r['error_vs_simulated']:+.1%}",
            f"{r['planner_samples_per_s']:.1f}",
            f"{r['error_vs_planner']:+.1%}",
        )
    console.print(table)
    chosen = report["chosen"]
    console.print(
        f"the planner's choice {chosen['config']} (candidate 1); the fastest measured {chosen['fastest_measured']}, "
        f"{chosen['shortfall']:.1%} ahead of it, the runs' spread {chosen['spread']:.1%}"
    )
    if args.json:
        write_json(args.json, report)


def _predictions(args: argparse.Namespace) -> None:
    from conveyor.bench.predictions import PredictionsConfig, run

    report = run(config(PredictionsConfig, args))
    table = Table(
        "model",
        "layout",
        "schedule",
        "predicted samples/s",
        "measured",
        "error",
        "one worker",
        "started",
        title="conveyor train: predicted against measured training throughput",
    )
    for r in report["results"]:
        table.add_row(
            r["model"],
            "-".join(map(str, r["replicas"])) + f" {r['balance']}",
            r["schedule"],
            f"{r['predicted_samples_per_s']:.0f}",
            f"{r['measured_samples_per_s']:.0f}",
            f"{r['error']:+.0%}",
            f"{r['single_worker_samples_per_s']:.0f}",
            str(r["workers_started"]),
        )
    console.print(table)
    console.print(f"same layout in every repeat: {report['same_layout']}; goal: {report['goal']}")
    if args.json:
        write_json(args.json, report)


def _emulate(args: argparse.Namespace) -> None:
    from conveyor.bench.emulate import EmulateBenchConfig, run

    report = run(config(EmulateBenchConfig, args))
    links = Table("rate", "spec MB/s", "measured MB/s", "error", title="links (two workers)")
    for link in report["links"]:
        error = "ceiling" if link["error"] is None else f"{link['error']:+.1%}"
        spec, measured = link["spec_bytes_per_s"] / 1e6, link["measured_bytes_per_s"] / 1e6
        links.add_row(link["rate"], f"{spec:.2f}", f"{measured:.2f}", error)
    console.print(links)
    devices = Table("spec cores", "measured cores", "error", title="devices (each alone)")
    for row in report["devices"]:
        devices.add_row(f"{row['spec_cores']:g}", f"{row['measured_cores']:.3f}", f"{row['error']:+.1%}")
    console.print(devices)
    setup = Table("workers", "set-up s", "tear-down s", title=f"latency: {report['latency']}")
    for row in report["setup"]:
        setup.add_row(str(row["workers"]), f"{row['setup_s']:.2f}", f"{row['teardown_s']:.2f}")
    console.print(setup)
    if args.json:
        write_json(args.json, report)


def _costs(args: argparse.Namespace) -> None:
    from conveyor.bench.costs import CostsBenchConfig, run

    report = run(config(CostsBenchConfig, args))
    allreduce = Table("network", "workers", "MB", "model s", "measured s", "error", title="all-reduce")
    for row in report["allreduce"]:
        allreduce.add_row(
            row["network"],
            str(row["workers"]),
            f"{row['bytes'] / 1e6:g}",
            f"{row['model_s']:.4f}",
            f"{row['measured_s']:.4f}",
            f"{row['error']:+.1%}",
        )
    console.print(allreduce)
    transfers = Table("network", "replicas per stage", "model s", "measured s", "error", title="activation transfers")
    for row in report["transfers"]:
        transfers.add_row(
            row["network"], row["stages"], f"{row['model_s']:.4f}", f"{row['measured_s']:.4f}", f"{row['error']:+.1%}"
        )
    console.print(transfers)
    overlap = Table(
        "network",
        "compute s",
        "transfers s",
        "summed s",
        "measured s",
        "error vs overlapped",
        title="sends during compute",
    )
    for row in report["overlap"]:
        overlap.add_row(
            row["network"],
            f"{row['compute_s']:.4f}",
            f"{row['transfer_s']:.4f}",
            f"{row['summed_s']:.4f}",
            f"{row['measured_s']:.4f}",
            f"{row['error']:+.1%}",
        )
    console.print(overlap)
    console.print(f"{report['within_10_percent']} of {report['cases']} runs within 10% of the model")
    if args.json:
        write_json(args.json, report)
