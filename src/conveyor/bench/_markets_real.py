"""``conveyor bench markets --real``: a policy's holding drives a real elastic job on the emulated cluster, and
the simulator's prediction of its finish and cost is set beside what happened.

1. **Measure** the job (``conveyor train --reliable 1``, each worker an emulated device of ``cores`` cores, no
   faults) on 1 to ``1 + transient`` workers: training samples/s after the first epoch, ``r(m)``; data
   parallelism's efficiency ``r(m) / (m r(1))``.
2. **Simulate** the policy from the trace set's median start with that job compressed: a trace day is ``day_s``
   real seconds (``scale = 86400 / day_s``), the work is ``work_h`` trace hours on ``1 + transient`` workers
   (the deadline 1.5x that), worker 0 is the reliable tier (an on-demand machine held throughout), at most
   ``transient`` spot machines; the overheads are ``conveyor bench elastic``'s, in trace time (x ``scale``).
3. **Run** the job on ``1 + transient`` emulated workers whose workers 1.. are added and revoked as the
   simulated holding says (its machines beside worker 0 per tick, spot or on-demand, written as a SkyPilot
   trace, ``--faults trace:FILE,first=1,time-scale=scale``), kept at its last holding after the simulated
   finish.
4. **Compare**: the real finish is the last epoch's time x ``scale``; the real cost bills the holding up to it.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from conveyor.config import TrainConfig
from conveyor.job import model_and_data, train_elastic
from conveyor.markets import Job, Overheads, Pricing, Run, Study, simulate_markets

__all__ = ["RealConfig", "run_real"]


@dataclass(frozen=True)
class RealConfig:
    """The real-mode run of ``conveyor bench markets --real``."""

    policy: str = "portfolio"
    model: str = "resnet"
    cores: float = 0.45  # each worker's emulated device, so that a machine added adds capacity
    transient: int = 3  # spot machines at most: workers 1..transient
    day_s: float = 300.0  # real seconds per trace day
    work_h: float = 24.0  # trace hours of work on the 1 + transient workers
    calibrate_epochs: int = 8
    batch_size: int = 256
    seed: int = 0


def _measure(cfg: RealConfig, folder: Path, samples: int) -> list[float]:
    """Training samples/s on 1 .. 1 + transient workers (the first epoch, start-up included, left out);
    ``samples``: an epoch's."""
    rates = []
    for workers in range(1, cfg.transient + 2):
        summary = train_elastic(_train(cfg, folder / f"measure-{workers}", workers, cfg.calibrate_epochs, None))
        seconds = summary.epoch_seconds[-1] - summary.epoch_seconds[0]
        rates.append(samples * (len(summary.epoch_seconds) - 1) / seconds)
    return rates


def _train(cfg: RealConfig, folder: Path, workers: int, epochs: int, faults: str | None) -> TrainConfig:
    return TrainConfig.from_options(
        model=cfg.model,
        workers=workers,
        reliable=1,
        epochs=epochs,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        run_dir=str(folder),
        devices=f"{cfg.cores:g}",
        faults=faults,
    )


def _schedule(run: Run, gap_s: float, ticks: int) -> list[tuple[int, int]]:
    """(spot, on-demand) machines held in each tick, the last holding kept after the simulated finish."""
    held = [(0, 0)] * ticks
    for (h, spot, od), nxt in zip(run.held, [*run.held[1:], None], strict=True):
        end = ticks if nxt is None else min(ticks, round(nxt[0] * 3600 / gap_s))
        for k in range(round(h * 3600 / gap_s), end):
            held[k] = (spot, od)
    last = next(((spot, od) for _, spot, od in reversed(run.held) if spot + od), (0, 0))
    finish = min(ticks, math.floor(run.finish_h * 3600 / gap_s)) if math.isfinite(run.finish_h) else ticks
    return held[:finish] + [last] * (ticks - finish)


def _cost(held: list[tuple[int, int]], gap_s: float, finish_h: float, pricing: Pricing) -> float:
    """The holding billed up to ``finish_h`` (per second)."""
    spot = on_demand = 0.0
    for k, (s, o) in enumerate(held):
        hours = max(0.0, min(gap_s, finish_h * 3600 - k * gap_s)) / 3600
        spot, on_demand = spot + s * hours, on_demand + o * hours
    return spot * pricing.spot("v100_1") + on_demand * pricing.on_demand("v100_1")


def run_real(cfg: RealConfig, study: Study, start: int, folder: Path) -> dict[str, Any]:
    """Measure, simulate_markets, run and compare (see the module docstring); ``study`` gives the traces and prices."""
    folder.mkdir(parents=True, exist_ok=True)
    _, data = model_and_data(TrainConfig.from_options(model=cfg.model, seed=cfg.seed))
    rates = _measure(cfg, folder, data.samples)
    scale = 86400.0 / cfg.day_s
    fleet = 1 + cfg.transient
    epochs = max(2, round(cfg.work_h * 3600 / scale * rates[-1] / data.samples))  # work_h on the whole fleet
    work = epochs * data.samples / rates[0] * scale / 3600  # one worker's hours of trace time
    scaling = tuple(r / (m * rates[0]) for m, r in enumerate(rates, 1))
    job = Job(work=work, machines=fleet, deadline_h=1.5 * cfg.work_h, scaling=scaling, reliable=1)
    measured = study.overheads
    overheads = Overheads(
        revocation_s=measured.revocation_s * scale,
        addition_s=measured.addition_s * scale,
        restart_s=0.0,  # the job starts at trace time 0, as the real run's faults do
        checkpoint_s=0.0,  # the state lives on the reliable tier
    )
    v100 = [t for t in study.traces if t.instance == "v100_1"]
    settings = replace(study.settings, most_spot=cfg.transient)
    compressed = Study(v100, job, {"v100_1": 1.0}, pricing=study.pricing, overheads=overheads, settings=settings)
    predicted = simulate_markets(compressed, cfg.policy, start)
    gap = v100[0].gap_s
    held = _schedule(predicted, gap, len(v100[0].counts) - start)
    counts = [max(0, min(s + o - 1, cfg.transient)) for s, o in held]  # beside worker 0, the reliable one
    trace = folder / "us-sim-1a_v100_1.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": counts}))
    faults = f"trace:{trace},time-scale={scale:g},first=1,machines={cfg.transient}"
    summary = train_elastic(_train(cfg, folder / "real", 1 + cfg.transient, epochs, faults))
    real_finish_h = summary.seconds * scale / 3600
    real_cost = _cost(held, gap, real_finish_h, study.pricing)
    return {
        "policy": cfg.policy,
        "simulated_cost_usd": predicted.cost_usd,
        "real_cost_usd": real_cost,
        "simulated_finish_h": predicted.finish_h,
        "real_finish_h": real_finish_h,
        "cost_error": predicted.cost_usd / real_cost - 1,
        "finish_error": predicted.finish_h / real_finish_h - 1,
        "within_10pct": abs(predicted.cost_usd / real_cost - 1) <= 0.1
        and abs(predicted.finish_h / real_finish_h - 1) <= 0.1,
        "start_h": start * gap / 3600,
        "epochs": epochs,
        "samples_per_s": rates,
        "scale": scale,
        "spot_machines_median": statistics.median(counts[: max(1, math.ceil(real_finish_h * 3600 / gap))]),
        "accuracy": summary.accuracy[-1] if summary.accuracy else None,
        "config": asdict(cfg),
    }
