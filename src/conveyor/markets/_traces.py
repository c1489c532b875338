"""Spot markets from availability traces: SkyPilot's JSON counts (Wu et al., NSDI'24), one market per file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conveyor.emulate import read_counts
from conveyor.errors import InputError

__all__ = ["MarketTrace", "read_market_trace", "read_trace_set"]


@dataclass(frozen=True, eq=False)
class MarketTrace:
    """One (zone, instance type) market: how many machines a probe could get (or kept) at each tick.

    Attributes:
        zone: the cloud zone, for example ``us-west-2a``.
        instance: the machine kind as the file names it, for example ``v100_1`` (one V100) or ``k80_8``.
        gap_s: seconds between ticks.
        counts: machines available at tick ``i`` (time ``i * gap_s``), integers >= 0.

    Example:
        >>> m = MarketTrace("us-west-2a", "v100_1", 600.0, np.array([1, 1, 0, 1]))
        >>> m.name, m.region, m.hours, m.drops
        ('us-west-2a_v100_1', 'us-west-2', 0.6666666666666666, 1)
    """

    zone: str
    instance: str
    gap_s: float
    counts: np.ndarray

    @property
    def name(self) -> str:
        return f"{self.zone}_{self.instance}"

    @property
    def region(self) -> str:
        """The zone's region (its name less the zone letter): data parallelism runs within one."""
        return self.zone[:-1] if self.zone[-1:].isalpha() else self.zone

    @property
    def hours(self) -> float:
        return len(self.counts) * self.gap_s / 3600.0

    @property
    def drops(self) -> int:
        """How many ticks have fewer machines than the tick before (each is a preemption of held machines)."""
        return int(np.sum(np.diff(self.counts) < 0))

    def cut(self, ticks: int) -> MarketTrace:
        """The first ``ticks`` ticks (trace sets are aligned to their shortest member)."""
        return MarketTrace(self.zone, self.instance, self.gap_s, self.counts[:ticks])


def read_market_trace(path: str | Path) -> MarketTrace:
    """Read ``ZONE_TYPE_N.json``: ``{"metadata": {"gap_seconds": G}, "data": [N0, N1, ...]}``.

    Example:
        >>> read_market_trace("us-east-1a.json")
        Traceback (most recent call last):
        ...
        conveyor.errors.InputError: trace us-east-1a.json does not exist (see ../shared/spot-traces/README.md)
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"trace {path} does not exist (see ../shared/spot-traces/README.md)")
    zone, _, instance = path.name.removesuffix(".json").partition("_")
    if not (zone and instance) or path.suffix != ".json":
        raise InputError(f"trace {path.name}: expected a name ZONE_TYPE_COUNT.json, like us-west-2a_v100_1.json")
    gap, counts = read_counts(path)
    return MarketTrace(zone, instance, gap, np.asarray(counts, dtype=np.int64))


def read_trace_set(folder: str | Path, instances: tuple[str, ...] = ()) -> list[MarketTrace]:
    """Every ``*.json`` trace of a folder (one trace set: the same period and tick), sorted by name, cut to the
    shortest; ``instances`` keeps only those kinds (for example ``("v100_1", "k80_1")``).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"trace set {folder} is not a folder (see ../shared/spot-traces/README.md)")
    traces = [read_market_trace(p) for p in sorted(folder.glob("*.json"))]
    if instances:
        traces = [t for t in traces if t.instance in instances]
    if not traces:
        kinds = f" of kinds {', '.join(instances)}" if instances else ""
        raise InputError(f"trace set {folder} has no ZONE_TYPE_N.json traces{kinds}")
    gaps = {t.gap_s for t in traces}
    if len(gaps) > 1:
        raise InputError(f"trace set {folder}: its traces have different ticks {sorted(gaps)} s; give one period")
    shortest = min(len(t.counts) for t in traces)
    return [t.cut(shortest) for t in traces]
