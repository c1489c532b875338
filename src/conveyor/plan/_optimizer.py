"""PipeDream's partitioning optimizer: split layers into stages and choose each stage's replica count.

The search is the PipeDream paper's (Narayanan et al., SOSP 2019, section 3.1), run level by level through
a hierarchical topology, innermost first. At level ``k`` with ``m`` units of the level below:

- one stage running layers ``[i, j)`` replicated over ``m`` units takes ``T_k(i, j, m)`` per minibatch, from
  ``A_{k-1}(i, j)`` (each unit runs the best plan of the level below for those layers), the stage's weights
  and the activations entering and leaving it, as the cost model says (:mod:`conveyor.plan._cost_model`);
- the best pipeline over ``[i, j)`` with ``m`` units is a single stage or a first stage over ``[i, s)`` on
  ``m'`` units followed by a best pipeline over ``[s, j)`` on the rest:
  ``A_k(i, j, m) = min(T_k(i, j, m), min_{s, m'} max(T_k(i, s, m'), A_k(s, j, m - m')))``.

At the innermost level a unit is one worker and ``A_{-1}(i, j)`` is the layers' forward plus backward
time. The pipeline's time per minibatch is that of its slowest stage (a stage's links are part of its
time); the plan is the arg-min. Every candidate the recursion ranges over includes a single stage
replicated over every worker (data parallelism), so the plan is never slower than data parallelism under
the model.

Example:
    >>> from conveyor.plan._profiles import Profile
    >>> p = Profile.chain("toy", [1.0, 1.0], [2.0, 2.0], [10, 10], [8e9, 0])
    >>> plan = optimize(p, Topology.parse("2:1e9"))
    >>> [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages]
    [(0, 0, 1), (1, 1, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeAlias

import numpy as np

from conveyor.errors import InputError
from conveyor.plan._cost_model import check_cost_model, stage_seconds
from conveyor.plan._cuts import cuts_of
from conveyor.plan._memory import planned_kind, stage_bytes
from conveyor.plan._partition import MemoryModel, Partition, extras_grid, solve
from conveyor.plan._partition import stages as flat_stages
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology
from conveyor.schedule import twobw_min_microbatches

__all__ = ["Plan", "PlanError", "PlannedStage", "optimize", "step_microbatches"]

Index: TypeAlias = "np.ndarray | int"


class PlanError(InputError):
    """No configuration satisfies the constraints."""


@dataclass(frozen=True)
class PlannedStage:
    """A stage of a plan: layers ``first_layer..last_layer`` (inclusive) on ``replicas`` workers."""

    first_layer: int
    last_layer: int
    replicas: int
    seconds_per_minibatch: float
    memory_bytes: int = 0


@dataclass(frozen=True)
class Plan:
    """The optimizer's answer and what the cost model predicts for it.

    Attributes:
        stages: the stages in pipeline order, with each worker's peak memory under the schedule.
        seconds_per_minibatch: predicted steady-state time per minibatch (slowest stage or link).
        data_parallel_seconds: the same for pure data parallelism on every worker (infinite if it does
            not fit in memory).
        single_worker_seconds: the same for one worker running the whole model (infinite if it does not fit).
        schedule: the schedule the memory counts are for.
        microbatches: microbatches per optimizer step (for ``flush`` and ``gpipe``).
        memory_limit: bytes per worker the plan had to fit in, if any.
        recompute: stages re-run their forward in the backward instead of stashing activations.
        cost_model: the cost model the times are from (:data:`~conveyor.plan.COST_MODELS`).
        layers: the profile's layer positions in the plan's order, when a graph's stages are not ranges of the
            profile's own order (empty: that order); the stages' layer indices are in the plan's order
            (:meth:`in_order`).
        note: why the plan could not cut where the graph allows (empty when it could).
    """

    stages: tuple[PlannedStage, ...]
    seconds_per_minibatch: float
    data_parallel_seconds: float
    single_worker_seconds: float
    schedule: str = "pipedream"
    microbatches: int = 1
    memory_limit: float | None = None
    recompute: bool = False
    cost_model: str = "physical"
    layers: tuple[int, ...] = ()
    note: str = ""

    def in_order(self, profile: Profile) -> Profile:
        """``profile`` with its layers in the plan's order, which the stages' layer indices refer to."""
        return profile.reordered(self.layers) if self.layers else profile

    @property
    def workers(self) -> int:
        return sum(s.replicas for s in self.stages)

    @property
    def balance(self) -> list[int]:
        """Layers per stage."""
        return [s.last_layer - s.first_layer + 1 for s in self.stages]

    @property
    def replicas(self) -> list[int]:
        """Workers per stage."""
        return [s.replicas for s in self.stages]

    @property
    def config(self) -> str:
        """Replicas per stage, PipeDream-style: ``"15-1"``."""
        return "-".join(str(s.replicas) for s in self.stages)

    @property
    def noam(self) -> int:
        """Minibatches the input stage admits before its first backward: ceil(workers / its replicas)."""
        return -(-self.workers // self.stages[0].replicas)

    @property
    def speedup_vs_dp(self) -> float:
        """Predicted speedup over data parallelism (infinite when data parallelism does not fit)."""
        return self.data_parallel_seconds / self.seconds_per_minibatch

    @property
    def speedup_vs_single(self) -> float:
        """Predicted speedup over one worker (infinite when the model does not fit on one)."""
        return self.single_worker_seconds / self.seconds_per_minibatch


def optimize(
    profile: Profile,
    topology: Topology,
    straight: bool = False,
    *,
    schedule: str = "pipedream",
    memory: float | None = None,
    microbatches: int | None = None,
    cost_model: str = "physical",
) -> Plan:
    """The plan with the least predicted time per minibatch that fits in memory.

    Args:
        profile: the model's layers; its batch is what flows through the pipeline as one unit (a
            microbatch of the runtime).
        topology: the cluster; every worker is used.
        straight: give every stage exactly one worker (no replication).
        schedule: one of :data:`~conveyor.schedule.PLANNER_SCHEDULES`; sets how many weight versions and
            stashed activations a worker holds (:mod:`conveyor.plan._memory`).
        memory: bytes per worker; ``None`` for no limit.
        microbatches: microbatches per optimizer step for ``flush`` and ``gpipe`` (default: the worker count).
        cost_model: ``"physical"`` (the runtime on the topology's links) or ``"pipedream"`` (the PipeDream
            optimizer's own terms), see :mod:`conveyor.plan._cost_model`.

    The memory check is exact with one topology level. With two, the inner level's stash counts round the
    workers that follow it up to a grid; with more, they assume every worker of the cluster follows
    (:mod:`conveyor.plan._partition`). Either way the plan fits, but a tighter one may be missed.

    Raises:
        PlanError: no plan satisfies the constraints (a straight pipeline with more workers than layers, or
            no split fits in ``memory``).
    """
    plan = _search(
        profile, topology, straight, schedule=schedule, memory=memory, microbatches=microbatches, cost_model=cost_model
    )
    if plan is not None:
        return plan
    if memory is not None and _search(profile, topology, straight, cost_model=cost_model) is not None:
        microbatches = microbatches or topology.workers
        raise PlanError(
            _memory_advice(
                profile, topology, straight=straight, schedule=schedule, memory=memory, microbatches=microbatches
            )
        )
    raise PlanError(
        f"no straight pipeline of {profile.model} ({len(profile)} layers) uses exactly {topology.workers} workers: "
        f"use at most {len(cuts_of(profile).sets) - 1} workers, or allow replicated stages"
    )


def _search(
    profile: Profile,
    topology: Topology,
    straight: bool,
    *,
    schedule: str = "pipedream",
    memory: float | None = None,
    microbatches: int | None = None,
    cost_model: str = "physical",
) -> Plan | None:
    """:func:`optimize`'s plan, or None where none fits (the caller says why: the search itself never advises, so
    :func:`_memory_advice` can bisect over it without advising at every step)."""
    try:
        update = planned_kind(schedule).update
        check_cost_model(cost_model)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    total, microbatches = topology.workers, microbatches or topology.workers
    cuts = cuts_of(profile)
    n = len(cuts.sets) - 1  # boundaries 0..n; a stage [i, j) holds the layers of boundary j not in boundary i
    nested = cuts.nested()
    compute = np.where(nested, cuts.span([lay.forward_s + lay.backward_s for lay in profile.layers]), np.inf)
    cost = _StageCost(
        cost_model=cost_model,
        topology=topology,
        weights=np.where(nested, cuts.span([lay.param_bytes for lay in profile.layers]), 0.0),
        cut=cuts.crossing(profile),
        per_update=None if update == "round" else microbatches,
    )
    mem = None if memory is None else MemoryModel(profile, cuts, memory, schedule, microbatches)
    levels = _levels(cost, topology, compute, straight, mem)
    best = float(levels[-1].best_s[0, 0, n, topology.levels[-1].count])
    if not np.isfinite(best):
        return None
    order: list[int] = []  # the layers in the plan's order: each stage's after the stages before it
    stages = []
    for a, last, r, t in flat_stages(levels, cost, topology, len(levels) - 1, 0, n, topology.levels[-1].count, 0):
        layers = cuts.layers(a, last + 1)
        stages.append(PlannedStage(len(order), len(order) + len(layers) - 1, r, t))
        order += layers
    layer_order = () if order == list(range(len(profile))) else tuple(order)
    profile = profile.reordered(order) if layer_order else profile
    microbatches = step_microbatches(schedule, [st.replicas for st in stages], microbatches)
    dp = single = float(compute[0, n])
    for k, level in enumerate(topology.levels):
        dp = float(cost(k, dp, 0, n, level.count))
    fits = _Fits(profile, memory, schedule, microbatches)
    return Plan(
        tuple(fits.annotated(stages)),
        best,
        dp if fits.whole(replicas=total) else np.inf,
        single if fits.whole(replicas=1) else np.inf,
        schedule,
        microbatches,
        memory,
        cost_model=cost_model,
        layers=layer_order,
        note=cuts.why_not_graph,
    )


@dataclass(frozen=True)
class _StageCost:
    """``T_k``, the seconds per minibatch of a stage (a :data:`~conveyor.plan._partition.StageCost`): layers
    ``[i, j)`` on ``units`` units of level ``k``, each taking ``inner`` per minibatch; ``weights[i, j]`` their
    parameters' bytes and ``cut[s]`` the bytes crossing boundary ``s``."""

    cost_model: str
    topology: Topology
    weights: np.ndarray
    cut: np.ndarray
    per_update: int | None

    def __call__(
        self, k: int, inner: np.ndarray | float, i: Index, j: Index, units: Index, within: tuple[int, int] | None = None
    ) -> np.ndarray:
        """For a stage of the level below inside this level's stage ``within``, only that stage's ends cross
        this level's links."""
        start, stop = within or (i, j)
        into = np.where(np.asarray(i) == start, self.cut[i], 0.0)
        out = np.where(np.asarray(j) == stop, self.cut[j], 0.0)
        return stage_seconds(
            self.cost_model,
            self.topology,
            k=k,
            inner=inner,
            weights=self.weights[i, j],
            cut_in=into,
            cut_out=out,
            units=units,
            per_update=self.per_update,
            first=np.asarray(start) == 0,
        )


