"""``conveyor cluster simulate|run``: the Gavel scheduler on a simulated cluster or on real jobs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Column, Table

from conveyor.cli._common import console, floats, names, positive, write_json
from conveyor.errors import InputError

if TYPE_CHECKING:
    from conveyor.cluster import ThroughputTable, TraceJob

__all__ = ["add_parser", "run"]

DEFAULT_POLICY = "max_min_fairness_perf"


def add_parser(sub: Any) -> None:
    cluster = sub.add_parser("cluster", help="schedule jobs on a heterogeneous cluster (Gavel's policies)")
    which = cluster.add_subparsers(dest="cluster_command", required=True)
    sim = which.add_parser("simulate", help="simulate a trace or generated jobs under one or more policies")
    _jobs(sim)
    sim.add_argument("--cluster", default="v100=36,p100=36,k80=36", help="devices per type, TYPE=COUNT,...")
    sim.add_argument("--per-server", type=positive, default=4, help="devices per server (placement)")
    sim.add_argument("--policy", type=names, default=(DEFAULT_POLICY,), help="one or more, comma-separated")
    sim.add_argument("--round-s", type=float, default=360.0, help="round length (Gavel: 6 minutes)")
    sim.add_argument("--throughputs", default=None, help="Gavel's throughput JSON (default ../shared/gavel)")
    sim.add_argument(
        "--space-sharing",
        action="store_true",
        help="let pairs of jobs share devices (co-located "
        "throughputs from the table); use with max_min_fairness_packing or gandiva",
    )
    sim.add_argument("--restart-s", type=float, default=0.0, help="seconds a job loses each time it moves")
    sim.add_argument(
        "--reallocate-s",
        type=float,
        default=0.0,
        help="run the policy at most this often (Gavel's simulator: 1920; 0: whenever jobs come or go)",
    )
    sim.add_argument("--window", default=None, help="job ids START:END whose completion times count")
    sim.add_argument("--max-hours", type=float, default=10000.0, help="stop simulating after this long")
    sim.add_argument("--prices", default="v100=3.06,p100=1.46,k80=0.90", help="dollars per device-hour")
    sim.add_argument("--json", type=Path, default=None, help="write every simulation's results here")
    sim.add_argument("--plot", type=Path, default=None, help="average JCT against load, one line per policy (PNG)")
    real = which.add_parser("run", help="run real conveyor train jobs on emulated devices, in rounds")
    _jobs(real)
    real.add_argument("--devices", default="fast=1.0:1,slow=0.25:1", help="TYPE=CORES:COUNT,... emulated devices")
    real.add_argument("--policy", default=DEFAULT_POLICY)
    real.add_argument("--round-s", type=float, default=60.0, help="round length in seconds")
    real.add_argument("--backend", choices=("local", "ray"), default="local", help="how jobs are launched")
    real.add_argument("--ray-address", default=None, help="a running Ray cluster (default: start a local one)")
    real.add_argument("--run-dir", type=Path, default=None, help="the run folder (default runs/cluster-TIME)")
    real.add_argument("--json", type=Path, default=None, help="also write the results here")


def _jobs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=None, help="jobs from a trace in Gavel's format")
    parser.add_argument("--jobs", type=positive, default=None, help="generate this many jobs like Gavel")
    parser.add_argument("--jobs-per-hour", type=floats, default=(2.0,), help="Poisson arrival rates, e.g. 1,2,3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-device", action="store_true", help="generated jobs use one device each")
    parser.add_argument("--slos", action="store_true", help="generated jobs get SLOs (1.2x, 2x or 10x duration)")
    parser.add_argument("--priorities", action="store_true", help="a fifth of generated jobs weigh 5")
    parser.add_argument("--write-trace", type=Path, default=None, help="write the jobs as a Gavel trace")


def run(args: argparse.Namespace) -> None:
    {"simulate": _simulate, "run": _run}[args.cluster_command](args)


def _simulate(args: argparse.Namespace) -> None:
    from conveyor.bench.cluster import parse_cluster, plot
    from conveyor.cluster import SCHEDULING_POLICIES, ThroughputTable, simulate_cluster

    for policy in args.policy:
        if policy not in SCHEDULING_POLICIES:
            raise InputError(f"unknown policy {policy!r}: choose from {', '.join(sorted(SCHEDULING_POLICIES))}")
    table = ThroughputTable.load(args.throughputs)
    devices = parse_cluster(args.cluster, args.per_server)
    prices = _prices(args.prices)
    window = _window(args.window)
    rows = []
    for rate in args.jobs_per_hour if args.trace is None else (None,):
        jobs = _trace_jobs(args, table, rate)

        def colocated(a: TraceJob, b: TraceJob) -> Any:
            """The table's throughputs of ``a`` and ``b`` sharing devices, per type; None if never measured."""
            return table.pairs([a, b], devices.types).get((0, 1))

        pair_rates = colocated if args.space_sharing else None
        for policy in args.policy:
            sim = simulate_cluster(
                jobs,
                lambda job: table.matrix([job], devices.types)[0],
                devices,
                policy,
                round_s=args.round_s,
                prices=prices,
                pair_rates=pair_rates,
                restart_s=args.restart_s,
                window=window,
                max_s=args.max_hours * 3600,
                reallocate_s=args.reallocate_s,
            )
            rows.append(_row(sim, policy, rate, window))
    _table(rows)
    if args.json:
        write_json(args.json, {"cluster": devices.counts, "rows": rows})
    if args.plot:
        plot([r for r in rows if r["jobs_per_hour"] is not None], args.plot)
        console.print(f"wrote {args.plot}")


