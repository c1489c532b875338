"""Replaying Zeus' published traces: recurrences of a job under a batch-size policy, power limits chosen just
in time, without training anything.

The train trace gives, per (workload, batch size, seed), the epoch at which the target was reached (or none);
the power trace gives, per (batch size, power limit), seconds per epoch and mean power. A recurrence with
batch size ``b`` samples one seed's path, runs at the power limit of least epoch cost for ``b``

    epoch_cost(b, p) = (eta * power(b, p) + (1 - eta) * max_power) * seconds_per_epoch(b, p)   (Zeus Eq. 7)

and stops early once another epoch would take its cost past the early-stopping threshold. The first
recurrence of a batch size profiles every power limit during its first epoch (that epoch costs the mean
over limits). A recurrence that does not reach the target is run again (with the policy's next choice)
until one does; its cost is the sum. This is the model of Zeus' trace-driven simulator
(``zeus._legacy.simulate``), written from its description.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from conveyor.energy._bandit import BatchSizeSearch, Recurrence, zeus_cost
from conveyor.errors import InputError

__all__ = ["ReplayOutcome", "Workload", "WorkloadTrace", "load_traces", "replay"]


@dataclass(frozen=True)
class Workload:
    """A recurring job of the traces: its data and model, the target, its epoch budget and default batch size."""

    dataset: str
    network: str
    optimizer: str
    target: float
    max_epochs: int
    default_batch_size: int

    @property
    def name(self) -> str:
        return f"{self.dataset}/{self.network}"


@dataclass
class WorkloadTrace:
    """One workload on one GPU: target epochs per batch size (one per seed, ``nan``: never reached), and
    ``(seconds per epoch, watts)`` per (batch size, power limit)."""

    workload: Workload
    gpu: str
    target_epochs: dict[int, list[float]]
    power: dict[int, dict[int, tuple[float, float]]]

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The sizes both traces have (as Zeus' simulator joins them)."""
        return tuple(sorted(set(self.target_epochs) & set(self.power)))

    @property
    def max_power(self) -> float:
        return float(max(p for limits in self.power.values() for p in limits))

    def epoch_costs(self, size: int, eta: float) -> dict[int, float]:
        """Eq. 7's epoch cost of each power limit for ``size``."""
        return {
            p: (eta * watts + (1 - eta) * self.max_power) * seconds for p, (seconds, watts) in self.power[size].items()
        }

    def best_limit(self, size: int, eta: float) -> int:
        costs = self.epoch_costs(size, eta)
        return min(costs, key=costs.__getitem__)


def load_traces(folder: Path, workloads: list[Workload], gpu: str) -> list[WorkloadTrace]:
    """Read ``summary_train.csv`` and ``summary_power_{gpu}.csv`` from ``folder`` for ``workloads``."""
    train, power = folder / "summary_train.csv", folder / f"summary_power_{gpu}.csv"
    for path in (train, power):
        if not path.exists():
            raise FileNotFoundError(
                f"no Zeus trace at {path}: give --traces the folder of Zeus' published traces "
                "(ml-energy/zeus, examples/research_reproducibility/zeus_nsdi23)"
            )
    out = []
    with train.open() as f:
        train_rows = list(csv.DictReader(f))
    with power.open() as f:
        power_rows = list(csv.DictReader(f))
    for w in workloads:
        key = (w.dataset, w.network, w.optimizer)
        epochs: dict[int, list[float]] = defaultdict(list)
        for row in train_rows:
            if (row["dataset"], row["network"], row["optimizer"]) == key and math.isclose(
                float(row["target_metric"]), w.target
            ):
                epochs[int(row["batch_size"])].append(float(row["target_epoch"]) if row["target_epoch"] else math.nan)
        table: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
        for row in power_rows:
            if (row["dataset"], row["network"], row["optimizer"]) == key:
                table[int(row["batch_size"])][int(row["power_limit"])] = (
                    float(row["time_per_epoch"]),
                    float(row["average_power"]),
                )
        if not epochs or not table:
            raise InputError(f"the traces have no {w.name} ({w.optimizer}, target {w.target}) on {gpu}")
        out.append(WorkloadTrace(w, gpu, dict(epochs), dict(table)))
    return out


@dataclass
class ReplayOutcome:
    """What a policy paid over a job's recurrences: energy, time and cost summed, and each try."""

    energy_j: float = 0.0
    time_s: float = 0.0
    cost: float = 0.0
    tries: list[tuple[int, int, float, bool]] = field(default_factory=list)  # (batch size, limit, cost, reached)


Policy = Callable[[list[Recurrence]], int]  # history -> the next try's batch size


def replay(
    trace: WorkloadTrace,
    policy: Policy,
    *,
    recurrences: int,
    eta: float,
    beta: float | None,
    seed: int = 0,
    limit: Callable[[int], int] | None = None,
) -> ReplayOutcome:
    """Run ``recurrences`` recurrences of ``trace``'s job, each until a try reaches the target (at most 20 tries),
    with batch sizes from ``policy`` and power limits from ``limit`` (default: profiled just in time, the least
    epoch cost); ``beta``: early stopping at ``beta`` times the least cost of a recurrence so far (None: off)."""
    rng = np.random.default_rng(seed)
    history: list[Recurrence] = []
    out = ReplayOutcome()
    profiled: set[int] = set()
    least = math.inf
    top = trace.max_power
    for _ in range(recurrences):
        spent = 0.0
        for _ in range(20):
            size = policy(history)
            power_limit = limit(size) if limit else trace.best_limit(size, eta)
            seconds, watts = trace.power[size][power_limit]
            epoch_cost = zeus_cost(seconds * watts, seconds, eta, top)
            profiling = limit is None and size not in profiled  # its first epoch profiles every limit
            profiled.add(size)
            budget = trace.workload.max_epochs
            if beta is not None and math.isfinite(least):
                budget = min(budget, int((beta * least) // epoch_cost))
            if budget == 0:  # not one epoch fits under the threshold: a failure that costs nothing
                history.append(Recurrence(size, 100 * beta * least if beta else math.inf, False))
                continue
            target = trace.target_epochs[size][int(rng.integers(len(trace.target_epochs[size])))]
            reached = not math.isnan(target) and target <= budget
            epochs = int(target) if reached else budget
            energy, time_s = seconds * watts * epochs, seconds * epochs
            if profiling:
                mean_s = float(np.mean([s for s, _ in trace.power[size].values()]))
                mean_j = float(np.mean([s * w for s, w in trace.power[size].values()]))
                energy, time_s = energy - seconds * watts + mean_j, time_s - seconds + mean_s
            cost = zeus_cost(energy, time_s, eta, top)
            spent += cost
            out.energy_j, out.time_s, out.cost = out.energy_j + energy, out.time_s + time_s, out.cost + cost
            out.tries.append((size, power_limit, cost, reached))
            history.append(Recurrence(size, cost, reached))
            if reached:
                least = min(least, spent)
                break
        else:
            raise RuntimeError(f"{trace.workload.name} on {trace.gpu}: no try of a recurrence reached the target in 20")
    return out


def search_policy(trace: WorkloadTrace, beta: float, seed: int) -> Policy:
    """Conveyor's :class:`BatchSizeSearch` over the sizes the traces have, as a replay policy."""
    search = BatchSizeSearch(trace.batch_sizes, trace.workload.default_batch_size, beta=beta)
    rng = np.random.default_rng(seed)
    return lambda history: search.choose(history, rng).batch_size