def _levels(
    cost: _StageCost, topology: Topology, compute: np.ndarray, straight: bool, mem: MemoryModel | None
) -> list[Partition]:
    """``A_k`` level by level, innermost first: each level's best pipelines over every span of boundaries, from
    the level below's (``compute``, each span's forward and backward, below the first)."""
    extras, pick = extras_grid(topology, mem)
    levels: list[Partition] = []
    inner = compute[None]
    n = compute.shape[0] - 1
    rows, cols = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    for k, level in enumerate(topology.levels):
        stage_s = cost(k, inner[..., None], rows[..., None], cols[..., None], np.arange(level.count + 1))
        stage_s[..., 0] = np.inf
        if straight:
            stage_s[..., 2:] = np.inf
        top = k == len(topology.levels) - 1
        first = k == 0
        levels.append(
            solve(
                stage_s,
                level.count,
                top=top,
                memory=mem if first else None,
                extras=extras,
                pick=None if first else pick,
            )
        )
        inner = levels[-1].best_s[..., level.count]
    return levels


@dataclass(frozen=True)
class _Fits:
    """What a layout's stages hold in a worker's memory under ``schedule``, against the ``memory`` limit (None:
    no limit)."""

    profile: Profile
    memory: float | None
    schedule: str
    microbatches: int

    def _bytes(self, first: int, stop: int, replicas: int, downstream: int) -> int:
        return stage_bytes(
            self.profile,
            first=first,
            stop=stop,
            schedule=self.schedule,
            replicas=replicas,
            downstream=downstream,
            microbatches=self.microbatches,
        )

    def whole(self, *, replicas: int) -> bool:
        """Whether the whole model fits on each of ``replicas`` data-parallel workers."""
        everything = len(self.profile)
        return self.memory is None or self._bytes(0, everything, replicas, replicas) <= self.memory

    def annotated(self, stages: list[PlannedStage]) -> list[PlannedStage]:
        """``stages`` with each one's bytes (``memory_bytes``; the stages after it count for what it keeps)."""
        downstream = np.cumsum([st.replicas for st in stages][::-1])[::-1]
        return [
            replace(st, memory_bytes=self._bytes(st.first_layer, st.last_layer + 1, st.replicas, int(d)))
            for st, d in zip(stages, downstream, strict=True)
        ]


