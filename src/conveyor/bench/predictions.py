"""``conveyor bench predictions``: does ``conveyor train`` predict the training throughput it then measures?

Each zoo model trains with ``conveyor train``'s default options (a worker per core up to 4, the planner's
layout, schedule and worker count, batch 64), ``repeats`` times; each run predicts its training samples per second
at start-up and measures it. A first run of one epoch (``--remeasure``: the start-up measurements taken afresh, and
kept) gives the prediction every repeat then plans from, and so how many epochs a repeat needs to train
``seconds`` after its first epoch at that rate (:func:`epochs_for`): at 3 epochs the MLP's steady rate was measured
over 32 ms, and its rate still rose over its first 3 to 4 epochs. The report gives, per run, the layout chosen, the
prediction, the measurement and the error; per model the median error and whether every repeat planned the same
layout; and the goal: every error within :data:`GOAL`.
"""

from __future__ import annotations

import itertools
import math
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.bench._run import run_job
from conveyor.config import TrainConfig
from conveyor.errors import InputError
from conveyor.job import RunSummary, model_and_data
from conveyor.runtime import default_workers, resolve_device
from conveyor.schedule import KINDS

__all__ = ["GOAL", "PredictionsConfig", "run"]

MODELS = ("mlp", "vgg", "resnet", "gpt")
GOAL = 0.15  # every run's prediction within 15% of its measurement


@dataclass(frozen=True)
class PredictionsConfig:
    """What ``conveyor bench predictions`` runs."""

    models: tuple[str, ...] = MODELS  # zoo models, or a user's (module:callable)
    dataset: str | None = None  # every model's (conveyor train --dataset); None: each model's own
    workers: int | None = None  # None: conveyor train's default count, the planner free to run fewer
    epochs: int = 3  # at least, per run
    seconds: float = 2.0  # each run trains at least this long after its first epoch, at the predicted rate
    repeats: int = 2
    # "auto" (the planner's choice), a schedule the planner lays out (flush, pipedream, ...), or "dp" (data
    # parallelism: one stage on every worker)
    schedules: tuple[str, ...] = ("auto",)
    network: str | None = None  # run on this emulated network (conveyor.emulate)
    devices: str | None = None  # emulated devices: CPU cores per worker
    faults: str | None = None

    def __post_init__(self) -> None:
        if min(self.workers or 1, self.epochs, self.repeats) < 1:
            raise InputError("workers, epochs and repeats must be at least 1")
        if self.seconds < 0:
            raise InputError(f"seconds is 0 or more, got {self.seconds}")
        unknown = set(self.schedules) - {"auto", "dp", *KINDS}
        if unknown:
            raise InputError(f"unknown schedule {sorted(unknown)[0]!r}: use auto, dp or one of {', '.join(KINDS)}")


def epochs_for(seconds: float, *, rate: float, samples: int, least: int) -> int:
    """Epochs for ``seconds`` of training after the first epoch, at ``rate`` samples per second with ``samples``
    an epoch, and at least ``least``.

    Example:
        >>> epochs_for(2.0, rate=100_000, samples=1437, least=3)  # the MLP: 140 epochs of 14 ms, and the first
        141
        >>> epochs_for(2.0, rate=1_700, samples=3200, least=3)
        3
    """
    return max(least, 1 + math.ceil(seconds * rate / samples))


def run(cfg: PredictionsConfig) -> dict[str, Any]:
    """Train every model ``repeats`` times, after a first run that measures afresh; return the JSON-ready report."""
    for model in cfg.models:  # an unknown model or dataset fails here, in one line, before any worker starts
        model_and_data(TrainConfig.from_options(model=model, dataset=cfg.dataset))
    results = []
    data_parallel = str(cfg.workers or default_workers(resolve_device("auto")))  # "dp": one stage on every worker
    with tempfile.TemporaryDirectory(prefix="conveyor-predictions-") as tmp:
        for model, schedule in itertools.product(cfg.models, cfg.schedules):
            layout_options: dict[str, Any] = (
                {"stages": 1, "replicas": data_parallel, "schedule": "flush"}
                if schedule == "dp"
                else {"schedule": schedule}
            )

            first = _train(cfg, model, layout_options, Path(tmp) / f"{model}-{schedule}-first", 1, remeasure=True)
            epochs = epochs_for(
                cfg.seconds, rate=first.prediction.samples_per_s, samples=first.samples, least=cfg.epochs
            )
            for repeat in range(cfg.repeats):
                summary = _train(cfg, model, layout_options, Path(tmp) / f"{model}-{schedule}-{repeat}", epochs)
                results.append({"model": model, "asked": schedule, "epochs": epochs, **_result(summary)})
    medians = {
        f"{model} {schedule}": statistics.median(
            r["error"] for r in results if (r["model"], r["asked"]) == (model, schedule)
        )
        for model, schedule in itertools.product(cfg.models, cfg.schedules)
    }
    layouts = {
        f"{model} {schedule}": sorted(
            {
                (r["schedule"], tuple(r["replicas"]), tuple(r["balance"]))
                for r in results
                if (r["model"], r["asked"]) == (model, schedule)
            }
        )
        for model, schedule in itertools.product(cfg.models, cfg.schedules)
    }
    return {
        "config": asdict(cfg),
        "results": results,
        "median_error": medians,
        "same_layout": {case: len(found) == 1 for case, found in layouts.items()},
        "goal": {"error_within": GOAL, "met": all(abs(r["error"]) <= GOAL for r in results)},
    }


def _train(
    cfg: PredictionsConfig,
    model: str,
    layout_options: dict[str, Any],
    run_dir: Path,
    epochs: int,
    *,
    remeasure: bool = False,
) -> RunSummary:
    return run_job(
        TrainConfig.from_options(
            model=model,
            dataset=cfg.dataset,
            workers=cfg.workers,
            epochs=epochs,
            remeasure=remeasure,
            run_dir=str(run_dir),
            network=cfg.network,
            devices=cfg.devices,
            faults=cfg.faults,
            **layout_options,
        )
    )


def _result(summary: RunSummary) -> dict[str, Any]:
    """One run's layout, prediction and measurement."""
    layout = summary.layout
    return {
        "schedule": layout["schedule"],
        "workers_started": summary.prediction.measured_at_start["workers"],
        "replicas": layout["replicas"],
        "balance": layout["balance"],
        "predicted_samples_per_s": summary.prediction.samples_per_s,
        # The simulator's own, before any trial's or earlier run's ratio (the prediction is this times the ratio).
        "simulated_samples_per_s": summary.prediction.samples_per_s
        / float(layout["plan_file"]["predicted"]["measured_over_simulated"]),
        "measured_samples_per_s": summary.steady_samples_per_s,  # after the first epoch
        "all_epochs_samples_per_s": summary.samples_per_s,
        "error": summary.prediction.error,
        "threads": layout["plan_file"]["threads"],
        "single_worker_samples_per_s": summary.prediction.measured_at_start["single_worker_samples_per_s"],
        "measured_at_start": summary.prediction.measured_at_start,
        "candidates": layout["plan_file"].get("candidates", []),
        "trials": layout["plan_file"].get("trials", []),  # the layouts tried before training (none: no trial)
    }
