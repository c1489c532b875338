"""How a training job lays its model out on the workers: from the planner, a plan file, or fixed options.

With ``schedule="auto"`` and no fixed layout, :func:`choose_layout` profiles the model on one
microbatch, plans it for the job's workers with every schedule the planner knows, and keeps the one the
simulator predicts fastest (the flush schedule first among equals: it has no stale weights). The local
processes are modelled as one level joined at :data:`LOCAL_BANDWIDTH`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from conveyor.job._data import Dataset
from conveyor.plan import Topology, layout_file, optimize, plan_file, read_plan_file
from conveyor.runtime._profiler import profile
from conveyor.runtime._stage import as_blocks
from conveyor.schedule import kind, parse_replicas

__all__ = ["LOCAL_BANDWIDTH", "Layout", "choose_layout", "even_balance"]

LOCAL_BANDWIDTH = 2e9  # bytes/s between local processes over gloo, an order of magnitude
# The planner's schedules in order of preference when predictions tie: synchronous first, then the least stale.
_PREFERENCE = ("flush", "2bw", "pipedream", "gpipe")


@dataclass(frozen=True)
class Layout:
    """Stages (``balance``: blocks per stage), replicas per stage, the schedule and its microbatches."""

    schedule: str
    balance: list[int]
    replicas: list[int]
    microbatches: int
    recompute: bool = False
    how: str = ""
    plan_file: dict[str, Any] = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        config = "-".join(map(str, self.replicas))
        return (
            f"{self.how}: {self.schedule} schedule, {len(self.balance)} stage(s) of {self.balance} blocks, "
            f"replicas {config} ({sum(self.replicas)} workers), {self.microbatches} microbatches per batch"
        )


def even_balance(blocks: int, stages: int) -> list[int]:
    """Blocks per stage, as equal as possible: ``even_balance(5, 2) == [3, 2]``."""
    if not 1 <= stages <= blocks:
        raise ValueError(f"cannot cut {blocks} blocks into {stages} stages: use 1 to {blocks} stages")
    return [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]


def choose_layout(cfg: Any, model: nn.Sequential, data: Dataset, workers: int) -> Layout:
    """The layout for a :class:`~conveyor.job._train.TrainConfig` on ``workers`` workers.

    Raises:
        ValueError: a plan file for another worker count or model, or a batch the plan cannot split.
    """
    names = [name for name, _ in as_blocks(model)]
    if cfg.plan:
        spec = read_plan_file(cfg.plan)
        if spec.workers != workers:
            raise ValueError(
                f"the plan {cfg.plan} is for {spec.workers} workers but the job has {workers}: start "
                f"{spec.workers} (--workers {spec.workers}) or plan again for {workers}"
            )
        if spec.layers != len(names):
            raise ValueError(f"the plan {cfg.plan} splits {spec.layers} layers but {cfg.model} has {len(names)} blocks")
        schedule = spec.schedule if cfg.schedule == "auto" else cfg.schedule
        layout = Layout(schedule, spec.balance, spec.replicas, spec.microbatches, spec.recompute, f"plan {cfg.plan}")
    elif cfg.stages or cfg.replicas:
        replicas = parse_replicas(cfg.replicas, cfg.stages) if cfg.replicas else [1] * cfg.stages
        balance = even_balance(len(names), len(replicas))
        schedule = "flush" if cfg.schedule == "auto" else cfg.schedule
        layout = Layout(schedule, balance, replicas, cfg.microbatches, how="fixed layout")
    else:
        return _planned(cfg, model, data, workers, names)
    return replace(
        layout, plan_file=layout_file(layout.schedule, layout.microbatches, layout.balance, layout.replicas, names)
    )


def _planned(cfg: Any, model: nn.Sequential, data: Dataset, workers: int, names: list[str]) -> Layout:
    example = data.train_x[: cfg.batch_size // cfg.microbatches]
    prof = profile(model, example, name=cfg.model, repeats=5, warmup=2)
    topology = Topology.parse(f"{workers}:{LOCAL_BANDWIDTH:g}")
    # A schedule the planner has no memory model for is planned as its record says (no memory limit is set here).
    candidates = _PREFERENCE if cfg.schedule == "auto" else [kind(cfg.schedule).plan_as or cfg.schedule]
    best = None
    for name in candidates:
        plan = optimize(prof, topology, schedule=name, microbatches=cfg.microbatches)
        file = plan_file(plan, prof, topology)
        if best is None or file["predicted"]["samples_per_s"] > best[1]["predicted"]["samples_per_s"] * 1.001:
            best = (plan, file)
    assert best is not None
    plan, file = best
    schedule = cfg.schedule if cfg.schedule != "auto" else plan.schedule
    balance = [st.last_layer - st.first_layer + 1 for st in plan.stages]
    how = f"planned for {workers} workers (predicted {file['predicted']['samples_per_s']:.0f} samples/s)"
    return Layout(schedule, balance, [st.replicas for st in plan.stages], plan.microbatches, False, how, file)
