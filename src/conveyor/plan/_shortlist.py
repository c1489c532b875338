"""The layout to run: the planner's best plan for each schedule and worker count, each simulated, the fastest kept.

PipeDream's search (:func:`~conveyor.plan.optimize`) ranks layouts by a steady state: its slowest stage. It
misses what only the schedule's action lists show (fill and drain, replicas' gradients returning in turn, the
cores workers share), and on a small model it cannot see that no pipeline pays. So the planner's answer is a
shortlist: for every schedule asked and every worker count allowed (fewer than the job started too, and one
worker alone), the plans of three searches (:data:`SEARCHES`: the physical cost model's, PipeDream's own cost
model's, and a straight pipeline's), each simulated over an epoch's batches with :func:`~conveyor.plan.predict` on
the measured costs; the shortest time to accuracy (a sample's simulated time times the epochs the schedule needs
over data parallelism's) wins. Layouts within ``tie`` of it (relative; at least :data:`TIE`) are not told apart: the
measured figures vary that much (a job passes their spread), so of those the one with the fewest workers wins,
then the earlier schedule: a plan changes only for a predicted gain larger than the figures' spread.

Example (two layers with no weights on two workers, and the same model alone on one worker four times faster):
    >>> from conveyor.plan._profiles import Profile
    >>> from conveyor.plan._topology import Topology
    >>> p = Profile.chain("toy", [1.0, 1.0], [2.0, 2.0], [0, 0], [0, 0], batch_size=8)
    >>> alone = Profile.chain("toy", [0.25, 0.25], [0.5, 0.5], [0, 0], [0, 0], batch_size=8)
    >>> best = shortlist(p, Topology.parse("2:1e9"), schedules=["flush", "pipedream"], microbatches=lambda w: 2,
    ...                  batches=8, worker_counts=[1, 2], alone=alone)
    >>> [(s.schedule, s.plan.config, round(s.samples_per_s, 2)) for s in best][:3]
    [('flush', '1', 5.33), ('flush', '2', 2.67), ('pipedream', '2', 2.67)]
    >>> [s.plan.config for s in best][3:]  # the straight pipeline's search: two stages
    ['1-1', '1-1']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from conveyor.plan._epochs import EpochFactors
from conveyor.plan._optimizer import Plan, PlanError, optimize
from conveyor.plan._predict import RuntimeCosts, predict
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology

__all__ = ["TIE", "SimulatedLayout", "layout_key", "shortlist"]

TIE = 0.001  # simulated times to accuracy this close (relative) are a tie
# The searches whose plans are simulated, as (cost model, straight): their steady states rank layouts differently
# (plan-vs-run's profile: 2-1-1 by the physical model, 3-1 by PipeDream's, which runs 40% faster).
SEARCHES = (("physical", False), ("pipedream", False), ("physical", True))


def layout_key(schedule: str, replicas: Sequence[int], balance: Sequence[int], microbatches: int) -> str:
    """A layout's name among the figures a run measured (``shortlist``'s ``ratios``).

    Example:
        >>> layout_key("pipedream", [1, 1], [3, 4], 4)
        'pipedream 1-1 [3, 4] x4'
    """
    return f"{schedule} {'-'.join(map(str, replicas))} {list(balance)} x{microbatches}"


@dataclass(frozen=True, kw_only=True)
class SimulatedLayout:
    """One layout of the shortlist and its simulation.

    Attributes:
        plan: the search's plan (for one worker alone: one stage, as a plain loop runs).
        profile: the profile it was simulated with.
        topology: the workers it runs on.
        seconds: the simulated time of the epoch's batches, fill and drain included.
        samples_per_s: the simulated training samples per second.
        epochs_factor: the epochs its schedule needs over data parallelism's.
        ratio: what a run of this layout on the same figures measured over its simulated rate (1: none ran or
            missed); the layout is predicted and ranked at ``samples_per_s`` times it.
    """

    plan: Plan
    profile: Profile
    topology: Topology
    seconds: float
    samples_per_s: float
    epochs_factor: float
    ratio: float = 1.0

    @property
    def workers(self) -> int:
        return self.plan.workers

    @property
    def schedule(self) -> str:
        return self.plan.schedule

    @classmethod
    def of(
        cls,
        plan: Plan,
        profile: Profile,
        topology: Topology,
        *,
        batches: int,
        runtime: RuntimeCosts | None,
        epochs_factor: float,
    ) -> SimulatedLayout:
        """``plan`` simulated over an epoch of ``batches`` batches (each of its microbatches) on ``runtime``."""
        sim = predict(plan, profile, topology, batches * plan.microbatches, runtime)
        return cls(
            plan=plan,
            profile=profile,
            topology=topology,
            seconds=sim.seconds,
            samples_per_s=sim.samples_per_s,
            epochs_factor=epochs_factor,
        )

    @property
    def key(self) -> str:
        """Its :func:`layout_key`."""
        return layout_key(self.schedule, self.plan.replicas, self.plan.balance, self.plan.microbatches)

    @property
    def time_to_accuracy(self) -> float:
        """Seconds a sample takes, as predicted (simulated, times :attr:`ratio`), times the epochs the schedule
        needs over data parallelism's: the time to accuracy per sample of an epoch (layouts whose batches hold as
        many samples compare as their epochs)."""
        return self.epochs_factor / (self.samples_per_s * self.ratio)

    def to_json(self) -> dict[str, Any]:
        """The plan file's record of it."""
        return {
            "workers": self.workers,
            "schedule": self.schedule,
            "config": self.plan.config,
            "balance": self.plan.balance,
            "microbatches": self.plan.microbatches,
            "simulated_seconds": self.seconds,
            "samples_per_s": self.samples_per_s,
            "epochs_factor": self.epochs_factor,
            "measured_over_simulated": self.ratio,
            "layout_key": self.key,
        }


