"""``conveyor bench predictions``: does ``conveyor train`` predict the training throughput it then measures?

Each zoo model trains with ``conveyor train``'s default options (a worker per core up to 4, the planner's
layout, schedule and worker count, batch 64) for a few epochs, ``repeats`` times; each run predicts its training
samples per second at start-up (from what it measured there, or the figures an earlier run of the same job kept)
and measures it. The report gives, per run, the layout chosen, the prediction, the measurement and the error;
per model the median error and whether every repeat planned the same layout; and the goal: every error within
:data:`GOAL`.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.bench._run import run_job
from conveyor.config import TrainConfig
from conveyor.errors import InputError
from conveyor.runtime import default_workers, resolve_device
from conveyor.schedule import KINDS

__all__ = ["GOAL", "PredictionsConfig", "run"]

MODELS = ("mlp", "vgg", "resnet", "gpt")
GOAL = 0.15  # every run's prediction within 15% of its measurement


@dataclass(frozen=True)
class PredictionsConfig:
    """What ``conveyor bench predictions`` runs."""

    models: tuple[str, ...] = MODELS
    workers: int | None = None  # None: conveyor train's default count, the planner free to run fewer
    epochs: int = 3
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
        unknown = set(self.schedules) - {"auto", "dp", *KINDS}
        if unknown:
            raise InputError(f"unknown schedule {sorted(unknown)[0]!r}: use auto, dp or one of {', '.join(KINDS)}")


def run(cfg: PredictionsConfig) -> dict[str, Any]:
    """Train every model ``repeats`` times; return the JSON-ready report."""
    results = []
    data_parallel = str(cfg.workers or default_workers(resolve_device("auto")))  # "dp": one stage on every worker
    with tempfile.TemporaryDirectory(prefix="conveyor-predictions-") as tmp:
        for model, schedule, repeat in itertools.product(cfg.models, cfg.schedules, range(cfg.repeats)):
            run_dir = Path(tmp) / f"{model}-{schedule}-{repeat}"
            layout_options: dict[str, Any] = (
                {"stages": 1, "replicas": data_parallel, "schedule": "flush"}
                if schedule == "dp"
                else {"schedule": schedule}
            )
            summary = run_job(
                TrainConfig.from_options(
                    model=model,
                    workers=cfg.workers,
                    epochs=cfg.epochs,
                    run_dir=str(run_dir),
                    network=cfg.network,
                    devices=cfg.devices,
                    faults=cfg.faults,
                    **layout_options,
                )
            )
            layout = summary.layout
            results.append(
                {
                    "model": model,
                    "asked": schedule,
                    "schedule": layout["schedule"],
                    "workers_started": summary.prediction.measured_at_start["workers"],
                    "replicas": layout["replicas"],
                    "balance": layout["balance"],
                    "predicted_samples_per_s": summary.prediction.samples_per_s,
                    "measured_samples_per_s": summary.steady_samples_per_s,  # after the first epoch
                    "all_epochs_samples_per_s": summary.samples_per_s,
                    "error": summary.prediction.error,
                    "threads": layout["plan_file"]["threads"],
                    "single_worker_samples_per_s": summary.prediction.measured_at_start["single_worker_samples_per_s"],
                    "measured_at_start": summary.prediction.measured_at_start,
                    "candidates": summary.layout["plan_file"].get("candidates", []),
                }
            )
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
