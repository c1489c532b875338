"""``conveyor profile`` and ``conveyor plan``: measure a model, choose its stages and replicas."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from conveyor.cli._common import console, positive, sizes, write_json
from conveyor.errors import InputError
from conveyor.plan import COST_MODELS
from conveyor.schedule import PLANNER_SCHEDULES

if TYPE_CHECKING:
    from conveyor.plan import Plan, Profile, Topology

__all__ = ["add_parsers", "plan", "profile"]


def add_parsers(sub: Any) -> None:
    prof = sub.add_parser("profile", help="measure a model block by block and save the profile as JSON")
    prof.add_argument("model", help="a zoo model (mlp, ...), or module:callable (any nn.Module)")
    prof.add_argument("--model-args", default="", help="NAME=VALUE,... for a module:callable, e.g. num_classes=10")
    prof.add_argument("--dataset", default=None, help="where a callable's example batch comes from (default: digits)")
    prof.add_argument("--batch-size", type=positive, default=64)
    prof.add_argument(
        "--batch-sizes", type=sizes, default=(), help="also measure these smaller sizes, e.g. 8,16,32 (for planning)"
    )
    prof.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    prof.add_argument(
        "--materialize",
        choices=("whole", "stage"),
        default="whole",
        help="whole: build the model, then profile it; stage: build it on the meta device and make one block real "
        "at a time (a model larger than the device), initialised per module",
    )
    prof.add_argument("--repeats", type=positive, default=10)
    prof.add_argument(
        "--device-cores",
        type=float,
        default=None,
        help="profile on an emulated device of this many CPU cores (a cgroup quota, as --devices gives workers)",
    )
    prof.add_argument("--json", type=Path, required=True, help="write the profile here")

    plan = sub.add_parser("plan", help="choose stages and replicas for a profiled model on a cluster")
    plan.add_argument("profile", help="a profile JSON, or a PipeDream graph.txt (or its folder)")
    plan.add_argument("--topology", required=True, help="COUNT:BYTES_PER_S per level, innermost first: 4:12e9,4:1.25e9")
    plan.add_argument("--straight", action="store_true", help="one worker per stage, no replication")
    plan.add_argument("--memory", type=float, default=None, help="bytes per worker, e.g. 16e9 (default: no limit)")
    plan.add_argument("--schedule", choices=PLANNER_SCHEDULES, default="pipedream", help="what memory counts follow")
    plan.add_argument("--microbatches", type=positive, default=None, help="per step, for flush/gpipe/2bw")
    plan.add_argument(
        "--batch-size",
        type=positive,
        default=None,
        help="with --schedule 2bw: samples per step to keep; choose width x depth, microbatch size and recomputation",
    )
    plan.add_argument(
        "--cost-model",
        choices=COST_MODELS,
        default="physical",
        help="physical: the runtime on the topology's links (default); pipedream: the PipeDream optimizer's own terms",
    )
    plan.add_argument("--json", type=Path, default=None, help="write the plan file here")


def _measure(args: argparse.Namespace) -> Any:
    import torch  # (here: conveyor plan works without torch)

    from conveyor.job import default_dataset, load_dataset, resolve, rows
    from conveyor.runtime import initialise_from
    from conveyor.runtime import profile as measure

    data = load_dataset(args.dataset) if args.dataset else None
    if args.materialize == "stage":  # the data real, the model on the meta device, the example from the data
        data = data or load_dataset(default_dataset(args.model))
        with torch.device("meta"):
            model, _ = resolve(args.model, args.batch_size, data, args.model_args)
        example = rows(data.train_x, slice(args.batch_size))
    else:
        model, example = resolve(args.model, args.batch_size, data, args.model_args)
    return measure(
        model,
        example,
        name=args.model,
        device=args.device,
        repeats=args.repeats,
        batch_sizes=args.batch_sizes,
        materialize=initialise_from(model, seed=0) if args.materialize == "stage" else None,
    )


def profile(args: argparse.Namespace) -> None:
    if args.device_cores is None:
        result = _measure(args)
    else:  # in a worker process whose cgroup gives it the device's cores
        from conveyor.emulate import Emulation, launch_emulated

        emulation = Emulation(devices=f"{args.device_cores:g}")
        result = launch_emulated(_measure, args, nprocs=1, emulation=emulation)[0]
    table = Table("block", "what", "forward ms", "backward ms", "output MB", "saved MB", "params MB")
    for layer in result.layers:
        table.add_row(
            layer.name,
            layer.description[:40],
            f"{layer.forward_s * 1e3:.3f}",
            f"{layer.backward_s * 1e3:.3f}",
            f"{layer.output_bytes / 1e6:.3f}",
            f"{layer.saved_bytes / 1e6:.3f}",
            f"{layer.param_bytes / 1e6:.3f}",
        )
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


def plan(args: argparse.Namespace) -> None:
    from conveyor.plan import Profile, Topology
    from conveyor.plan.parts import plan_file

    profile, topology = Profile.load(args.profile), Topology.parse(args.topology)
    chosen, profile = _planned(args, profile, topology)
    report = plan_file(chosen, profile, topology=topology)
    _print_plan(report, chosen, profile, topology)
    if args.json:
        write_json(args.json, report)


def _planned(args: argparse.Namespace, profile: Profile, topology: Topology) -> tuple[Plan, Profile]:
    """The plan the options ask for, and the profile at its microbatch size (``--batch-size``: the 2BW planner's,
    its candidates printed)."""
    from conveyor.plan import optimize, plan_2bw

    if args.batch_size is None:
        chosen = optimize(
            profile,
            topology,
            args.straight,
            schedule=args.schedule,
            memory=args.memory,
            microbatches=args.microbatches,
            cost_model=args.cost_model,
        )
        return chosen, profile
    if args.schedule != "2bw" or args.straight or args.microbatches or args.cost_model != "physical":
        raise InputError(
            "--batch-size runs the 2BW planner: use it with --schedule 2bw, without --straight, --microbatches "
            "and --cost-model"
        )
    chosen, candidates = plan_2bw(profile, topology, args.batch_size, args.memory)
    _print_candidates(candidates)
    return chosen, profile.at(args.batch_size // chosen.microbatches)  # the chosen microbatch size


def _print_plan(report: dict[str, Any], plan: Plan, profile: Profile, topology: Topology) -> None:
    """The plan file's stages as a table, then its predictions."""
    table = Table(
        "stage",
        "layers",
        "first - last layer",
        "replicas",
        "ranks",
        "ms per minibatch",
        "memory GB",
        title=f"{profile.model} on {topology.workers} workers ({topology}), {plan.schedule}"
        f"{' with recomputation' if plan.recompute else ''}: {plan.config}, microbatch size {profile.batch_size}, "
        f"{plan.cost_model} cost model",
    )
    for i, st in enumerate(report["stages"]):
        ranks = st["ranks"]
        table.add_row(
            str(i),
            str(len(st["layer_names"])),
            f"{st['layer_names'][0]} - {st['layer_names'][-1]}",
            str(st["replicas"]),
            f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]),
            f"{st['seconds_per_minibatch'] * 1e3:.2f}",
            f"{st['memory_bytes'] / 1e9:.3f}",
        )
    console.print(table)
    pred = report["predicted"]

    def times(x: float | None) -> str:
        return "n/a (does not fit)" if x is None else f"{x:.2f}x"

    console.print(
        f"simulated over {pred['simulated_minibatches']} minibatches: {pred['samples_per_s']:.2f} samples/s, "
        f"{times(pred['speedup_vs_dp'])} data parallelism, {times(pred['speedup_vs_single'])} one worker; "
        f"steady state ({plan.cost_model} cost model) {pred['steady_state']['seconds_per_minibatch'] * 1e3:.4f} ms "
        "per minibatch; "
        f"NOAM {report['noam']}; {pred['epochs_factor']:.2f}x the epochs of data parallelism to the same accuracy "
        f"({pred['epochs_factor_source']})"
    )
    if plan.note:
        console.print(f"note: {plan.note}")
