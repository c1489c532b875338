"""``conveyor bench markets``: deadline-aware policies over SkyPilot's spot traces (Tributary, DISPA, Can't Be Late).

Per trace set a job sized to it (:data:`TRACE_SETS`): a one-V100 job of ``work_h`` hours on the 1-node sets, an
8-machine ResNet-50 of ``work_h`` hours on 8 on-demand V100s on the 16-node set; started at ``starts`` evenly
spaced points after a warm-up (the preemption model's first past); deadline ``deadline`` x its on-demand time.
Every policy of :data:`conveyor.config.MARKET_POLICIES` runs from every start; on a set with several instance kinds
the portfolio also runs pinned to each kind (``portfolio[k80_1]``: the static single-kind choices that DISPA's
moves are measured against). Then the portfolio and its baselines at spot discounts 0.2-0.5, the portfolio
under AWS's 2016 hourly billing at a 2016-like discount, and the preemption model's calibration per market
on the held-back last 40% of each set. With ``real``, the portfolio drives a real elastic job on the emulated
cluster (:mod:`conveyor.bench._markets_real`). The report and the goals: :mod:`conveyor.bench._markets_report`.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.progress import Progress

from conveyor.bench._checks import require_known
from conveyor.bench._markets_real import RealConfig, run_real
from conveyor.bench._markets_report import goals, median_rows, plot
from conveyor.bench.spot import MEASURED, SHARED
from conveyor.config import MARKET_POLICIES
from conveyor.errors import InputError
from conveyor.markets import (
    DISCOUNT_2016,
    Job,
    MarketTrace,
    Overheads,
    PolicySettings,
    Pricing,
    Study,
    calibration,
    gavel_speeds,
    read_trace_set,
    scaling_from_plan,
    simulate_markets,
)

__all__ = ["AVAILABILITY", "TRACE_SETS", "MarketsConfig", "median_rows", "plot", "run", "simulate_set"]

AVAILABILITY = SHARED / "spot-traces" / "skypilot" / "availability"
# name: (folder under AVAILABILITY, instance kinds kept (all if empty), the job's on-demand machines)
TRACE_SETS: dict[str, tuple[str, tuple[str, ...], int]] = {
    "v100-9-zones": ("1-node/aws-02-15-2023", (), 1),
    "k80-v100-2-zones": ("1-node/aws-10-26-2022", ("v100_1", "k80_1"), 1),
    "v100x16-3-zones": ("16-node/aws-08-27-2023", (), 8),
}
SWEEP_POLICIES = ("on-demand", "spot-restart", "uniform-progress", "portfolio")
_Inputs = tuple[dict[str, float], tuple[float, ...]]  # instance kinds' speeds, data parallelism's scaling


@dataclass(frozen=True)
class MarketsConfig:
    """What ``conveyor bench markets`` replays."""

    trace_sets: tuple[str, ...] = tuple(TRACE_SETS)
    policies: tuple[str, ...] = MARKET_POLICIES
    starts: int = 30
    work_h: float = 24.0
    deadline: float = 1.5
    warmup_h: float = 72.0
    discount: float = 0.3
    discounts: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5)
    model: str = "ResNet-50 (batch size 64)"
    profile: str = str(SHARED / "pipedream-profiles" / "resnet50")
    batch: int = 64
    bandwidth: float = 1.17e9
    target: float = 0.99
    move_every_h: float = 6.0
    gavel: str = str(SHARED / "gavel" / "simulation_throughputs.json")
    real: bool = False  # also drive a real elastic job on the emulated cluster (root) with the portfolio
    day_s: float = 300.0  # the real run's seconds per trace day
    keep: str | None = None  # the real run's folders (default: a temporary folder)

    def __post_init__(self) -> None:
        require_known("trace sets", self.trace_sets, TRACE_SETS)
        require_known("policies", self.policies, MARKET_POLICIES)
        if not (self.starts >= 1 and self.work_h > 0 and self.deadline >= 1 and self.warmup_h >= 0):
            raise InputError("need starts >= 1, work_h > 0, deadline >= 1 (x the on-demand time) and warmup_h >= 0")


def _study(cfg: MarketsConfig, traces: list[MarketTrace], machines: int, pricing: Pricing, inputs: _Inputs) -> Study:
    speeds, scaling = inputs
    on_demand = Job(work=1.0, machines=machines, scaling=scaling)
    work = cfg.work_h / on_demand.on_demand_h  # work_h hours on the job's on-demand machines
    job = Job(work=work, machines=machines, deadline_h=cfg.deadline * cfg.work_h, scaling=scaling)
    o = Overheads(**{k: MEASURED[k] for k in ("revocation_s", "addition_s", "restart_s", "checkpoint_s")})
    settings = PolicySettings(target=cfg.target, move_every_h=cfg.move_every_h)
    return Study(traces, job, speeds, pricing=pricing, overheads=o, settings=settings, warmup_h=cfg.warmup_h)


def _runs(
    study: Study, name: str, policies: list[tuple[str, str]], starts: list[int], bar: Progress
) -> list[dict[str, Any]]:
    task = bar.add_task(f"{name}: {len(policies)} policies x {len(starts)} starts", total=len(policies) * len(starts))
    rows = []
    limit = study.limit_cost_per_work()
    for label, kind in policies:
        policy = label.split("[")[0]
        for s in starts:
            run = simulate_markets(study, policy, s, kind=kind)
            row = {**run.row(name, limit), "policy": label, "discount": study.pricing.discount}
            row["billing"] = study.pricing.billing
            if s == starts[len(starts) // 2]:  # the plot's: the median start's machines over time
                row["held"] = [(round(h, 3), spot, od) for h, spot, od in run.held]
                row["spent"] = [(round(h, 3), round(usd, 3)) for h, usd in run.spent]
            rows.append(row)
            bar.advance(task)
    return rows


def _inputs(cfg: MarketsConfig) -> _Inputs:
    speeds = gavel_speeds(cfg.gavel, cfg.model)
    return speeds, scaling_from_plan(cfg.profile, batch=cfg.batch, bandwidth=cfg.bandwidth, most=24)


def _calibration(name: str, study: Study) -> list[dict[str, Any]]:
    horizon = max(1, round(study.settings.horizon_h * 3600 / study.traces[0].gap_s))
    return [{"trace_set": name, **row} for row in calibration(study.traces, horizon=horizon)]


def _config(cfg: MarketsConfig, inputs: _Inputs) -> dict[str, Any]:
    speeds, scaling = inputs
    return {**asdict(cfg), "measured": MEASURED, "scaling": scaling, "speeds": speeds, "discount_2016": DISCOUNT_2016}


def simulate_set(
    cfg: MarketsConfig, folder: Path, *, instances: tuple[str, ...] = (), machines: int = 1, billing: str = "per-second"
) -> dict[str, Any]:
    """``conveyor markets simulate``: ``cfg.policies`` from ``cfg.starts`` starts over one folder of traces."""
    inputs = _inputs(cfg)
    study = _study(cfg, read_trace_set(folder, instances), machines, Pricing(cfg.discount, billing), inputs)
    with Progress() as bar:
        results = _runs(study, folder.name, [(p, "") for p in cfg.policies], study.starts(cfg.starts), bar)
    calibrated = _calibration(folder.name, study)
    return {
        "config": _config(cfg, inputs),
        "results": results,
        "summary": median_rows(results),
        "calibration": calibrated,
    }


def _real_mode(cfg: MarketsConfig, inputs: _Inputs) -> dict[str, Any]:
    """The portfolio on the 9-zone set's median start driving a real elastic job (:mod:`._markets_real`)."""
    folder, kinds, machines = TRACE_SETS["v100-9-zones"]
    study = _study(cfg, read_trace_set(AVAILABILITY / folder, kinds), machines, Pricing(cfg.discount), inputs)
    starts = study.starts(cfg.starts)
    real = RealConfig(day_s=cfg.day_s, work_h=cfg.work_h)
    if cfg.keep:
        return run_real(real, study, starts[len(starts) // 2], Path(cfg.keep))
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-markets-") as tmp:
        return run_real(real, study, starts[len(starts) // 2], Path(tmp))


def run(cfg: MarketsConfig) -> dict[str, Any]:
    """Every replay of the benchmark; the JSON-ready report (see the module docstring)."""
    inputs = _inputs(cfg)
    results: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    cal: list[dict[str, Any]] = []
    with Progress() as bar:
        for name in cfg.trace_sets:
            folder, kinds, machines = TRACE_SETS[name]
            traces = read_trace_set(AVAILABILITY / folder, kinds)
            study = _study(cfg, traces, machines, Pricing(cfg.discount), inputs)
            starts = study.starts(cfg.starts)
            policies = [(p, "") for p in cfg.policies]
            if len(study.kinds) > 1 and "portfolio" in cfg.policies:
                policies += [(f"portfolio[{k}]", k) for k in study.kinds]
            results += _runs(study, name, policies, starts, bar)
            for d in cfg.discounts:
                other = _study(cfg, traces, machines, Pricing(d), inputs)
                sweep += _runs(other, name, [(p, "") for p in SWEEP_POLICIES if p in cfg.policies], starts, bar)
            hourly = _study(cfg, traces, machines, Pricing(DISCOUNT_2016, "hourly-2016"), inputs)
            sweep += _runs(
                hourly, name, [(p, "") for p in ("on-demand", "portfolio") if p in cfg.policies], starts, bar
            )
            cal += _calibration(name, study)
    config = _config(cfg, inputs)
    real = _real_mode(cfg, inputs) if cfg.real else None
    return {
        "real_mode": real,
        "config": config,
        "results": results,
        "summary": median_rows(results),
        "sweep": median_rows(sweep),
        "calibration": cal,
        "goals": goals(results, sweep, real),
    }