def step_microbatches(schedule: str, replicas: list[int], at_least: int) -> int:
    """The microbatches per optimizer step to run the layout with: ``at_least`` (any count runs; a replica
    may get one microbatch more than another), or for ``2bw`` the fewest from there on with which two
    weight versions suffice."""
    return twobw_min_microbatches(replicas, at_least) if schedule == "2bw" else at_least


def _memory_advice(
    profile: Profile, topology: Topology, *, straight: bool, schedule: str, memory: float, microbatches: int
) -> str:
    """Why nothing fits, with the least memory per worker (within 1%) for which some plan does."""
    n = len(profile)
    low, high = (
        memory,
        float(
            stage_bytes(
                profile,
                first=0,
                stop=n,
                schedule=schedule,
                replicas=1,
                downstream=topology.workers,
                microbatches=microbatches,
            )
        ),
    )
    while high > 1.01 * low:
        middle = (low * high) ** 0.5
        fits = _search(profile, topology, straight, schedule=schedule, memory=middle, microbatches=microbatches)
        low, high = (low, middle) if fits is not None else (middle, high)
    return (
        f"no plan of {profile.model} on {topology.workers} workers fits in {memory:.4g} bytes per worker with the "
        f"{schedule} schedule; the least that fits is about {high:.3g} bytes: give that much memory or more "
        "workers, pick a schedule that stashes less (2bw keeps two weight versions, flush and gpipe one), or "
        "profile a smaller microbatch"
    )