def _trace_jobs(args: argparse.Namespace, table: ThroughputTable, rate: float | None) -> list[TraceJob]:
    """``--trace``'s jobs, or jobs generated at ``rate`` an hour; written to ``--write-trace`` if given (one file
    per rate, suffixed)."""
    from conveyor.cluster import generate_jobs, read_trace, write_trace

    if args.trace is not None:
        jobs = read_trace(args.trace, table=table)
    else:
        assert rate is not None
        jobs = generate_jobs(
            args.jobs or 50,
            jobs_per_hour=rate,
            seed=args.seed,
            multi_gpu=not args.single_device,
            priorities=args.priorities,
            slos=args.slos,
            table=table,
        )
    if args.write_trace is not None:
        write_trace(jobs, args.write_trace if rate is None else _suffixed(args.write_trace, rate, args))
    return jobs


def _row(sim: Any, policy: str, rate: float | None, window: tuple[int, int] | None) -> dict[str, Any]:
    for note in sim.notes[:5]:
        console.print(f"[yellow]{policy}: {note}")
    return {
        "policy": policy,
        "jobs_per_hour": rate,
        "jobs": len(sim.jobs),
        "average_jct_s": sim.average_jct_s(window),
        "makespan_s": sim.makespan_s,
        "utilization": sim.utilization,
        "cost": sim.cost,
        "slo_violations": sim.slo_violations,
        "preemptions": int(sum(r.preemptions for r in sim.jobs)),
        "rounds": sim.rounds,
        "solve_s_max": max(sim.solves, default=0.0),
    }


def _table(rows: list[dict[str, Any]], hours: bool = True) -> None:
    unit, scale = ("h", 3600) if hours else ("s", 1)
    table = Table(
        Column("policy", no_wrap=True),
        "jobs/h",
        "jobs",
        f"avg JCT {unit}",
        f"makespan {unit}",
        "utilization",
        "cost $",
        "SLO missed",
        "preemptions",
        "slowest solve s",
    )
    for r in rows:
        table.add_row(
            r["policy"],
            "trace" if r["jobs_per_hour"] is None else f"{r['jobs_per_hour']:g}",
            str(r["jobs"]),
            f"{r['average_jct_s'] / scale:.2f}",
            f"{r['makespan_s'] / scale:.2f}",
            f"{r['utilization']:.2f}",
            f"{r['cost']:.0f}",
            str(r["slo_violations"]),
            str(r["preemptions"]),
            f"{r['solve_s_max']:.3f}",
        )
    console.print(table, width=max(console.width, 150))


def _run(args: argparse.Namespace) -> None:
    import time

    from conveyor.cluster import LocalBackend, RayBackend, parse_device_types, read_trace, run_real
    from conveyor.emulate import Emulation

    if args.trace is None:
        raise InputError(
            "conveyor cluster run needs --trace FILE: jobs whose command is a conveyor train line and "
            "whose steps are epochs (see docs/guides/cluster-scheduling.md)"
        )
    jobs = read_trace(args.trace)
    device_types = parse_device_types(args.devices)
    # the jobs run on emulated devices (cgroups): a machine that cannot emulate them fails here, in one line
    Emulation(devices=args.devices).check(sum(device_types.counts.values()))
    folder = args.run_dir or Path("runs") / time.strftime("cluster-%Y%m%d-%H%M%S")
    backend = LocalBackend() if args.backend == "local" else RayBackend(args.ray_address, dict(device_types.counts))
    try:
        result = run_real(jobs, device_types, args.policy, backend, folder, round_s=args.round_s)
    finally:
        backend.close()
    rows = [_row(result.simulation, args.policy, None, None)]
    _table(rows, hours=False)
    write_json(folder / "summary.json", {"rows": rows, "jobs": [vars(r) for r in result.simulation.jobs]})
    if args.json:
        write_json(args.json, rows[0])


def _prices(text: str) -> dict[str, float]:
    prices = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        try:
            prices[name.strip()] = float(value)
        except ValueError:
            raise InputError(f"cannot read price {part!r}: write TYPE=DOLLARS_PER_HOUR, e.g. v100=3.06") from None
    return prices


def _window(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    start, _, end = text.partition(":")
    if not (start.isdigit() and end.isdigit()) or int(start) >= int(end):
        raise InputError(f"--window {text!r}: write START:END job ids with START < END, e.g. 200:400")
    return int(start), int(end)


def _suffixed(path: Path, rate: float, args: argparse.Namespace) -> Path:
    return path if len(args.jobs_per_hour) == 1 else path.with_name(f"{path.stem}-{rate:g}{path.suffix}")
