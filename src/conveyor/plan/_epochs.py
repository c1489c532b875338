"""Epochs to accuracy per schedule, relative to data parallelism: the statistical half of time to accuracy.

A schedule's time to accuracy is its time per epoch (the simulator's) times the epochs it needs. The
synchronous schedules need exactly data parallelism's epochs (their update is the same); the asynchronous
ones need what stale gradients cost, which only training tells. ``conveyor bench convergence`` measures it
(median epochs to a target over seeds, over data parallelism's) for every zoo model, schedule, and with and
without the stale-gradient correction, and writes the table this module reads. The package ships the table
of its own measurement (``epoch_factors.json``, with the command and date that made it); give your own
with ``conveyor train --epoch-factors FILE`` (a ``conveyor bench convergence --json`` report).

The correction's learning rate comes in two rules (:meth:`~conveyor.schedule.Kind.lr_scale`): ``sample``, the
rate per sample of data parallelism, and ``damped``, that over one plus the stage's staleness. Which converges
sooner depends on the model: the damped rate keeps VGG-16's stale stages stable where the per-sample rate makes
them oscillate, and slows models that are far from that edge. The report's ``stale_rates`` names, per model and
schedule, the rule its runs measured faster (fewer median epochs, then fewer in the worst seed); ``auto`` takes
it, and ``sample`` where the table says nothing.

Example:
    >>> factors = EpochFactors({"mlp": {"dp": 1.0, "flush": 1.0, "2bw": 1.2, "2bw/plain": 2.0}}, "example")
    >>> factors.factor("mlp", "2bw"), factors.factor("mlp", "2bw", corrected=False), factors.factor("mlp", "flush")
    (1.2, 2.0, 1.0)
    >>> factors.factor("my_model", "2bw")  # a model never measured: the largest factor measured for the schedule
    1.2
    >>> damped = EpochFactors({"vgg16": {"pipedream": 1.0, "pipedream/damped": 0.9}}, "example",
    ...                       {"vgg16": {"pipedream": "damped"}})
    >>> damped.rate("vgg16", "pipedream"), damped.factor("vgg16", "pipedream"), damped.rate("mlp", "pipedream")
    ('damped', 0.9, 'sample')
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.errors import InputError
from conveyor.schedule import kind

__all__ = ["EpochFactors"]

SHIPPED = Path(__file__).with_name("epoch_factors.json")


@dataclass(frozen=True)
class EpochFactors:
    """Per model, per strategy (a schedule; ``"SCHEDULE/damped"`` with the damped rate; ``"SCHEDULE/plain"``
    without the correction): the median epochs to target over data parallelism's; ``source`` says where the
    figures come from; ``rates`` the rule of the correction's rate measured faster, per model and schedule."""

    table: dict[str, dict[str, float]]
    source: str
    rates: dict[str, dict[str, str]] = field(default_factory=dict)

    def rate(self, model: str, schedule: str, asked: str = "auto") -> str:
        """The correction's rate rule for ``schedule`` on ``model``: ``asked``, or for ``auto`` the one the
        table measured faster (``sample`` where it has none)."""
        return self.rates.get(model, {}).get(schedule, "sample") if asked == "auto" else asked

    def run_rate(self, model: str, schedule: str, *, corrected: bool, asked: str = "auto") -> str | None:
        """The rate a run of ``schedule`` takes (:meth:`rate`); ``None`` where no stage is corrected: without the
        correction, or on a synchronous schedule."""
        return self.rate(model, schedule, asked) if corrected and not kind(schedule).synchronous else None

    def factor(self, model: str, schedule: str, corrected: bool = True, rate: str = "auto") -> float:
        """The epochs ``schedule`` needs on ``model`` over data parallelism's, with the correction at ``rate``
        (:meth:`rate`) or without it. A model the table lacks (your own) gets the largest factor measured for
        the schedule, at that rate, on any model: a cautious guess until you measure it. Only a table with no
        figure for that rate anywhere gives the corrected per-sample one; a synchronous schedule without a figure
        gets 1 (its update is data parallelism's)."""
        keys = [schedule]  # a synchronous one has no "/plain" nor "/damped"
        if not corrected:
            keys.insert(0, f"{schedule}/plain")
        elif self.rate(model, schedule, rate) == "damped":
            keys.insert(0, f"{schedule}/damped")
        per_model = self.table.get(model, {})
        for key in keys:  # this model's figure for the variant, else the largest any model has, before the next
            if key in per_model:
                return per_model[key]
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
            rates = {m: {s: str(r) for s, r in per.items()} for m, per in report.get("stale_rates", {}).items()}
            if unknown := {r for per in rates.values() for r in per.values()} - {"sample", "damped"}:
                raise ValueError(f"stale_rates has {sorted(unknown)[0]!r} where sample or damped belongs")
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
            raise InputError(
                f"cannot read epoch factors from {file}: {exc}; give a report of conveyor bench convergence --json"
            ) from exc
        return cls(table, str(report.get("source", file)), rates)
