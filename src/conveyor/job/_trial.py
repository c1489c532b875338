"""A trial of the planned layout before training, where no run has yet measured it on the job's figures.

The simulator charges what the start-up measured, and a pipeline on shared or emulated cores pays more: traced on
the emulated cluster (4 workers of 0.45 cores on 2 cores), each action of the run took 1.3-2.4x the CPU its
figure said and an all-reduce 0.8-1.3 ms of CPU the figures gave none, so first runs of pipelines there landed
16-47% under their simulation, while with the run's own per-action CPU the simulator came within 10% of them.
Those costs move with the layout, so a ratio learned on one layout says nothing of the next.

So every worker trains the planned layout on a copy of the model, on the job's first batches (up to an epoch of
them untimed, then a second's worth at the predicted rate, timed); what it measured over its simulation of those
batches is kept with the figures (:attr:`~conveyor.job._costs.Costs.layout_ratios`, as a run's miss is), and the
planner, which predicts each layout at its simulated rate times its ratio, plans again. A layout it then
prefers that has no ratio yet is tried too, up to :data:`TRIALS` in all; where it would then prefer yet another,
the job runs the fastest layout measured (tried, run, or one worker alone). The model itself is untouched, and
each worker's random stream is seeded again before training. Not tried: one worker (its rate is measured over
the job's own feed at start-up), a layout on fewer workers than the job started, a model built on the meta
device, a run whose prediction leaves out what it pays by design (``--wan``, faults, stragglers, a power
limit), and a run with ``--no-trial``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

import conveyor.job._data as datasets
from conveyor.config import TrainConfig
from conveyor.job._config import prediction_leaves_out
from conveyor.job._costs import Costs
from conveyor.job._layout import Layout, simulated_seconds
from conveyor.job._loop import Trainer
from conveyor.job._measured import correct_layout
from conveyor.runtime import to_device
from conveyor.runtime.parts import synchronize

__all__ = ["TRIALS", "record_trial", "run_trial", "trial_batches", "worth_trying"]

TRIALS = 3  # layouts tried at most, the planner planning again after each
TRIAL_BOUND = 4.0  # a trial's ratio is kept within [1/4, 4]
TRIAL_S = 1.0  # a trial's timed part lasts about this long at the predicted rate (after an epoch at most untimed)


def worth_trying(cfg: TrainConfig, layout: Layout, costs: Costs, world: int) -> bool:
    """Whether to try ``layout`` before training (see the module docstring)."""
    return (
        cfg.layout.trial
        and world > 1
        and sum(layout.replicas) == world
        and layout.plan_file["predicted"]["layout_key"] not in costs.layout_ratios
        and not prediction_leaves_out(cfg)
        and cfg.model.materialize != "stage"
    )


def trial_batches(layout: Layout, steps: int) -> int:
    """Batches a trial of ``layout`` times: about :data:`TRIAL_S` at its predicted rate (an epoch of ``steps``
    batches predicted), at least two."""
    per_batch = float(layout.plan_file["predicted"]["epoch_seconds"]) / steps
    return max(2, math.ceil(TRIAL_S / per_batch))


def run_trial(
    build: Callable[[Layout], Trainer],
    layout: Layout,
    data: datasets.Dataset,
    *,
    batches: int,
    batch_size: int,
    device: torch.device,
) -> float:
    """Seconds ``batches`` batches of ``batch_size`` samples take through ``layout`` (a pipeline ``build`` makes on a
    copy of the model; the job's first batches in turn, on ``device`` where the first and the last stage read
    them), after up to an epoch of them untimed; every worker calls it and gets the same. The trial's pipeline
    is let go afterwards (on CUDA, the memory it cached too)."""
    trainer = build(layout)
    try:
        B, epoch = batch_size, max(1, data.samples // batch_size)  # whole batches
        feeds = trainer.is_first or trainer.is_last
        first = [
            (to_device(x, device), y.to(device)) for x, y in data.first_batches(B, min(batches, epoch) if feeds else 0)
        ]
        trainer.train(first if feeds else None)  # the first calls of every kernel, the allocator's first blocks
        _all_done(device)
        start = time.perf_counter()
        trainer.train(itertools.islice(itertools.cycle(first), batches) if feeds else None)
        _all_done(device)
        return time.perf_counter() - start
    finally:
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _all_done(device: torch.device) -> None:
    """Every worker's work done, its device's included (a barrier alone waits for the host's)."""
    synchronize(device)
    dist.barrier()


def record_trial(costs: Costs, layout: Layout, *, batches: int, seconds: float) -> tuple[Costs, dict[str, Any]]:
    """``costs`` with what the trial measured of ``layout`` over its simulation kept (with the kept figures too),
    and the trial's record for the plan file."""
    key = str(layout.plan_file["predicted"]["layout_key"])
    simulated = simulated_seconds(layout, costs, batches)
    # Bounded: a second's trial in a busy moment should not bury a layout that may never run to say otherwise.
    ratio = min(TRIAL_BOUND, max(1 / TRIAL_BOUND, simulated / seconds))
    if costs.key is not None:
        correct_layout(costs.key, key, ratio)
    record = {
        "layout_key": key,
        "batches": batches,
        "simulated_seconds": simulated,
        "measured_seconds": seconds,
        "measured_over_simulated": ratio,
    }
    return replace(costs, layout_ratios={**costs.layout_ratios, key: ratio}), record
