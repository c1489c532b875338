"""Epochs to accuracy per schedule, relative to data parallelism: the statistical half of time to accuracy.

A schedule's time to accuracy is its time per epoch (the simulator's) times the epochs it needs. The
synchronous schedules need exactly data parallelism's epochs (their update is the same); the asynchronous
ones need what stale gradients cost, which only training tells. ``conveyor bench convergence`` measures it
(median epochs to a target over seeds, over data parallelism's) for every zoo model, schedule, and with and
without the stale-gradient correction, and writes the table this module reads. The package ships the table
of its own measurement (``epoch_factors.json``, with the command and date that made it); give your own
with ``conveyor train --epoch-factors FILE`` (a ``conveyor bench convergence --json`` report).

Example:
    >>> factors = EpochFactors({"mlp": {"dp": 1.0, "flush": 1.0, "2bw": 1.2, "2bw/plain": 2.0}}, "example")
    >>> factors.factor("mlp", "2bw"), factors.factor("mlp", "2bw", corrected=False), factors.factor("mlp", "flush")
    (1.2, 2.0, 1.0)
    >>> factors.factor("my_model", "2bw")  # a model never measured: the largest factor measured for the schedule
    1.2
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from conveyor.errors import InputError

__all__ = ["EpochFactors"]

SHIPPED = Path(__file__).with_name("epoch_factors.json")


@dataclass(frozen=True)
class EpochFactors:
    """Per model, per strategy (a schedule, or ``"SCHEDULE/plain"`` without the correction): the median
    epochs to target over data parallelism's; ``source`` says where the figures come from."""

    table: dict[str, dict[str, float]]
    source: str

    def factor(self, model: str, schedule: str, corrected: bool = True) -> float:
        """The epochs ``schedule`` needs on ``model`` over data parallelism's. A model the table lacks (your own)
        gets the largest factor measured for the schedule on any model: a cautious guess until you measure it.
        A synchronous schedule without a figure gets 1 (its update is data parallelism's)."""
        keys = [schedule] if corrected else [f"{schedule}/plain", schedule]  # a synchronous one has no "/plain"
        per_model = self.table.get(model, {})
        for key in keys:
            if key in per_model:
                return per_model[key]
        for key in keys:
            if measured := [per[key] for per in self.table.values() if key in per]:
                return max(measured)
        return 1.0

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> EpochFactors:
        """Read a ``conveyor bench convergence`` report (default: the table shipped with Conveyor).

        Raises:
            ValueError: the file is not such a report.
        """
        file = Path(path) if path is not None else SHIPPED
        try:
            report = json.loads(file.read_text())
            table = {m: {s: float(f) for s, f in per.items()} for m, per in report["epoch_factors"].items()}
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
            raise InputError(
                f"cannot read epoch factors from {file}: {exc}; give a report of conveyor bench convergence --json"
            ) from exc
        return cls(table, str(report.get("source", file)))
