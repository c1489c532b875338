"""How a training job lays its model out on the workers: from the planner, a plan file, or fixed options.

With ``schedule="auto"`` and no fixed layout, :func:`choose_layout` plans the model for the job's workers
with every schedule the planner knows and keeps the one with the shortest predicted time to accuracy: the
simulator's time per epoch times the epochs the schedule needs over data parallelism's, measured by
``conveyor bench convergence`` (:mod:`conveyor.plan._epochs`; the flush schedule first among equals: it has
no stale weights). Planning and prediction use what the job measured at
start-up (:mod:`conveyor.job._costs`): the profile with the cores as busy as in the run, the link between
workers, the runtime's cost per action. Every layout, fixed or planned, gets a prediction of its training
throughput over one epoch (one run of its schedule, fill and drain included), which the run sets against
what it measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from conveyor.config import TrainConfig
from conveyor.errors import InputError
from conveyor.job._costs import Costs
from conveyor.plan import Plan, PlannedStage, layout_key, predict, shortlist
from conveyor.plan.parts import EpochFactors, layout_file, plan_file, read_plan_file
from conveyor.runtime.parts import even_balance
from conveyor.schedule import kind, parse_replicas
from conveyor.stragglers import flexible_layout

__all__ = ["Layout", "choose_layout", "fixed_layout", "microbatches_of", "simulated_seconds"]

# The planner's schedules in order of preference when predictions tie: synchronous first, then the least stale.
_PREFERENCE = ("flush", "2bw", "pipedream", "gpipe")
PIPELINE_MICROBATCHES = 4  # a pipeline's microbatches per batch where --microbatches is not given
SHORTLIST = 8  # the simulated layouts a plan file records, the fastest first
# A spread of the start-up figures above which the plan says they are noisy: quiet, this machine's MLP, VGG and
# ResNet gave 0.05-0.25; beside a busy process, the MLP 2.97 and ResNet 1.42.
NOISY_SPREAD = 0.5


def microbatches_of(cfg: TrainConfig, workers: int) -> int:
    """Microbatches per batch: ``--microbatches``, else 1 for a job of one worker (no pipeline to fill: a batch is
    one forward and one backward, as in a plain loop) and :data:`PIPELINE_MICROBATCHES` otherwise."""
    if cfg.layout.microbatches is not None:
        return int(cfg.layout.microbatches)
    return 1 if workers == 1 else PIPELINE_MICROBATCHES


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Stages (``balance``: blocks per stage), replicas per stage, the schedule and its microbatches."""

    schedule: str
    balance: list[int]
    replicas: list[int]
    microbatches: int
    recompute: bool = False
    how: str = ""
    stale_rate: str | None = None  # the stale-gradient correction's rate (EpochFactors.rate; None: none corrected)
    plan_file: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def predicted_samples_per_s(self) -> float:
        """The plan file's predicted training samples per second."""
        return float(self.plan_file["predicted"]["samples_per_s"])

    @property
    def measured_over_simulated(self) -> float:
        """What an earlier run of this layout on the same figures measured over its simulated rate (1: none)."""
        return float(self.plan_file.get("predicted", {}).get("measured_over_simulated", 1.0))

    @property
    def figures_source(self) -> str:
        """Where the figures planned with came from (measured at start-up, or kept from an earlier run)."""
        return str(self.plan_file.get("measured_at_start", {}).get("source", ""))

    def describe(self) -> str:
        config = "-".join(map(str, self.replicas))
        predicted = self.plan_file.get("predicted", {})
        return (
            f"{self.how}: {self.schedule} schedule, {len(self.balance)} stage(s) of {self.balance} blocks, "
            f"replicas {config} ({sum(self.replicas)} workers), {self.microbatches} microbatches per batch"
            + (
                ""
                if not predicted
                else f"; predicted {predicted['samples_per_s']:.0f} training samples/s "
                f"({predicted['epoch_seconds']:.2f} s per epoch) x {predicted['epochs_factor']:.2f} the epochs of "
                "data parallelism"
            )
            + (", stale stages at the damped learning rate (--stale-rate)" if self.stale_rate == "damped" else "")
            + self._corrected()
            + (f", from figures {source}" if (source := self.figures_source) and source.startswith("kept") else "")
            + self._noise()
            + self._oversubscribed()
        )

    def _corrected(self) -> str:
        """Where a trial or an earlier run of this layout on the same figures measured off its simulation, how it
        counts."""
        if (ratio := self.measured_over_simulated) == 1.0:
            return ""
        return f", at {ratio:.2f} times its simulated rate (what a trial or an earlier run measured on these figures)"

    def _oversubscribed(self) -> str:
        """Where the workers outnumber the cores they share, a warning that the prediction is optimistic."""
        measured = self.plan_file.get("measured_at_start", {})
        cores, workers = measured.get("cores"), sum(self.replicas)
        corrected = self.measured_over_simulated != 1.0  # a run of it measured: the prediction counts that
        if cores is None or workers <= cores or corrected:
            return ""
        return (
            f". {workers} workers share {cores} cores: a message or an all-reduce then wakes a worker that waits for "
            "a core, which the prediction leaves out, and such layouts ran 22-61% under their prediction in "
            "conveyor's measurements (docs/benchmarks/predictions.md); at most one worker per core is predicted "
            "better"
        )

    def _noise(self) -> str:
        """Where the start-up figures varied more than :data:`NOISY_SPREAD`, a warning that says so."""
        spread = float(self.plan_file.get("measured_at_start", {}).get("spread", 0.0))
        if spread <= NOISY_SPREAD:
            return ""
        return (
            f". The start-up figures varied {spread:.0%} around their median (other work on this machine?): the "
            "prediction is no better than that, and layouts that close were not told apart; --remeasure when it is "
            "quieter"
        )


