"""``conveyor bench spot``: on-demand, checkpoint-restart, a fixed elastic fleet and BidBrain over spot traces.

Each policy (:mod:`conveyor.elastic._bidbrain`) does a fixed amount of work (samples) on the availability traces
of ``../shared/spot-traces`` (one market each) at list prices (:data:`conveyor.elastic._market.PRICES`), with
a throughput model from the planner (a PipeDream profile under data parallelism) and the measured costs of a
revocation, an addition and a torchrun restart (``conveyor bench elastic --json``, read with ``--elastic``).
The goals (issue 14): BidBrain's cost per work at most 0.4x all on-demand's and 0.7x checkpoint-restart's, in
no more time than checkpoint-restart.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conveyor.bench._checks import require_known
from conveyor.elastic import (
    BILLINGS,
    SPOT_POLICIES,
    Costs,
    SpotOutcome,
    read_markets,
    simulate_spot,
    throughput_from_plan,
)
from conveyor.errors import InputError
from conveyor.plan import read_graph_txt

__all__ = ["GOALS", "MEASURED", "SHARED", "SpotConfig", "costs_from_elastic", "plot", "run"]

SHARED = Path(__file__).resolve().parents[4] / "shared"
TRACES = ("p3-trace.csv", "g4dn-trace.csv", "a100x1-east1b.txt", "v100x1-east1c.txt")
GOALS = {"vs_on_demand": 0.4, "vs_checkpoint_restart": 0.7}

# Measured by `conveyor bench elastic --json elastic.json` (2026-11-23, this project's 2-core machine: vgg16,
# 6 workers, 3 revoked at once): the means of its conveyor revoke events (0.891 s without notice, 1 step redone;
# 0.505 s with notice, none), of its add events (14.25 s, 15.12 s: worker processes starting) and of its torchrun
# revoke events (14.70 s, 13.60 s). `--elastic FILE` reads another report. checkpoint_s is not measured: an
# assumption (ResNet-50's weights and momentum, about 200 MB, written at about 100 MB/s).
MEASURED = {
    "revocation_s": 0.698,  # Conveyor elastic: from a revocation to the survivors' next step
    "addition_s": 14.6865,  # Conveyor elastic: from a machine's arrival to its first step in the job
    "steps_redone": 0.5,  # Conveyor elastic: steps recomputed after a revocation
    "restart_s": 14.1505,  # torchrun: restart all and reload the last checkpoint, to the next step
    "checkpoint_s": 2.0,  # checkpoint-restart: the pause to write a checkpoint (assumed, see above)
}


@dataclass(frozen=True)
class SpotConfig:
    """What ``conveyor bench spot`` replays."""

    traces: tuple[str, ...] = tuple(str(SHARED / "spot-traces" / t) for t in TRACES)
    billing: str = "per-second"
    work: float = 5e6  # samples (about 4 ImageNet epochs)
    fleet: int = 8  # on-demand, checkpoint-restart and elastic-fixed machines
    reliable: int = 1  # on-demand machines of the elastic policies' reliable tier
    machines: int = 16  # at most this many machines per market
    profile: str = str(SHARED / "pipedream-profiles" / "resnet50")
    batch: int = 64  # samples per machine per step (the profile's minibatch)
    bandwidth: float = 1.17e9  # bytes/s of each machine's link (10 Gbit/s goodput)
    checkpoint_every_s: float = 600.0
    decide_every_s: float = 300.0
    policies: tuple[str, ...] = SPOT_POLICIES
    measured: dict[str, float] = field(default_factory=lambda: dict(MEASURED))

    def __post_init__(self) -> None:
        require_known("policies", self.policies, SPOT_POLICIES)
        require_known("billing", [self.billing], BILLINGS)
        if not (self.work > 0 and self.fleet >= 1 and self.reliable >= 1 and self.machines >= 1 and self.batch >= 1):
            raise InputError("work, fleet, reliable, machines and batch must be positive")
        require_known("measured costs", self.measured, MEASURED)


def costs_from_elastic(path: str | Path) -> dict[str, float]:
    """The measured costs in a ``conveyor bench elastic --json`` report: the mean Conveyor ``recovery_s`` of its
    revoke and add events, their mean ``steps_redone``, and the mean torchrun ``recovery_s`` as ``restart_s``.

    Example:
        >>> import tempfile
        >>> ev = lambda kind, s, redo=0: {"kind": kind, "recovery_s": s, "steps_redone": redo}
        >>> report = {"conveyor": {"events": [ev("revoke", 4.0, 1), ev("revoke", 6.0, 3), ev("add", 2.0)]},
        ...           "torchrun": {"events": [ev("revoke", 50.0), ev("add", 0.0)]}}
        >>> with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        ...     json.dump(report, f)
        >>> costs_from_elastic(f.name)
        {'revocation_s': 5.0, 'steps_redone': 2.0, 'addition_s': 2.0, 'restart_s': 50.0}
    """
    try:
        report = json.loads(Path(path).read_text())
        conveyor, torchrun = report["conveyor"]["events"], report["torchrun"]["events"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: not a conveyor bench elastic report ({type(exc).__name__}: {exc})") from None

    def mean(events: list[dict[str, Any]], kind: str, key: str) -> float | None:
        values = [float(e[key]) for e in events if e.get("kind") == kind and e.get(key) is not None]
        return sum(values) / len(values) if values else None

    found = {
        "revocation_s": mean(conveyor, "revoke", "recovery_s"),
        "steps_redone": mean(conveyor, "revoke", "steps_redone"),
        "addition_s": mean(conveyor, "add", "recovery_s"),
        "restart_s": mean(torchrun, "revoke", "recovery_s"),
    }
    return {k: v for k, v in found.items() if v is not None}


def _goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["policy"]: r for r in results}
    out: dict[str, Any] = {"targets": GOALS}
    if "bidbrain" not in by:
        return out
    b = by["bidbrain"]
    if "on-demand" in by:
        out["vs_on_demand"] = b["cost_per_work"] / by["on-demand"]["cost_per_work"]
        out["vs_on_demand_met"] = b["finished"] and out["vs_on_demand"] <= GOALS["vs_on_demand"]
    if "checkpoint-restart" in by:
        cr = by["checkpoint-restart"]
        out["vs_checkpoint_restart"] = b["cost_per_work"] / cr["cost_per_work"]
        ratio = out["vs_checkpoint_restart"]
        out["vs_checkpoint_restart_met"] = b["finished"] and ratio <= GOALS["vs_checkpoint_restart"]
        out["time_vs_checkpoint_restart"] = b["seconds"] / cr["seconds"]
        out["time_met"] = b["finished"] and b["seconds"] <= cr["seconds"]
    return out


def plot(outcomes: list[SpotOutcome], path: str | Path) -> None:
    """Machines held over time per policy (left) and cost per million samples (right)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 1]})
    for o in outcomes:
        t, n = zip(*o.held, strict=True) if o.held else ((), ())
        left.step([x / 3600 for x in t], n, where="post", label=o.policy)
    left.set_xlabel("hours")
    left.set_ylabel("machines held (reliable tier included)")
    left.legend()
    reports = [o.report() for o in outcomes]
    right.bar([r["policy"] for r in reports], [r["cost_per_work"] for r in reports])
    right.set_ylabel("$ per 1M samples")
    right.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: SpotConfig, plot_path: str | None = None) -> dict[str, Any]:
    """Replay every policy; return the JSON-ready report (and write the plot)."""
    markets = read_markets(list(cfg.traces))
    profile = read_graph_txt(Path(cfg.profile) / "graph.txt")
    x = throughput_from_plan(
        profile,
        batch=cfg.batch,
        bandwidth=cfg.bandwidth,
        max_machines=cfg.machines * len(markets) + cfg.fleet + cfg.reliable,
        reliable=cfg.reliable,
    )
    costs = Costs(**cfg.measured, checkpoint_every_s=cfg.checkpoint_every_s, decide_every_s=cfg.decide_every_s)
    outcomes = [
        simulate_spot(
            p,
            markets,
            x,
            cfg.work,
            fleet=cfg.fleet,
            reliable=cfg.reliable,
            machines=cfg.machines,
            billing=cfg.billing,
            costs=costs,
        )
        for p in cfg.policies
    ]
    results = [o.report() for o in outcomes]
    if plot_path:
        plot(outcomes, plot_path)
    prices = {m.name: asdict(m.price) for m in markets}
    return {"config": asdict(cfg), "prices": prices, "results": results, "goals": _goals(results)}
