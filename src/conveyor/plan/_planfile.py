"""The plan file: a plan with layer names, ranks, memory and the simulator's predictions, as JSON.

The planner's steady state (one minibatch per slowest stage or link) omits the fill and the drain of a
run and, for ``flush`` and ``gpipe``, the bubble at every step. The predictions in the plan file come from
running the plan's own schedule action lists in :func:`~conveyor.schedule.simulate` with the costs the
runtime pays (:func:`predict`: compute, messages, a blocking all-reduce per update, optimizer steps), so
they can be set against what the runtime measures.

The simulation is never faster than the steady state, and a straight pipeline with negligible transfers
reaches it on a long run. Transfers lengthen the round trip that 1F1B's warm-up covers, and a replicated
stage followed by others can fall short: its replicas' backwards come back in turn from the stage after,
and every update waits at the all-reduce for all of them (``2-1-1`` with equal stage times runs at 2/3 of
the steady state). The runtime behaves like the simulator here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.errors import InputError
from conveyor.plan._epochs import EpochFactors
from conveyor.plan._optimizer import Plan, PlannedStage, step_microbatches
from conveyor.plan._predict import RuntimeCosts, predict
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology
from conveyor.schedule import kind, stage_workers

__all__ = ["PlanFileError", "PlanSpec", "layout_file", "plan_file", "read_plan_file"]


class PlanFileError(InputError):
    """A plan file that cannot be read or does not describe a runnable plan."""


def layout_file(
    schedule: str, microbatches: int, balance: list[int], replicas: list[int], names: list[str]
) -> dict[str, Any]:
    """A plan file for a layout without predictions: each stage's layers (by position and name), replicas and
    ranks (handed out stage by stage, so a stage's replicas sit on neighbouring workers)."""
    stages, first = [], 0
    for blocks, r, ranks in zip(balance, replicas, stage_workers(replicas), strict=True):
        stage = {"first_layer": first, "last_layer": first + blocks - 1, "layer_names": names[first : first + blocks]}
        stages.append({**stage, "replicas": r, "ranks": ranks})
        first += blocks
    return {"schedule": schedule, "microbatches": microbatches, "stages": stages}


def plan_file(
    plan: Plan,
    profile: Profile,
    *,
    topology: Topology,
    minibatches: int | None = None,
    runtime: RuntimeCosts | None = None,
    epochs: EpochFactors | None = None,
    stale_correction: bool = True,
    stale_rate: str = "auto",
) -> dict[str, Any]:
    """The plan as the JSON the runtime runs: stages, ranks, memory, schedule and predictions.

    ``predicted.samples_per_s`` and the speedups are the simulator's (:func:`predict`, for the same schedule
    on one stage with every worker, and on one worker); ``steady_state`` holds the planner's own figures.
    ``predicted.epochs_factor`` is the epochs the schedule needs over data parallelism's for the profile's
    model (from ``epochs``, default the shipped table: :mod:`conveyor.plan._epochs`), with or without the
    stale-gradient correction (at ``stale_rate``). Sample counts use the profile's batch size (1 when the
    profile does not record one).
    """
    sim = predict(plan, profile, topology, minibatches, runtime)
    epochs = epochs or EpochFactors.load()

    def speedup(seconds: float, workers: int) -> float | None:
        """Over one stage on ``workers`` workers with the same schedule; None if that does not fit."""
        if not math.isfinite(seconds):
            return None
        alone = (PlannedStage(0, len(profile) - 1, workers, seconds),)
        m = step_microbatches(plan.schedule, [workers], plan.microbatches)
        other = Plan(alone, seconds, seconds, seconds, plan.schedule, m)
        return sim.samples_per_s / predict(other, profile, topology, sim.minibatches, runtime).samples_per_s

    batch = profile.batch_size or 1
    names = [lay.name for lay in plan.in_order(profile).layers]
    layout = layout_file(plan.schedule, plan.microbatches, plan.balance, plan.replicas, names)
    for entry, st in zip(layout["stages"], plan.stages, strict=True):
        entry.update(seconds_per_minibatch=st.seconds_per_minibatch, memory_bytes=st.memory_bytes)
    return {
        "model": profile.model,
        "topology": str(topology),
        "config": plan.config,
        "noam": plan.noam,
        **layout,
        "microbatch_size": profile.batch_size,
        "recompute": plan.recompute,
        "memory_limit_bytes": plan.memory_limit,
        "cost_model": plan.cost_model,
        "note": plan.note,
        "stale_rate": epochs.run_rate(profile.model, plan.schedule, corrected=stale_correction, asked=stale_rate),
        "predicted": {
            "samples_per_s": sim.samples_per_s,
            "speedup_vs_dp": speedup(plan.data_parallel_seconds, plan.workers),
            "speedup_vs_single": speedup(plan.single_worker_seconds, 1),
            "simulated_minibatches": sim.minibatches,
            "simulated_seconds": sim.seconds,
            "epochs_factor": epochs.factor(profile.model, plan.schedule, corrected=stale_correction, rate=stale_rate),
            "epochs_factor_source": epochs.source,
            "efficiency": sim.efficiency,
            "runtime_costs": asdict(runtime or RuntimeCosts()),
            "steady_state": {
                "seconds_per_minibatch": plan.seconds_per_minibatch,
                "samples_per_s": batch / plan.seconds_per_minibatch,
                "speedup_vs_dp": _finite(plan.speedup_vs_dp),
                "speedup_vs_single": _finite(plan.speedup_vs_single),
            },
        },
    }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class PlanSpec:
    """What the runtime needs from a plan file: ``Pipeline(..., balance, microbatches, schedule=..,
    replicas=.., recompute=..)``, with ``balance[s]`` the number of layers (blocks) of stage ``s``."""

    schedule: str
    microbatches: int
    balance: list[int]
    replicas: list[int]
    layers: int
    recompute: bool = False
    stale_rate: str | None = None  # the stale-gradient correction's rate it was planned with (None: none)

    @property
    def workers(self) -> int:
        return sum(self.replicas)


def read_plan_file(path: str | os.PathLike[str]) -> PlanSpec:
    """Read a plan file written by ``conveyor plan --json`` and check it describes a runnable pipeline.

    Raises:
        PlanFileError: the file is missing, is not JSON, or its stages do not cover the layers in order.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        stages = data["stages"]
        spec = PlanSpec(
            str(data["schedule"]),
            int(data["microbatches"]),
            [int(st["last_layer"]) - int(st["first_layer"]) + 1 for st in stages],
            [int(st["replicas"]) for st in stages],
            int(stages[-1]["last_layer"]) + 1,
            bool(data.get("recompute", False)),
            data.get("stale_rate"),
        )
    except OSError as exc:
        raise PlanFileError(
            f"cannot read plan file {path} ({exc.strerror}): write one with `conveyor plan --json`"
        ) from exc
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise PlanFileError(f"{path} is not a Conveyor plan file ({type(exc).__name__}: {exc})") from exc
    firsts = [int(st["first_layer"]) for st in stages]
    if firsts[0] != 0 or any(b != a + n for a, b, n in zip(firsts, firsts[1:], spec.balance, strict=False)):
        raise PlanFileError(f"{path}: the stages' layer ranges must start at 0 and follow each other without gaps")
    if min(spec.balance) < 1 or min(spec.replicas) < 1 or spec.microbatches < 1:
        raise PlanFileError(f"{path}: every stage needs at least one layer and one replica, and microbatches >= 1")
    try:
        kind(spec.schedule)
    except ValueError as exc:
        raise PlanFileError(f"{path}: {exc}") from None
    if spec.stale_rate not in (None, "sample", "damped"):
        raise PlanFileError(f"{path}: stale_rate is {spec.stale_rate!r}; give sample, damped or null")
    return spec
