"""``conveyor bench convergence``: epochs to a target accuracy per zoo model, schedule and stale-gradient
correction, over seeds.

Every run trains on ``workers`` local processes with the default options of ``conveyor train`` (SGD, lr
0.05, momentum 0.9, batch 64, 4 microbatches): data parallelism ("dp", one stage on every worker) and
each schedule on a straight pipeline of one stage per worker; the asynchronous schedules with the
stale-gradient correction at each of its learning rates ("pipedream": the rate per sample; "pipedream/damped":
that over one plus the stage's staleness) and without it ("pipedream/plain"). A run stops at its
target or after its model's epoch cap; a run that never gets there counts as the cap plus one, so a
median over seeds stays defined (and is reported as not reached when it exceeds the cap).

The report's ``epoch_factors`` (per model, per schedule: median epochs over data parallelism's) is what
the planner reads to rank schedules by time to accuracy (:mod:`conveyor.plan._epochs`), and its
``stale_rates`` the rate a run of ``--stale-rate auto`` takes: per model and schedule, ``damped`` where that
rate's runs took fewer median epochs, or as many and fewer in the worst seed (:func:`faster_rate`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.bench._checks import require_known
from conveyor.bench._run import run_job
from conveyor.config import TrainConfig
from conveyor.errors import InputError
from conveyor.schedule import KINDS

__all__ = ["STRATEGIES", "TARGETS", "ConvergenceConfig", "faster_rate", "run"]

ASYNC = tuple(name for name, k in KINDS.items() if not k.synchronous)
STRATEGIES = (
    "dp",
    "gpipe",
    "flush",
    *ASYNC,
    *(f"{name}/damped" for name in ASYNC),
    *(f"{name}/plain" for name in ASYNC),
)
# model -> (target test accuracy, epoch cap): targets data parallelism reaches in about a third of the cap
TARGETS = {"mlp": (0.93, 15), "vgg": (0.9, 20), "resnet": (0.95, 15), "gpt": (0.3, 12), "vgg16": (0.9, 12)}
GOAL = 1.25  # corrected asynchronous schedules: at most this many times data parallelism's epochs


@dataclass(frozen=True)
class ConvergenceConfig:
    """What ``conveyor bench convergence`` runs."""

    models: tuple[str, ...] = tuple(TARGETS)
    strategies: tuple[str, ...] = STRATEGIES
    seeds: int = 3
    workers: int = 4

    def __post_init__(self) -> None:
        require_known("models", self.models, TARGETS)
        require_known("strategies", self.strategies, STRATEGIES)
        if "dp" not in self.strategies:
            raise InputError("the strategies must include dp: every other one is measured against it")
        if self.seeds < 1 or self.workers < 2:
            raise InputError("give at least one seed and two workers")


def _config(model: str, strategy: str, seed: int, workers: int, run_dir: Path) -> TrainConfig:
    schedule, _, variant = strategy.partition("/")
    target, cap = TARGETS[model]
    layout: dict[str, Any] = (
        {"stages": 1, "replicas": str(workers), "schedule": "flush"}
        if schedule == "dp"
        else {"stages": workers, "schedule": schedule}
    )
    return TrainConfig.from_options(
        model=model,
        epochs=cap,
        target_accuracy=target,
        seed=seed,
        stale_correction=variant != "plain",
        stale_rate="damped" if variant == "damped" else "sample",
        run_dir=str(run_dir / f"{model}-{strategy.replace('/', '-')}-{seed}"),
        **layout,
    )


def epochs_to(accuracy: list[float], target: float) -> int | None:
    """The first epoch (from 1) whose test accuracy reaches ``target``.

    Example:
        >>> epochs_to([0.5, 0.91, 0.95], 0.9), epochs_to([0.5], 0.9)
        (2, None)
    """
    return next((i + 1 for i, a in enumerate(accuracy) if a >= target), None)


def faster_rate(sample: list[int | None], damped: list[int | None], cap: int) -> str:
    """The correction's rate whose seeds reached the target sooner: fewer median epochs, then fewer in the
    worst seed (a seed that missed counts as ``cap + 1``); ``sample`` on a tie.

    Example:
        >>> faster_rate([3, 4, 3], [2, 3, 3], cap=12), faster_rate([3, 3, 4], [5, 6, 5], cap=15)
        ('damped', 'sample')
    """

    def cost(epochs: list[int | None]) -> tuple[float, int]:
        missed = [cap + 1 if e is None else e for e in epochs]
        return summarise(epochs, cap), max(missed)

    return "damped" if cost(damped) < cost(sample) else "sample"


def summarise(epochs: list[int | None], cap: int) -> float:
    """The median epochs to target over seeds, a run that missed counting as ``cap + 1``."""
    return float(statistics.median(cap + 1 if e is None else e for e in epochs))


def run(
    cfg: ConvergenceConfig, plot: str | None = None, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Train every model, strategy and seed; return the JSON-ready report (and write the plot)."""
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-convergence-") as tmp:
        for model in cfg.models:
            target, cap = TARGETS[model]
            results[model] = {}
            for strategy in cfg.strategies:
                runs: list[dict[str, Any]] = []
                for seed in range(cfg.seeds):
                    if progress is not None:
                        progress(f"{model} {strategy} seed {seed}")
                    summary = run_job(_config(model, strategy, seed, cfg.workers, Path(tmp)))
                    runs.append(
                        {
                            "seed": seed,
                            "epochs_to_target": epochs_to(summary.accuracy, target),
                            "accuracy": summary.accuracy,
                        }
                    )
                median = summarise([r["epochs_to_target"] for r in runs], cap)
                results[model][strategy] = {"median_epochs": median, "reached": median <= cap, "runs": runs}
            dp = results[model]["dp"]["median_epochs"]
            for strategy, r in results[model].items():
                r["factor"] = r["median_epochs"] / dp
                r["goal_met"] = r["factor"] <= GOAL if strategy.removesuffix("/damped") in ASYNC else None
    factors = {m: {s: r["factor"] for s, r in per.items()} for m, per in results.items()}
    rates = {m: _damped_where_faster(per, TARGETS[m][1]) for m, per in results.items()}
    models = ",".join(cfg.models)
    source = f"conveyor bench convergence --models {models} --seeds {cfg.seeds}, {time.strftime('%Y-%m-%d')}"
    report = {
        "source": source,
        "config": asdict(cfg),
        "targets": {m: TARGETS[m] for m in cfg.models},
        "goal": GOAL,
        "results": results,
        "epoch_factors": factors,
        "stale_rates": {m: per for m, per in rates.items() if per},
    }
    if plot:
        _plot(report, plot)
    return report


