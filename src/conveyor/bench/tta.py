"""``conveyor bench tta``: time to accuracy (DAWNBench's metric) of each strategy on the same workers.

Data parallelism ("dp": one stage on every worker), torch's ``DistributedDataParallel`` ("ddp", the
baseline users run today), and GPipe, PipeDream-Flush, PipeDream and PipeDream-2BW, each on the layout
the planner picks for it on the (emulated) cluster, train the same model from the same initial weights
on the same data to the same target test accuracy, with the same options (the asynchronous schedules
with their stale-gradient correction).

Per strategy: wall-clock seconds and epochs to the target (evaluation included, as a user waits for it),
the final accuracy, training samples/s, the bytes sent between servers per training sample (the emulated
servers' uplink counters, while training), each worker's peak resident memory, and:

- ``comm_fraction``: the share of the training time the network costs, ``1 - r_net / r_local`` where
  ``r_local`` is the samples/s of the same layout on plain local processes (same cores, no shaped links);
- ``predicted_speedup``: the planner's predicted time to accuracy of dp over this strategy's (time per
  epoch times the schedule's epochs factor, :mod:`conveyor.plan._epochs`), beside ``measured_speedup``
  (dp's seconds to target over this strategy's).

A plot shows accuracy against time, one line per strategy. With ``seeds`` above 1 every strategy trains again
from each seed's weights and data order (``seed``, ``seed + 1``, ...): ``seeds`` gives each seed's seconds and
epochs to target and goals, and ``over_seeds`` the medians and whether PipeDream met :data:`SEED_GOALS` in every
seed (``results`` and ``goals`` are the first seed's, and the plot).
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from conveyor.bench._checks import require_known
from conveyor.bench._run import run_job
from conveyor.bench.ddp import train_ddp
from conveyor.config import TrainConfig
from conveyor.errors import InputError
from conveyor.job import plot_accuracy

__all__ = ["SEED_GOALS", "STRATEGIES", "TTAConfig", "run"]

STRATEGIES = ("dp", "ddp", "gpipe", "flush", "pipedream", "2bw")
GOALS = {"speedup": 3.0, "accuracy_points": 1.0, "bytes_saved": 0.9, "prediction_error": 0.2}
# In every seed: PipeDream needs at most 1.25x data parallelism's epochs and reaches the target 5x sooner.
SEED_GOALS = {"epochs_over_dp": 1.25, "speedup_vs_dp": 5.0}


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
    local_epochs: int = 2  # epochs of each layout on plain local processes, for comm_fraction (0: skip)
    seed: int = 0  # the initial weights and the data order
    seeds: int = 1  # train from seed, seed + 1, ... this many

    def __post_init__(self) -> None:
        require_known("strategies", self.strategies, STRATEGIES)
        if self.seeds < 1:
            raise InputError(f"seeds must be at least 1, got {self.seeds}")
        if not 0 < self.target <= 1:
            raise InputError(f"the target accuracy must be in (0, 1], got {self.target}")


def _config(cfg: TTAConfig, strategy: str, run_dir: Path) -> TrainConfig:
    layout: dict[str, Any] = (
        {"stages": 1, "replicas": str(cfg.workers), "schedule": "flush"}
        if strategy in ("dp", "ddp")
        else {"workers": cfg.workers, "schedule": strategy}  # the planner's layout for this schedule
    )
    return TrainConfig.from_options(
        model=cfg.model,
        dataset=cfg.dataset,
        epochs=cfg.epochs,
        target_accuracy=cfg.target,
        batch_size=cfg.batch_size,
        microbatches=cfg.microbatches,
        lr=cfg.lr,
        run_dir=str(run_dir / strategy),
        network=cfg.network,
        devices=cfg.devices,
        seed=cfg.seed,
        **layout,
    )


def _run_one(cfg: TTAConfig, strategy: str, tmp: Path) -> dict[str, Any]:
    """Train one strategy to the target, then (for comm_fraction) its layout on plain local processes."""
    train_cfg = _config(cfg, strategy, tmp)
    summary = train_ddp(train_cfg, cfg.workers, tmp / strategy) if strategy == "ddp" else run_job(train_cfg).to_dict()
    local_rate = None
    if cfg.local_epochs and cfg.network:
        local = train_cfg.replaced(
            network=None,
            epochs=cfg.local_epochs,
            target_accuracy=None,
            run_dir=str(tmp / f"{strategy}-local"),
        )
        if strategy != "ddp":  # the very layout the network run used
            local = local.replaced(workers=None, stages=None, replicas=None, plan=str(tmp / strategy / "plan.json"))
        local_rate = (train_ddp(local, cfg.workers) if strategy == "ddp" else run_job(local).to_dict())["samples_per_s"]
    pairs = zip(summary["epoch_seconds"], summary["accuracy"], strict=True)
    history = [{"seconds": s, "accuracy": a} for s, a in pairs]
    reached = next((i for i, h in enumerate(history) if h["accuracy"] >= cfg.target), None)
    between = summary["bytes_between_servers"]
    predicted = summary["layout"].get("plan_file", {}).get("predicted", {})
    return {
        "layout": summary["layout"].get("replicas"),
        "schedule": summary["layout"].get("schedule"),
        "seconds_to_target": None if reached is None else history[reached]["seconds"],
        "epochs_to_target": None if reached is None else reached + 1,
        "final_accuracy": history[-1]["accuracy"],
        "samples_per_s": summary["samples_per_s"],
        "local_samples_per_s": local_rate,
        "comm_fraction": None if local_rate is None else 1 - summary["samples_per_s"] / local_rate,
        "bytes_between_servers_per_sample": None if between is None else between / summary["samples"],
        # in units of data parallelism's epochs: this layout's time per epoch times its epochs factor
        "predicted_seconds_to_accuracy": predicted["epoch_seconds"] * predicted["epochs_factor"] if predicted else None,
        "peak_rss_mb": max(summary["peak_rss_bytes"]) / 2**20,
        "history": history,
    }


def _speedups(results: dict[str, dict[str, Any]]) -> None:
    """Add each strategy's predicted and measured speedup over dp (and measured over ddp)."""
    for base in ("dp", "ddp"):
        ref = results.get(base, {}).get("seconds_to_target")
        for r in results.values():
            mine = r["seconds_to_target"]
            key = "measured_speedup" if base == "dp" else "measured_speedup_vs_ddp"
            r[key] = ref / mine if ref and mine else None
    dp_pred = results.get("dp", {}).get("predicted_seconds_to_accuracy")
    for r in results.values():
        mine = r["predicted_seconds_to_accuracy"]
        r["predicted_speedup"] = dp_pred / mine if dp_pred and mine else None