def fixed_layout(cfg: TrainConfig, blocks: int, workers: int) -> Layout | None:
    """The layout a :class:`~conveyor.config.TrainConfig` fixes (a plan file, or stages and replicas), checked
    against the model's ``blocks`` and the job's ``workers`` (0: not known); ``None`` when the planner decides.
    One worker with the schedule left to Conveyor is one stage with the flush schedule: a plain training loop.

    Raises:
        ValueError: a plan file for another worker count or model, a layout for another worker count, or a
            layout the model cannot take.
    """
    if cfg.layout.plan:
        spec = read_plan_file(cfg.layout.plan)
        if spec.workers != workers:
            raise InputError(
                f"the plan {cfg.layout.plan} is for {spec.workers} workers but the job has {workers}: start "
                f"{spec.workers} (--workers {spec.workers}) or plan again for {workers}"
            )
        if spec.layers != blocks:
            raise InputError(
                f"the plan {cfg.layout.plan} splits {spec.layers} layers but {cfg.model.name} has {blocks} blocks"
            )
        schedule = spec.schedule if cfg.layout.schedule == "auto" else cfg.layout.schedule
        return Layout(
            schedule=schedule,
            balance=spec.balance,
            replicas=spec.replicas,
            microbatches=spec.microbatches,
            recompute=spec.recompute,
            how=f"plan {cfg.layout.plan}",
            stale_rate=spec.stale_rate,
        )
    if cfg.layout.stages or cfg.layout.replicas:
        replicas = (
            parse_replicas(cfg.layout.replicas, cfg.layout.stages)
            if cfg.layout.replicas
            else [1] * (cfg.layout.stages or 1)
        )
        if workers and sum(replicas) != workers:  # (0: not known yet; torchrun's count is checked here alone)
            needed, text = sum(replicas), "-".join(map(str, replicas))
            raise InputError(
                f"the pipeline has {len(replicas)} stages with replicas {text}, which need {needed} workers, but "
                f"{workers} were started: start {needed} (torchrun --nproc_per_node {needed}), or give --stages "
                f"and --replicas for {workers} workers"
            )
        schedule = "flush" if cfg.layout.schedule == "auto" else cfg.layout.schedule
        microbatches = microbatches_of(cfg, sum(replicas))
        balance = even_balance(blocks, len(replicas))
        return Layout(
            schedule=schedule, balance=balance, replicas=replicas, microbatches=microbatches, how="fixed layout"
        )
    if workers == 1 and cfg.layout.schedule == "auto":
        return Layout(
            schedule="flush", balance=[blocks], replicas=[1], microbatches=microbatches_of(cfg, 1), how="one worker"
        )
    return None


def choose_layout(
    cfg: TrainConfig,
    *,
    names: list[str],
    costs: Costs,
    batches: int,
    samples: int,
    layout: Layout | None = None,
    fewer: bool = False,
    measured_only: bool = False,
) -> Layout:
    """The layout for a :class:`~conveyor.config.TrainConfig` on ``costs.workers`` workers (``layout`` when
    :func:`fixed_layout` gave one, else the planner's: on fewer of them too where ``fewer``; only among layouts a
    trial or a run measured on these figures, and one worker, where ``measured_only``), its plan file with the
    prediction for an epoch (one run of ``batches`` batches, ``samples`` samples) and the figures it rests on."""
    prof = costs.profile
    epochs = EpochFactors.load(cfg.optimizer.epoch_factors)
    if layout is not None:
        rate = _stale_rate(cfg, epochs, prof.model, layout)
        file = layout_file(layout.schedule, layout.microbatches, layout.balance, layout.replicas, names)
        seconds = simulated_seconds(layout, costs, batches)
        key = layout_key(layout.schedule, layout.replicas, layout.balance, layout.microbatches)
        file["predicted"] = {
            "simulated_seconds": seconds,
            "layout_key": key,
            "measured_over_simulated": costs.layout_ratios.get(key, 1.0),
            "epochs_factor": epochs.factor(
                prof.model, layout.schedule, corrected=cfg.optimizer.stale_correction, rate=rate or "sample"
            ),
            "epochs_factor_source": epochs.source,
        }
    else:
        plan, file, how = _planned(cfg, costs, batches=batches, epochs=epochs, fewer=fewer, measured=measured_only)
        layout = Layout(
            schedule=plan.schedule,
            balance=plan.balance,
            replicas=plan.replicas,
            microbatches=plan.microbatches,
            how=how,
        )
        rate = _stale_rate(cfg, epochs, prof.model, layout)
    # An epoch as it runs: its samples over the simulated time of its batches, as an earlier run of it measured.
    predicted = file["predicted"]
    seconds = predicted["simulated_seconds"] / predicted["measured_over_simulated"]
    predicted.update(samples_per_s=samples / seconds, epoch_seconds=seconds)
    file["stale_rate"] = rate
    file["measured_at_start"] = costs.summary()
    file["threads"] = torch.get_num_threads()  # the first worker's intra-op threads, chosen afresh every run
    return replace(layout, plan_file=file, stale_rate=rate)


