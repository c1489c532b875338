"""The ``conveyor`` command: ``conveyor train`` and ``conveyor bench schedules``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table

from conveyor.schedule import KINDS, PLANNER_SCHEDULES

__all__ = ["main"]

console = Console()
_C = TypeVar("_C")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"write sizes as 8,16,32, not {text!r}") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be at least 1, got {text!r}")
    return sizes


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="Pipeline-parallel PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="profile, plan and train a model; writes a run folder")
    train.add_argument("--model", default="mlp", help="mlp, vgg, resnet, gpt, or package.module:factory")
    train.add_argument("--dataset", default=None, help="digits, digit-images, text, text:PATH, torchvision:NAME:ROOT")
    train.add_argument("--width", type=_positive, default=None, help="scale a zoo model's width")
    train.add_argument("--depth", type=_positive, default=None, help="scale a zoo model's depth")
    train.add_argument("--workers", type=_positive, default=None, help="worker processes (default 4 when planning)")
    train.add_argument("--schedule", choices=["auto", *sorted(KINDS)], default="auto", help="auto: the planner's")
    train.add_argument("--stages", type=_positive, default=None, help="fix the stage count instead of planning")
    train.add_argument("--replicas", default=None, help="fix workers per stage, e.g. 2-1, instead of planning")
    train.add_argument("--plan", default=None, help="run this plan file (conveyor plan --json) as is")
    train.add_argument("--microbatches", type=_positive, default=4)
    train.add_argument("--batch-size", type=_positive, default=64)
    train.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    train.add_argument("--lr", type=float, default=0.05)
    train.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    train.add_argument("--epochs", type=_positive, default=10)
    train.add_argument("--target-accuracy", type=float, default=None, help="stop once test accuracy reaches it")
    train.add_argument("--run-dir", default=None, help="the run folder (default runs/MODEL-TIME)")
    train.add_argument("--checkpoint", default=None, help="write the final model here (default RUN_DIR/checkpoint.pt)")
    train.add_argument("--resume", default=None, help="start from this checkpoint")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--loader-workers", type=int, default=None, help="DataLoader processes per reading worker (default 2 with CUDA)"
    )
    train.add_argument("--json", type=Path, default=None, help="also write the run's summary here")

    prof = sub.add_parser("profile", help="measure a model block by block and save the profile as JSON")
    prof.add_argument("model", help="a built-in model (mlp) or package.module:factory")
    prof.add_argument("--batch-size", type=_positive, default=64)
    prof.add_argument(
        "--batch-sizes", type=_sizes, default=(), help="also measure these smaller sizes, e.g. 8,16,32 (for planning)"
    )
    prof.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    prof.add_argument("--repeats", type=_positive, default=10)
    prof.add_argument("--json", type=Path, required=True, help="write the profile here")

    plan = sub.add_parser("plan", help="choose stages and replicas for a profiled model on a cluster")
    plan.add_argument("profile", help="a profile JSON, or a PipeDream graph.txt (or its folder)")
    plan.add_argument("--topology", required=True, help="COUNT:BYTES_PER_S per level, innermost first: 4:12e9,4:1.25e9")
    plan.add_argument("--straight", action="store_true", help="one worker per stage, no replication")
    plan.add_argument("--memory", type=float, default=None, help="bytes per worker, e.g. 16e9 (default: no limit)")
    plan.add_argument("--schedule", choices=PLANNER_SCHEDULES, default="pipedream", help="what memory counts follow")
    plan.add_argument("--microbatches", type=_positive, default=None, help="per step, for flush/gpipe/2bw")
    plan.add_argument(
        "--batch-size", type=_positive, default=None,
        help="with --schedule 2bw: samples per step to keep; choose width x depth, microbatch size and recomputation",
    )  # fmt: skip
    plan.add_argument("--json", type=Path, default=None, help="write the plan file here")

    bench = sub.add_parser("bench", help="benchmarks that write JSON")
    which = bench.add_subparsers(dest="bench", required=True)
    sched = which.add_parser("schedules", help="pipeline efficiency of every schedule on fixed-latency stages")
    sched.add_argument("--stages", type=_positive, default=4)
    sched.add_argument("--microbatches", type=_positive, default=8)
    sched.add_argument("--steps", type=_positive, default=20)
    sched.add_argument("--forward-ms", type=float, default=10.0)
    sched.add_argument("--backward-ms", type=float, default=20.0)
    sched.add_argument("--repeats", type=_positive, default=3, help="interleaved rounds; the median is reported")
    sched.add_argument("--json", type=Path, default=None, help="write the report here")
    pvr = which.add_parser("plan-vs-run", help="run planned pipelines and compare their throughput with the plan")
    pvr.add_argument("--minibatches", type=_positive, default=60, help="minibatches per timed run")
    pvr.add_argument("--repeats", type=_positive, default=3, help="timed runs per plan; the median is reported")
    pvr.add_argument("--json", type=Path, default=None, help="write the report here")
    tta = which.add_parser("tta", help="time to accuracy of data parallelism and each pipeline schedule")
    tta.add_argument("--model", default="mlp")
    tta.add_argument("--dataset", default=None)
    tta.add_argument("--workers", type=_positive, default=4)
    tta.add_argument("--target", type=float, default=0.9, help="test accuracy to reach")
    tta.add_argument("--epochs", type=_positive, default=20, help="give up after this many")
    tta.add_argument("--batch-size", type=_positive, default=64)
    tta.add_argument("--microbatches", type=_positive, default=4)
    tta.add_argument("--lr", type=float, default=0.05)
    tta.add_argument("--json", type=Path, default=None, help="write the report here")
    tta.add_argument("--plot", type=Path, default=None, help="write accuracy against time here (PNG)")
    pred = which.add_parser("predictions", help="conveyor train's predicted against measured throughput, zoo models")
    pred.add_argument("--models", type=_names, default=("mlp", "vgg", "resnet", "gpt"), help="e.g. mlp,vgg")
    pred.add_argument("--workers", type=_positive, default=4)
    pred.add_argument("--epochs", type=_positive, default=3)
    pred.add_argument("--repeats", type=_positive, default=2, help="runs per model")
    pred.add_argument("--json", type=Path, default=None, help="write the report here")
    planner = which.add_parser("planner", help="planning time for synthetic chains on growing clusters")
    planner.add_argument("--json", type=Path, default=None, help="write the report here")
    return parser


def _config(cls: type[_C], args: argparse.Namespace) -> _C:
    """A config dataclass filled from the options of the same name; fields without an option keep defaults."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # every config is a dataclass
    return cls(**{f.name: getattr(args, f.name) for f in fields if hasattr(args, f.name)})