def _goals(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """PipeDream against data parallelism (and DDP), as the benchmark's goals state them."""
    pd, dp = results.get("pipedream"), results.get("dp")
    if pd is None or dp is None:
        return {}
    goals: dict[str, Any] = {"targets": GOALS}
    goals["speedup_vs_dp"] = pd["measured_speedup"]
    goals["speedup_vs_ddp"] = pd.get("measured_speedup_vs_ddp")
    goals["accuracy_points_below_dp"] = 100 * (dp["final_accuracy"] - pd["final_accuracy"])
    if pd["bytes_between_servers_per_sample"] is not None and dp["bytes_between_servers_per_sample"]:
        goals["bytes_saved"] = 1 - pd["bytes_between_servers_per_sample"] / dp["bytes_between_servers_per_sample"]
    if pd["predicted_speedup"] and pd["measured_speedup"]:
        goals["prediction_error"] = pd["predicted_speedup"] / pd["measured_speedup"] - 1
    return goals


def _over_seeds(seeds: list[dict[str, Any]], strategies: tuple[str, ...]) -> dict[str, Any]:
    """Per strategy the median seconds and epochs to target over the seeds that reached it (and how many did);
    PipeDream's epochs over data parallelism's and its speedup in each seed, and whether every seed met
    :data:`SEED_GOALS`."""
    out: dict[str, Any] = {"targets": SEED_GOALS, "strategies": {}}
    for strategy in strategies:
        reached = [s["results"][strategy] for s in seeds if s["results"][strategy]["seconds_to_target"] is not None]
        out["strategies"][strategy] = {
            "reached": len(reached),
            "median_seconds_to_target": statistics.median(r["seconds_to_target"] for r in reached) if reached else None,
            "median_epochs_to_target": statistics.median(r["epochs_to_target"] for r in reached) if reached else None,
        }
    if "pipedream" in strategies and "dp" in strategies:
        ratios, speedups = [], []
        for s in seeds:
            pd, dp = s["results"]["pipedream"], s["results"]["dp"]
            both = pd["epochs_to_target"] is not None and dp["epochs_to_target"] is not None
            ratios.append(pd["epochs_to_target"] / dp["epochs_to_target"] if both else None)
            speedups.append(pd["measured_speedup"])
        out["pipedream_epochs_over_dp"], out["pipedream_speedup_vs_dp"] = ratios, speedups
        out["met"] = all(
            r is not None and v is not None and r <= SEED_GOALS["epochs_over_dp"] and v >= SEED_GOALS["speedup_vs_dp"]
            for r, v in zip(ratios, speedups, strict=True)
        )
    return out


def _one_seed(cfg: TTAConfig) -> dict[str, dict[str, Any]]:
    """Every strategy trained to the target from ``cfg.seed``, with its speedups."""
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-tta-") as tmp:
        for strategy in cfg.strategies:
            results[strategy] = _run_one(cfg, strategy, Path(tmp))
    _speedups(results)
    return results


def run(cfg: TTAConfig, plot: str | None = None) -> dict[str, Any]:
    """Train every strategy to the target from every seed; return the JSON-ready report (and write the plot)."""
    seeds: list[dict[str, Any]] = []
    for seed in range(cfg.seed, cfg.seed + cfg.seeds):
        trained = _one_seed(replace(cfg, seed=seed))
        seeds.append({"seed": seed, "results": trained, "goals": _goals(trained)})
    results: dict[str, dict[str, Any]] = seeds[0]["results"]
    if plot:
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        where = f"{cfg.workers} workers" + (f" ({cfg.network})" if cfg.network else "")
        title = f"{cfg.model} on {where}: time to {cfg.target:g}"
        plot_accuracy({s: r["history"] for s, r in results.items()}, plot, title=title, target=cfg.target)
    return {
        "config": asdict(cfg),
        "results": results,
        "goals": seeds[0]["goals"],
        "seeds": [
            {
                "seed": s["seed"],
                "seconds_to_target": {k: r["seconds_to_target"] for k, r in s["results"].items()},
                "epochs_to_target": {k: r["epochs_to_target"] for k, r in s["results"].items()},
                "final_accuracy": {k: r["final_accuracy"] for k, r in s["results"].items()},
                "goals": s["goals"],
            }
            for s in seeds
        ],
        "over_seeds": _over_seeds(seeds, cfg.strategies),
    }
