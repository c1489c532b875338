"""``conveyor bench ...``: the benchmarks' options and their tables."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._bench_cluster import add_cluster, run_cluster
from conveyor.cli._bench_energy import add_energy, run_energy
from conveyor.cli._bench_overhead import add_overhead, run_overhead
from conveyor.cli._bench_warmstart import add_warmstart, run_warmstart
from conveyor.cli._common import add_emulation, config, console, floats, names, positive, sizes, write_json

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks that write JSON")
    which = bench.add_subparsers(dest="bench", required=True)
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
    tta.add_argument("--json", type=Path, default=None, help="write the report here")
    add_emulation(tta, faults=False)
    tta.add_argument("--plot", type=Path, default=None, help="write accuracy against time here (PNG)")

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
    stragglers.add_argument("--chunks", type=positive, default=2, help="chunks each replica owns per batch")
    stragglers.add_argument("--slack", type=positive, default=2)
    stragglers.add_argument("--period", type=float, default=1.0, help="seconds between the patterns' events")
    stragglers.add_argument("--seed", type=int, default=0, help="the patterns', the weights' and the data's seed")
    stragglers.add_argument("--patterns", type=names, default=None, help="e.g. slow-worker,none (default: all)")
    stragglers.add_argument("--modes", type=names, default=None, help="e.g. off,flexrr (default: all)")
    stragglers.add_argument("--keep", type=Path, default=None, help="keep every run's folder here")
    stragglers.add_argument("--json", type=Path, default=None, help="write the report here")
    stragglers.add_argument("--plot", type=Path, default=None, help="write the ratios to the ideal here (PNG)")
    conv = which.add_parser("convergence", help="epochs to target per zoo model, schedule and correction, over seeds")
    conv.add_argument("--models", type=names, default=("mlp", "vgg", "resnet", "gpt", "vgg16"), help="e.g. mlp,vgg")
    conv.add_argument("--strategies", type=names, default=None, help="e.g. dp,2bw,2bw/plain (default: all)")
    conv.add_argument("--seeds", type=positive, default=3)
    conv.add_argument("--workers", type=positive, default=4)
    conv.add_argument("--json", type=Path, default=None, help="write the report (and its epoch factors) here")
    conv.add_argument("--plot", type=Path, default=None, help="write median epochs per strategy here (PNG)")
    pred = which.add_parser("predictions", help="conveyor train's predicted against measured throughput, zoo models")
    pred.add_argument("--models", type=names, default=("mlp", "vgg", "resnet", "gpt"), help="e.g. mlp,vgg")
    pred.add_argument("--workers", type=positive, default=4)
    pred.add_argument("--epochs", type=positive, default=3)
    pred.add_argument("--repeats", type=positive, default=2, help="runs per model")
    pred.add_argument(
        "--schedules", type=names, default=("auto",), help="auto, dp or schedules, e.g. flush,pipedream,dp"
    )
    pred.add_argument("--json", type=Path, default=None, help="write the report here")
    add_emulation(pred)
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

    add_cluster(which)
    add_energy(which)
    add_warmstart(which)
    add_overhead(which)


def run(args: argparse.Namespace) -> None:
    """Run the benchmark ``args.bench`` names."""
    {
        "schedules": _schedules,
        "plan-vs-run": _plan_vs_run,
        "tta": _tta,
        "stragglers": _stragglers,
        "predictions": _predictions,
        "planner": _planner,
        "emulate": _emulate,
        "costs": _costs,
        "convergence": _convergence,
        "spot": _spot,
        "elastic": _elastic,
        "cluster": run_cluster,
        "energy": run_energy,
        "warmstart": run_warmstart,
        "overhead": run_overhead,
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


def _elastic(args: argparse.Namespace) -> None:
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


def _spot(args: argparse.Namespace) -> None:
    from conveyor.bench.spot import MEASURED, SpotConfig, costs_from_elastic, run
    from conveyor.elastic import POLICIES

    measured = {**MEASURED, **(costs_from_elastic(args.elastic) if args.elastic else {})}
    given: dict[str, Any] = {"policies": args.policies or POLICIES, "measured": measured}
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
    if args.plot:
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)


def _stragglers(args: argparse.Namespace) -> None:
    from conveyor.bench.stragglers import PATTERNS, StragglersConfig, run
    from conveyor.stragglers import MODES

    given = {"patterns": args.patterns or tuple(PATTERNS), "modes": args.modes or MODES}
    cfg = config(StragglersConfig, argparse.Namespace(**{**vars(args), **given}))
    report = run(cfg, str(args.plot) if args.plot else None, str(args.keep) if args.keep else None)
    table = Table(
        "case",
        "pattern",
        "mode",
        "seconds",
        "ideal s",
        "ratio",
        "final acc",
        "samples moved",
        "wait s",
        title=f"{cfg.epochs} epochs, each worker {cfg.cores:g} cores",
    )
    for r in report["results"]:
        wait = "-" if r["wait_s"] is None else f"{r['wait_s']:.1f}"
        table.add_row(
            f"{r['model']}:{r['layout']}",
            r["pattern"],
            r["mode"],
            f"{r['seconds']:.1f}",
            f"{r['ideal_seconds']:.1f}",
            f"{r['ratio_to_ideal']:.2f}",
            f"{r['final_accuracy']:.3f}",
            str(r["samples_moved"]),
            wait,
        )
    console.print(table)
    for f in report["failed"]:
        console.print(f"[red]failed[/red] {f['model']}:{f['layout']} {f['pattern']} {f['mode']}: {f['error']}")
    goals, targets = report["goals"], report["goals"]["targets"]
    console.print(
        f"flexrr within {targets['flexrr_ratio_to_ideal']}x of ideal on every case and pattern: {goals['flexrr_met']}; "
        f"off at least {targets['off_ratio_to_ideal_at_least']}x: {goals['off_met']}"
    )
    if args.plot:
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, report)


def _plan_vs_run(args: argparse.Namespace) -> None:
    from conveyor.bench.plan_vs_run import PlanVsRunConfig, run

    report = run(config(PlanVsRunConfig, args))
    table = Table("plan", "config", "measured samples/s", "simulated", "error", "planner (steady state)", "error")
    for r in report["results"]:
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
        )
    console.print(table)
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