def _train(args: argparse.Namespace) -> None:
    from conveyor.job import TrainConfig, closing_notes, explicit_workers, fixed_layout, model_and_data, train
    from conveyor.runtime import load_checkpoint

    if args.resume:
        load_checkpoint(args.resume)  # fail here, with one line, rather than in every worker
    cfg = _config(TrainConfig, args)
    model, data = model_and_data(cfg)  # an unknown model or dataset fails here, before any worker starts
    fixed_layout(cfg, len(model), cfg.workers or explicit_workers(cfg) or 0)  # so does a layout that cannot work
    if os.environ.get("RANK", "0") == "0":  # under torchrun, say it once
        console.print(
            f"training {cfg.model} on {data.name}: {len(data.train_x)} training samples, batch {cfg.batch_size}"
        )
    result = train(cfg)
    if result:
        table = Table("epochs", "test accuracy", "final loss", "seconds", "samples/s", "run folder")
        table.add_row(
            str(result["epochs"]), f"{result['accuracy'][-1]:.3f}", f"{result['loss'][-1]:.3f}",
            f"{result['seconds']:.1f}", f"{result['samples_per_s']:.0f}", result["run_dir"],
        )  # fmt: skip
        console.print(table)
        for note in closing_notes(result):
            console.print(note)
        if args.json:
            _write_json(args.json, result)


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    console.print(f"wrote {path}")


def _bench_schedules(args: argparse.Namespace) -> None:
    from conveyor.bench.schedules import BenchConfig, run

    cfg = _config(BenchConfig, args)
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
        _write_json(args.json, report)