def shortlist(
    profile: Profile,
    topology: Topology,
    *,
    schedules: Sequence[str],
    microbatches: Callable[[int], int],
    batches: int,
    runtime: RuntimeCosts | None = None,
    worker_counts: Sequence[int] | None = None,
    alone: Profile | None = None,
    epochs: EpochFactors | None = None,
    stale_correction: bool = True,
    stale_rate: str = "auto",
    tie: float = TIE,
    ratios: Mapping[str, float] | None = None,
) -> list[SimulatedLayout]:
    """Every schedule's plan on every worker count, simulated; the fastest to accuracy first (see the module
    docstring).

    Args:
        profile: the model at the microbatch size, as the workers run it.
        topology: the job's workers, one level (``worker_counts`` below its count take its first workers) or more
            (then only all of them).
        schedules: the schedules to plan, in order of preference when the simulated times tie.
        microbatches: a job of ``w`` workers' microbatches per batch.
        batches: the batches of an epoch, each simulated.
        runtime: the runtime's own costs.
        worker_counts: the counts to plan for (default: every worker of ``topology``).
        alone: the model at one worker's microbatch size, as one worker alone runs it with every core
            (``None``: ``profile``); used for the one-worker layout.
        epochs: the epochs each schedule needs over data parallelism's (default: the shipped table).
        stale_correction: the asynchronous schedules' figures with the stale-gradient correction, or without.
        stale_rate: the correction's learning rate (:meth:`EpochFactors.rate`).
        tie: times to accuracy within this part of the fastest's are a tie (at least :data:`TIE`).
        ratios: by :func:`layout_key`, what runs of a layout on these figures measured over its simulated rate:
            where the simulation misses what a layout costs on this machine, the run that measured it says so.
    """
    epochs = epochs or EpochFactors.load()
    counts = sorted(set(worker_counts or [topology.workers]))
    if counts[0] < 1 or counts[-1] > topology.workers or (len(topology.levels) > 1 and counts != [topology.workers]):
        raise PlanError(f"cannot plan for {counts} workers on {topology} (one level: 1..{topology.workers})")
    found: list[SimulatedLayout] = []
    for workers in counts:
        on = Topology((replace(topology.levels[0], count=workers),)) if len(topology.levels) == 1 else topology
        if workers == 1:
            found.append(_one_worker(alone or profile, on, microbatches(1), batches, runtime, epochs))
            continue
        for plan in _plans(profile, on, schedules, microbatches(workers)):
            factor = epochs.factor(profile.model, plan.schedule, corrected=stale_correction, rate=stale_rate)
            found.append(SimulatedLayout.of(plan, profile, on, batches=batches, runtime=runtime, epochs_factor=factor))
    found = [replace(s, ratio=(ratios or {}).get(s.key, 1.0)) for s in found]
    order = {name: i for i, name in enumerate(schedules)}

    def rank(s: SimulatedLayout) -> tuple[float, int, int]:
        return (s.time_to_accuracy, s.workers, order.get(s.schedule, -1))

    found.sort(key=rank)
    fastest = found[0].time_to_accuracy
    tied = sum(s.time_to_accuracy <= fastest * (1 + max(tie, TIE)) for s in found)  # a prefix; fewer workers first
    return sorted(found[:tied], key=lambda s: rank(s)[1:]) + found[tied:]


def _plans(profile: Profile, topology: Topology, schedules: Sequence[str], microbatches: int) -> list[Plan]:
    """Every search's plan (:data:`SEARCHES`) for every schedule on ``topology``, each layout once."""
    plans: dict[tuple[str, str, tuple[int, ...], tuple[int, ...]], Plan] = {}
    for schedule in schedules:
        for cost_model, straight in SEARCHES:
            try:
                plan = optimize(
                    profile,
                    topology,
                    straight,
                    schedule=schedule,
                    microbatches=microbatches,
                    cost_model=cost_model,
                )
            except PlanError:  # a straight pipeline of more workers than the model has layers
                continue
            ends = tuple(st.last_layer for st in plan.stages)
            plans.setdefault((schedule, plan.config, ends, plan.layers), plan)
    return list(plans.values())


def _one_worker(
    profile: Profile,
    topology: Topology,
    microbatches: int,
    batches: int,
    runtime: RuntimeCosts | None,
    epochs: EpochFactors,
) -> SimulatedLayout:
    """One worker running the whole model as one stage of the flush schedule: a plain training loop."""
    plan = optimize(profile, topology, schedule="flush", microbatches=microbatches)
    factor = epochs.factor(profile.model, "flush")
    return SimulatedLayout.of(plan, profile, topology, batches=batches, runtime=runtime, epochs_factor=factor)
