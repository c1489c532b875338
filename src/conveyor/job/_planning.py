"""A training job's start-up: every worker measures (or reads the figures kept for the job), and the first plans
the layout from them, writes the plan file and tells every worker (:func:`measure_and_plan`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

import conveyor.job._data as datasets
from conveyor.config import TrainConfig
from conveyor.emulate import Emulation
from conveyor.job._config import autocast_dtype, explicit_workers, prediction_leaves_out
from conveyor.job._costs import Costs
from conveyor.job._layout import Layout, choose_layout, fixed_layout, microbatches_of
from conveyor.job._loader import epochs_when_read
from conveyor.job._loop import Trainer
from conveyor.job._measured import kept_or_measured
from conveyor.job._model import materializer
from conveyor.job._trial import TRIALS, record_trial, run_trial, trial_batches, worth_trying
from conveyor.runtime import CoreShare, OptimizerFactory, default_device, under_torchrun

__all__ = ["may_use_fewer", "measure_and_plan"]

T = TypeVar("T")


def measure_and_plan(
    cfg: TrainConfig,
    model: nn.Sequential,
    *,
    data: datasets.Dataset,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    make_optimizer: OptimizerFactory,
    folder: Path,
    steps: int,
    cores: CoreShare | None,
    build: Callable[[Layout], Trainer],
) -> Layout:
    """Every worker measures (the cores as busy as in the run); the first one plans and predicts an epoch of
    ``steps`` batches, writes the plan file, and every worker gets the layout, which every worker then tries where
    no run has measured it on these figures (:mod:`conveyor.job._trial`; ``build`` makes a pipeline of a layout
    on a copy of the model), the first planning again with what the trial measured. ``cores``: the CPU's share,
    as :class:`~conveyor.runtime.CoreShare` last measured it (``None`` off the CPU)."""
    # At least two batches (the first a warm-up), at the microbatch count of a fixed layout if there is one.
    B = cfg.optimizer.batch_size
    sample = data.first_batches(B, min(steps, 7))
    fixed = fixed_layout(cfg, len(model), dist.get_world_size())
    microbatches = microbatches_of(cfg, dist.get_world_size()) if fixed is None else fixed.microbatches
    emulation = Emulation(network=cfg.emulation.network, devices=cfg.emulation.devices)
    network, devices = emulation.topology(dist.get_world_size()), emulation.device_list(dist.get_world_size())
    device_cores = devices[dist.get_rank()].cores if devices else None
    device = default_device()
    # One worker is timed over the run's own feed; through loader processes, over the sample (none are started).
    feed = epochs_when_read(data.train_x, data.train_y, B, cfg.run.seed, device=device)
    costs = kept_or_measured(
        cfg,
        model,
        (sample * 2)[: max(2, len(sample))],
        microbatches=microbatches,
        loss_fn=loss_fn,
        optimizer=make_optimizer,
        device=device,
        share=cores,
        name=cfg.model.name,
        network=network,
        device_cores=device_cores,
        autocast=autocast_dtype(cfg),
        materialize=materializer(cfg, model),
        feed=None if cfg.run.loader_workers else feed,
    )
    names = [name for name, _ in model.named_children()]
    trials: list[dict[str, Any]] = []  # what each trial measured, for the plan file (on the first worker)

    def plan(costs: Costs, *, measured_only: bool = False) -> Layout:
        return _plan(
            cfg,
            costs,
            names=names,
            steps=steps,
            samples=data.samples,
            fixed=fixed,
            folder=folder,
            trials=trials,
            measured_only=measured_only,
        )

    if costs is not None and prediction_leaves_out(cfg):  # a miss says nothing of the layout: keep no ratio for it
        costs = replace(costs, key=None)
    layout = _told(plan(costs) if costs is not None else None)
    for tried in range(TRIALS + 1):
        if not _told(costs is not None and worth_trying(cfg, layout, costs, dist.get_world_size())):
            break
        if tried == TRIALS:  # the trials spent, and the planner would run one more untried: the best one measured
            return _told(plan(costs, measured_only=True) if costs is not None else None)
        batches = trial_batches(layout, steps)
        seconds = run_trial(build, layout, data, batches=batches, batch_size=B, device=device)
        if costs is not None:
            costs, record = record_trial(costs, layout, batches=batches, seconds=seconds)
            trials.append(record)
            Console().print(_tried(layout, record, samples=batches * B))
        layout = _told(plan(costs) if costs is not None else None)
    return layout


def _told(value: T | None) -> T:
    """The first worker's ``value`` on every worker."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def _tried(layout: Layout, record: dict[str, Any], *, samples: int) -> str:
    """The line that says what a trial measured."""
    config, ratio = "-".join(map(str, layout.replicas)), float(record["measured_over_simulated"])
    return (
        f"tried {config} on {layout.schedule} for {record['batches']} batches: "
        f"{samples / record['measured_seconds']:.0f} training samples/s, {ratio:.2f} times its simulated "
        f"{samples / record['simulated_seconds']:.0f}; planned again with that"
    )


def _plan(
    cfg: TrainConfig,
    costs: Costs,
    *,
    names: list[str],
    steps: int,
    samples: int,
    fixed: Layout | None,
    folder: Path,
    trials: list[dict[str, Any]],
    measured_only: bool = False,
) -> Layout:
    """Choose the layout from ``costs``, write the plan file (with the ``trials`` so far, where there were any) and
    print the plan. Across a WAN (``--wan`` other than ``off``) the replicas all-reduce inside each site, so the plan
    is made with that all-reduce; what crosses the WAN is left out of the prediction, and the printout says so."""
    across_wan = cfg.wan.mode != "off"
    chosen = choose_layout(
        cfg,
        names=names,
        costs=costs.within_sites() if across_wan else costs,
        batches=steps,
        samples=samples,
        layout=fixed,
        fewer=may_use_fewer(cfg),
        measured_only=measured_only,
    )
    if trials:
        chosen.plan_file["trials"] = list(trials)
    (folder / "plan.json").write_text(json.dumps(chosen.plan_file, indent=2))
    Console().print(chosen.describe())
    if across_wan:
        Console().print(f"(--wan {cfg.wan.mode}: the prediction leaves out what crosses the WAN)")
    return chosen


def may_use_fewer(cfg: TrainConfig) -> bool:
    """Whether the planner may run the job on fewer workers than it starts: where the count is Conveyor's to
    choose (no ``--workers``, no fixed layout or schedule) and the workers are interchangeable (one machine, no
    emulated cluster, no straggler handling, which need their count)."""
    emulated = cfg.emulation.network or cfg.emulation.devices or cfg.emulation.faults
    return (
        cfg.layout.workers is None
        and cfg.layout.schedule == "auto"
        and explicit_workers(cfg.layout) is None
        and not (emulated or under_torchrun() or cfg.stragglers is not None)
    )