def _profile(args: argparse.Namespace) -> None:
    from conveyor.job import resolve
    from conveyor.runtime import profile

    model, example = resolve(args.model, args.batch_size)
    sizes = args.batch_sizes
    result = profile(model, example, name=args.model, device=args.device, repeats=args.repeats, batch_sizes=sizes)
    table = Table("block", "what", "forward ms", "backward ms", "output MB", "saved MB", "params MB")
    for layer in result.layers:
        table.add_row(
            layer.name, layer.description[:40], f"{layer.forward_s * 1e3:.3f}", f"{layer.backward_s * 1e3:.3f}",
            f"{layer.output_bytes / 1e6:.3f}", f"{layer.saved_bytes / 1e6:.3f}", f"{layer.param_bytes / 1e6:.3f}",
        )  # fmt: skip
    console.print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result.save(args.json)
    console.print(f"wrote {args.json}")


def _print_candidates(candidates: list[Any]) -> None:
    table = Table("width", "depth", "microbatch", "recompute", "samples/s", title="PipeDream-2BW candidates")
    for c in sorted(candidates, key=lambda c: -(c.samples_per_s or 0.0))[:12]:
        rate = f"{c.samples_per_s:.2f}" if c.samples_per_s is not None else c.why_not
        table.add_row(str(c.width), str(c.depth), str(c.microbatch_size), "yes" if c.recompute else "no", rate)
    console.print(table)


def _plan(args: argparse.Namespace) -> None:
    from conveyor.plan import Profile, Topology, optimize, plan_2bw, plan_file

    profile, topology = Profile.load(args.profile), Topology.parse(args.topology)
    if args.batch_size is not None:
        if args.schedule != "2bw" or args.straight or args.microbatches:
            raise ValueError(
                "--batch-size runs the 2BW planner: use it with --schedule 2bw, without --straight and --microbatches"
            )
        plan, candidates = plan_2bw(profile, topology, args.batch_size, args.memory)
        _print_candidates(candidates)
        profile = profile.at(args.batch_size // plan.microbatches)  # the chosen microbatch size
    else:
        plan = optimize(
            profile, topology, args.straight, schedule=args.schedule, memory=args.memory, microbatches=args.microbatches
        )
    report = plan_file(plan, profile, topology)
    table = Table(
        "stage", "layers", "first - last layer", "replicas", "ranks", "ms per minibatch", "memory GB",
        title=f"{profile.model} on {topology.workers} workers ({topology}), {plan.schedule}"
        f"{' with recomputation' if plan.recompute else ''}: {plan.config}, microbatch size {profile.batch_size}",
    )  # fmt: skip
    for i, st in enumerate(report["stages"]):
        ranks = st["ranks"]
        table.add_row(
            str(i), str(len(st["layer_names"])), f"{st['layer_names'][0]} - {st['layer_names'][-1]}",
            str(st["replicas"]), f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]),
            f"{st['seconds_per_minibatch'] * 1e3:.2f}", f"{st['memory_bytes'] / 1e9:.3f}",
        )  # fmt: skip
    console.print(table)
    pred = report["predicted"]

    def times(x: float | None) -> str:
        return "n/a (does not fit)" if x is None else f"{x:.2f}x"

    console.print(
        f"simulated over {pred['simulated_minibatches']} minibatches: {pred['samples_per_s']:.2f} samples/s, "
        f"{times(pred['speedup_vs_dp'])} data parallelism, {times(pred['speedup_vs_single'])} one worker; "
        f"steady state {pred['steady_state']['seconds_per_minibatch'] * 1e3:.2f} ms per minibatch; "
        f"NOAM {report['noam']}"
    )
    if args.json:
        _write_json(args.json, report)


def _bench_planner(args: argparse.Namespace) -> None:
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
            str(r["layers"]), str(r["workers"]), r["topology"], f"{r['seconds']:.3f}", r["config"][:24],
            f"{r['seconds_with_memory_limit']:.3f}", r["config_with_memory_limit"][:24],
        )  # fmt: skip
    console.print(table)
    if args.json:
        _write_json(args.json, report)


