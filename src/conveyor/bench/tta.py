"""``conveyor bench tta``: time to accuracy (DAWNBench's metric) of each strategy on the same workers.

Data parallelism (one stage on every worker), GPipe, PipeDream-Flush, PipeDream and PipeDream-2BW (a
straight pipeline of one stage per worker) train the same model from the same initial weights on the
same data to the same target test accuracy. Per strategy: wall-clock seconds and epochs to the target
(evaluation included, as a user waits for it), the final accuracy, training samples/s and each worker's
peak resident memory; and a plot of accuracy against time, one line per strategy.

PipeDream makes an update per microbatch, so it gets the learning rate divided by the microbatch count
(the linear scaling rule: the same rate per sample as the others' one update per batch). With the full
rate, a 4-stage PipeDream on the digits MLP (SGD, momentum 0.9) does not learn: its updates are up to three
steps stale and four times as frequent.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.job import TrainConfig, plot_accuracy, train

__all__ = ["STRATEGIES", "TTAConfig", "run"]

STRATEGIES = ("dp", "gpipe", "flush", "pipedream", "2bw")


@dataclass(frozen=True)
class TTAConfig:
    """What ``conveyor bench tta`` runs."""

    model: str = "mlp"
    dataset: str | None = None
    workers: int = 4
    target: float = 0.9
    epochs: int = 20
    batch_size: int = 64
    microbatches: int = 4
    lr: float = 0.05
    strategies: tuple[str, ...] = STRATEGIES
    network: str | None = None  # run on this emulated network (conveyor.emulate)
    devices: str | None = None  # emulated devices: CPU cores per worker
    faults: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.strategies) - set(STRATEGIES)
        if unknown:
            raise ValueError(f"unknown strategies {sorted(unknown)}: choose from {', '.join(STRATEGIES)}")
        if not 0 < self.target <= 1:
            raise ValueError(f"the target accuracy must be in (0, 1], got {self.target}")


def _config(cfg: TTAConfig, strategy: str, run_dir: Path) -> TrainConfig:
    layout: dict[str, Any] = (
        {"stages": 1, "replicas": str(cfg.workers), "schedule": "flush"}
        if strategy == "dp"
        else {"stages": cfg.workers, "schedule": strategy}
    )
    return TrainConfig(
        model=cfg.model, dataset=cfg.dataset, epochs=cfg.epochs, target_accuracy=cfg.target, batch_size=cfg.batch_size,
        microbatches=cfg.microbatches, lr=cfg.lr / (cfg.microbatches if strategy == "pipedream" else 1),
        run_dir=str(run_dir / strategy), network=cfg.network, devices=cfg.devices, faults=cfg.faults, **layout,
    )  # fmt: skip


def run(cfg: TTAConfig, plot: str | None = None) -> dict[str, Any]:
    """Train every strategy to the target; return the JSON-ready report (and write the plot)."""
    results, curves = [], {}
    with tempfile.TemporaryDirectory(prefix="conveyor-tta-") as tmp:
        for strategy in cfg.strategies:
            summary = train(_config(cfg, strategy, Path(tmp)))
            pairs = zip(summary["epoch_seconds"], summary["accuracy"], strict=True)
            history = [{"seconds": s, "accuracy": a} for s, a in pairs]
            curves[strategy] = history
            reached = next((h for h in history if h["accuracy"] >= cfg.target), None)
            results.append(
                {
                    "strategy": strategy,
                    "layout": summary["layout"],
                    "seconds_to_target": None if reached is None else reached["seconds"],
                    "epochs_to_target": None if reached is None else history.index(reached) + 1,
                    "final_accuracy": summary["accuracy"][-1],
                    "samples_per_s": summary["samples_per_s"],
                    "peak_rss_bytes_per_worker": summary["peak_rss_bytes"],
                    "history": history,
                }
            )
    if plot:
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        title = f"{cfg.model} on {cfg.workers} workers: time to {cfg.target:g} test accuracy"
        plot_accuracy(curves, plot, title=title, target=cfg.target)
    return {"config": asdict(cfg), "results": results}