def simulated_seconds(layout: Layout, costs: Costs, batches: int) -> float:
    """``layout`` simulated over a run of ``batches`` batches on ``costs`` (its workers all the job's)."""
    ranges, first = [], 0
    for blocks, r in zip(layout.balance, layout.replicas, strict=True):
        ranges.append(PlannedStage(first, first + blocks - 1, r, 0.0))
        first += blocks
    plan = Plan(tuple(ranges), 0.0, 0.0, 0.0, layout.schedule, layout.microbatches, recompute=layout.recompute)
    return predict(plan, costs.profile, costs.topology, batches * plan.microbatches, costs.runtime).seconds


def _stale_rate(cfg: TrainConfig, epochs: EpochFactors, model: str, layout: Layout) -> str | None:
    """The stale-gradient correction's rate the workers run ``layout`` at (``None``: no stale stage is corrected, as
    for a synchronous schedule, ``--no-stale-correction``, or ``--stragglers``' flexible data parallelism)."""
    asked = cfg.optimizer.stale_rate
    rate = epochs.run_rate(model, layout.schedule, corrected=cfg.optimizer.stale_correction, asked=asked)
    if rate is None or (cfg.stragglers is not None and flexible_layout(layout.replicas)):
        return None
    return layout.stale_rate if asked == "auto" and layout.stale_rate is not None else rate  # a plan file's first


def _planned(
    cfg: TrainConfig, costs: Costs, *, batches: int, epochs: EpochFactors, fewer: bool, measured: bool
) -> tuple[Plan, dict[str, Any], str]:
    """The planner's layout (:func:`~conveyor.plan.shortlist`: every schedule on every worker count allowed,
    simulated; where ``measured``, only those with a ratio on these figures and one worker), its plan file with the
    best :data:`SHORTLIST` layouts simulated, and how it was chosen."""
    # A schedule the planner has no memory model for is planned as its record says (no memory limit here).
    schedule = cfg.layout.schedule
    schedules = _PREFERENCE if schedule == "auto" else [kind(schedule).plan_as or schedule]
    counts = range(1, costs.workers + 1) if fewer else [costs.workers]
    batch = int(cfg.optimizer.batch_size)
    simulated = shortlist(
        costs.profile,
        costs.topology,
        schedules=schedules,
        microbatches=lambda workers: microbatches_of(cfg, workers),
        batches=batches,
        runtime=costs.runtime,
        worker_counts=counts,
        alone=costs.alone(batch=batch, microbatches=microbatches_of(cfg, 1)),
        epochs=epochs,
        stale_correction=cfg.optimizer.stale_correction,
        stale_rate=cfg.optimizer.stale_rate,
        tie=costs.spread,
        ratios=costs.layout_ratios,
    )
    if measured:  # what runs has been timed on this machine: one worker at start-up, a pipeline by a trial or a run
        simulated = [s for s in simulated if s.workers == 1 or s.key in costs.layout_ratios] or simulated
    best = simulated[0]
    plan = best.plan
    if schedule != "auto" and schedule != plan.schedule:  # pipedream-vs is planned as pipedream; runs as itself
        plan = replace(plan, schedule=schedule)
    file = plan_file(
        plan,
        best.profile,
        topology=best.topology,
        minibatches=batches * plan.microbatches,
        runtime=costs.runtime,
        epochs=epochs,
        stale_correction=cfg.optimizer.stale_correction,
        stale_rate=cfg.optimizer.stale_rate,
    )
    # Under the key it was planned as (pipedream-vs runs as itself, planned as pipedream).
    file["predicted"].update(layout_key=best.key, measured_over_simulated=best.ratio)
    file["candidates"] = [s.to_json() for s in simulated[:SHORTLIST]]
    how = f"planned for {costs.workers} workers"
    if best.workers < costs.workers:
        how = f"planned for 1..{costs.workers} workers: {best.workers} of the {costs.workers} started train"
    fastest = min(simulated, key=lambda s: s.time_to_accuracy)
    measured_ones = "measured " if measured else ""
    chosen = (
        f"the fastest of {len(simulated)} {measured_ones}layouts simulated"
        if len(simulated) > 1
        else f"the one {measured_ones}layout simulated"
    )
    if fastest is not best:
        chosen = (
            f"the simplest within the start-up figures' {costs.spread:.0%} spread of the fastest of {len(simulated)} "
            f"layouts simulated ({fastest.plan.config} on {fastest.schedule})"
        )
    return plan, file, f"{how} ({chosen})"