def _bench_tta(args: argparse.Namespace) -> None:
    from conveyor.bench.tta import TTAConfig, run

    report = run(_config(TTAConfig, args), plot=str(args.plot) if args.plot else None)
    table = Table("strategy", "seconds to target", "epochs", "final accuracy", "samples/s", "peak RSS MB per worker",
                  title=f"time to {report['config']['target']:g} test accuracy")  # fmt: skip
    for r in report["results"]:
        reached = r["seconds_to_target"] is not None
        table.add_row(
            r["strategy"], f"{r['seconds_to_target']:.1f}" if reached else "not reached",
            str(r["epochs_to_target"]) if reached else "-", f"{r['final_accuracy']:.3f}", f"{r['samples_per_s']:.0f}",
            " ".join(f"{b / 2**20:.0f}" for b in r["peak_rss_bytes_per_worker"]),
        )  # fmt: skip
    console.print(table)
    if args.plot:
        console.print(f"wrote {args.plot}")
    if args.json:
        _write_json(args.json, report)


def _bench_plan_vs_run(args: argparse.Namespace) -> None:
    from conveyor.bench.plan_vs_run import PlanVsRunConfig, run

    report = run(_config(PlanVsRunConfig, args))
    table = Table("plan", "config", "measured samples/s", "simulated", "error", "planner (steady state)", "error")
    for r in report["results"]:
        table.add_row(
            r["case"], r["config"], f"{r['measured_samples_per_s']:.1f}", f"{r['simulated_samples_per_s']:.1f}",
            f"{r['error_vs_simulated']:+.1%}", f"{r['planner_samples_per_s']:.1f}", f"{r['error_vs_planner']:+.1%}",
        )  # fmt: skip
    console.print(table)
    if args.json:
        _write_json(args.json, report)


def _bench_predictions(args: argparse.Namespace) -> None:
    from conveyor.bench.predictions import PredictionsConfig, run

    report = run(_config(PredictionsConfig, args))
    table = Table("model", "layout", "schedule", "predicted samples/s", "measured", "error", "one worker",
                  title="conveyor train: predicted against measured training throughput")  # fmt: skip
    for r in report["results"]:
        table.add_row(
            r["model"], "-".join(map(str, r["replicas"])) + f" {r['balance']}", r["schedule"],
            f"{r['predicted_samples_per_s']:.0f}", f"{r['measured_samples_per_s']:.0f}", f"{r['error']:+.0%}",
            f"{r['single_worker_samples_per_s']:.0f}",
        )  # fmt: skip
    console.print(table)
    if args.json:
        _write_json(args.json, report)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``conveyor`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            _train(args)
        elif args.command == "profile":
            _profile(args)
        elif args.command == "plan":
            _plan(args)
        elif args.bench == "planner":
            _bench_planner(args)
        elif args.bench == "tta":
            _bench_tta(args)
        elif args.bench == "plan-vs-run":
            _bench_plan_vs_run(args)
        elif args.bench == "predictions":
            _bench_predictions(args)
        else:
            _bench_schedules(args)
    except Exception as exc:
        status = _report(exc)
        if status is None:
            raise
        return status
    return 0


def _report(exc: Exception) -> int | None:
    """Print an error the user can fix in one line and return the exit status; ``None`` for a bug."""
    # Only a command that ran the runtime (and so imported torch) can raise its errors; planning does not.
    runtime = sys.modules.get("conveyor.runtime")
    if runtime is not None and isinstance(exc, runtime.WorkerError):
        if os.environ.get("CONVEYOR_TRACEBACK"):
            print(exc.remote_traceback, file=sys.stderr)
        print(f"conveyor: error: worker {exc.rank}: {exc.error_type}: {exc.message}", file=sys.stderr)
        return 1
    if isinstance(exc, ValueError | OSError) or (runtime is not None and isinstance(exc, runtime.WorldSizeError)):
        lines = str(exc).splitlines() or [type(exc).__name__]
        print(f"conveyor: error: {lines[0]}", file=sys.stderr)  # one line; the rest is for CONVEYOR_TRACEBACK
        if os.environ.get("CONVEYOR_TRACEBACK"):
            print("\n".join(lines[1:]), file=sys.stderr)
        return 2
    return None


if __name__ == "__main__":
    sys.exit(main())