def _damped_where_faster(per: dict[str, Any], cap: int) -> dict[str, str]:
    """The schedules of one model whose damped rate :func:`faster_rate` chose (both rates measured)."""

    def epochs(strategy: str) -> list[int | None]:
        return [r["epochs_to_target"] for r in per[strategy]["runs"]]

    both = [s for s in ASYNC if s in per and f"{s}/damped" in per]
    return {s: "damped" for s in both if faster_rate(epochs(s), epochs(f"{s}/damped"), cap) == "damped"}


def _plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    models = list(report["results"])
    strategies = list(report["config"]["strategies"])
    fig, ax = plt.subplots(figsize=(max(6.4, 1.6 * len(models) + 2), 4.0))
    width = 0.8 / len(strategies)
    for i, strategy in enumerate(strategies):
        medians = [report["results"][m][strategy]["median_epochs"] for m in models]
        xs = [j + (i - (len(strategies) - 1) / 2) * width for j in range(len(models))]
        ax.bar(xs, medians, width, label=strategy, hatch="//" if "/" in strategy else None)
    ax.set_xticks(range(len(models)), [f"{m} (to {report['targets'][m][0]:g})" for m in models])
    ax.set_ylabel("median epochs to target")
    ax.set_title(f"epochs to target on {report['config']['workers']} workers ({report['config']['seeds']} seeds)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
