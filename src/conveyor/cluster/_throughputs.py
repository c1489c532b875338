"""Job throughputs per device type: Gavel's measured table, and estimates refined online (Conveyor's planner's
are in :mod:`conveyor.cluster._planned`)."""

from __future__ import annotations

import ast
import json
import math
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from conveyor.cluster._trace import TraceJob
from conveyor.errors import InputError

__all__ = [
    "JobKey",
    "OnlineThroughputs",
    "ThroughputTable",
    "default_gavel_path",
]

JobKey: TypeAlias = tuple[str, int]
"""A job type and its scale factor, e.g. ``('ResNet-18 (batch size 16)', 1)``: the table's key."""

GAVEL_URL = "https://github.com/stanford-futuredata/gavel (scheduler/simulation_throughputs.json)"


def default_gavel_path() -> Path:
    """Where Gavel's published table is: ``../shared/gavel/simulation_throughputs.json`` beside the checkout."""
    return Path(__file__).resolve().parents[4] / "shared" / "gavel" / "simulation_throughputs.json"


def _key(job: JobKey | TraceJob) -> JobKey:
    return (job.job_type, job.scale_factor) if isinstance(job, TraceJob) else (job[0], int(job[1]))


@dataclass(frozen=True)
class ThroughputTable:
    """Steps/s of each ``(job_type, scale_factor)`` alone, and of pairs sharing devices, per device type.

    Gavel's JSON (:meth:`load`) holds ``{device: {repr(key): {"null": alone, repr(other): [this, other]}}}``.
    A key the table has on some device type but not on another runs at 0 there (it cannot run there).

    Attributes:
        alone_rates: ``{device_type: {key: steps/s alone}}``.
        pair_rates: ``{device_type: {(key_a, key_b): (steps/s of a, steps/s of b)}}`` when a and b share devices.
        source: where the table came from, for messages.

    Example:
        >>> raw = {"v100": {"('A', 1)": {"null": 10.0, "('B', 1)": [6.0, 3.0]}, "('B', 1)": {"null": 5.0}},
        ...        "k80": {"('A', 1)": {"null": 2.0}, "('B', 1)": {"null": 1.0}}}
        >>> t = ThroughputTable.from_dict(raw)
        >>> t.device_types, t.job_types, t.alone("A", 1, "k80"), t.colocated(("B", 1), ("A", 1), "v100")
        (('v100', 'k80'), ('A', 'B'), 2.0, (3.0, 6.0))
        >>> t.matrix([("A", 1), ("B", 1)]).tolist(), {k: v.tolist() for k, v in t.pairs([("A", 1), ("B", 1)]).items()}
        ([[10.0, 2.0], [5.0, 1.0]], {(0, 1): [[6.0, 3.0], [0.0, 0.0]]})
    """

    alone_rates: Mapping[str, Mapping[JobKey, float]]
    pair_rates: Mapping[str, Mapping[tuple[JobKey, JobKey], tuple[float, float]]] = field(default_factory=dict)
    source: str = "(in memory)"

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, unconsolidated: bool = False) -> ThroughputTable:
        """Read Gavel's ``simulation_throughputs.json`` (default: :func:`default_gavel_path`).

        Args:
            path: the JSON file.
            unconsolidated: also keep the ``*_unconsolidated`` device types (a job's devices on several servers).

        Raises:
            ValueError: no file there, or it is not Gavel's format.
        """
        path = Path(path) if path is not None else default_gavel_path()
        if not path.is_file():
            raise InputError(f"no Gavel throughput table at {path}: put {GAVEL_URL} there or give its path")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} is not JSON ({exc}): give Gavel's simulation_throughputs.json") from None
        return cls.from_dict(raw, str(path), unconsolidated)

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], source: str = "(in memory)", unconsolidated: bool = False
    ) -> ThroughputTable:
        """The table from Gavel's JSON already parsed (keys are tuple reprs, read with ``ast.literal_eval``)."""
        alone: dict[str, dict[JobKey, float]] = {}
        pairs: dict[str, dict[tuple[JobKey, JobKey], tuple[float, float]]] = {}
        for device, jobs in raw.items():
            if device.endswith("_unconsolidated") and not unconsolidated:
                continue
            alone[device], pairs[device] = {}, {}
            try:
                for text, rates in jobs.items():
                    key = _parse_key(text)
                    for other, rate in rates.items():
                        if other == "null":
                            alone[device][key] = float(rate)
                        else:
                            a, b = rate
                            pairs[device][(key, _parse_key(other))] = (float(a), float(b))
            except (AttributeError, TypeError, ValueError, SyntaxError) as exc:
                raise InputError(
                    f"{source}: device type {device!r} is not in Gavel's format {{device: {{\"('type', scale)\": "
                    f'{{"null": steps_per_s, ...}}}}}} ({type(exc).__name__}: {exc})'
                ) from None
        return cls(alone, pairs, source)

    @property
    def device_types(self) -> tuple[str, ...]:
        """The device types, in the file's order."""
        return tuple(self.alone_rates)

    @property
    def keys(self) -> tuple[JobKey, ...]:
        """Every ``(job_type, scale_factor)`` the table has on some device type, in first-seen order."""
        return tuple(dict.fromkeys(k for rates in self.alone_rates.values() for k in rates))

    @property
    def job_types(self) -> tuple[str, ...]:
        """The job types, in first-seen order."""
        return tuple(dict.fromkeys(k[0] for k in self.keys))

    def has(self, job_type: str, scale_factor: int) -> bool:
        """Whether some device type has a throughput for the job type on ``scale_factor`` devices."""
        return any((job_type, scale_factor) in rates for rates in self.alone_rates.values())

    def scale_factors(self, job_type: str) -> tuple[int, ...]:
        """The scale factors the table has for ``job_type`` (empty: an unknown type)."""
        return tuple(sorted({s for t, s in self.keys if t == job_type}))

    def _check(self, key: JobKey, device_type: str | None = None) -> None:
        if device_type is not None and device_type not in self.alone_rates:
            raise InputError(
                f"unknown device type {device_type!r}; the throughput table {self.source} has {list(self.device_types)}"
            )
        if not self.has(*key):
            if not self.scale_factors(key[0]):
                raise InputError(
                    f"unknown job type {key[0]!r}; the throughput table {self.source} knows {len(self.job_types)} "
                    "types: use one of them or another table"
                )
            raise InputError(
                f"the throughput table {self.source} has no {key[0]!r} on {key[1]} devices (it has scale factors "
                f"{list(self.scale_factors(key[0]))}): change the scale factor or the table"
            )

    def alone(self, job_type: str, scale_factor: int, device_type: str) -> float:
        """Steps/s of the job on ``scale_factor`` devices of ``device_type``, alone (0: it cannot run there).

        Raises:
            ValueError: an unknown device type, job type, or a scale factor the table lacks for the type.
        """
        key = (job_type, scale_factor)
        self._check(key, device_type)
        return self.alone_rates[device_type].get(key, 0.0)

    def colocated(
        self, job_a: JobKey | TraceJob, job_b: JobKey | TraceJob, device_type: str
    ) -> tuple[float, float] | None:
        """Steps/s of ``job_a`` and ``job_b`` when they share their devices of ``device_type`` (space sharing);
        ``None`` if the table has no measurement of the pair there."""
        a, b = _key(job_a), _key(job_b)
        self._check(a, device_type)
        self._check(b, device_type)
        rates = self.pair_rates.get(device_type, {})
        if (a, b) in rates:
            return rates[(a, b)]
        if (b, a) in rates:
            rb, ra = rates[(b, a)]
            return ra, rb
        return None

    def matrix(self, jobs: Sequence[JobKey | TraceJob], device_types: Sequence[str] | None = None) -> np.ndarray:
        """``(jobs, types)`` steps/s of each job alone on each type (``Problem.throughputs``); 0: cannot run.

        Raises:
            ValueError: a job's ``(job_type, scale_factor)`` or a device type is not in the table.
        """
        types = self.device_types if device_types is None else tuple(device_types)
        out = np.zeros((len(jobs), len(types)))
        for i, job in enumerate(jobs):
            key = _key(job)
            for k, device in enumerate(types):
                out[i, k] = self.alone(*key, device)
        return out

    def pairs(
        self, jobs: Sequence[JobKey | TraceJob], device_types: Sequence[str] | None = None
    ) -> dict[tuple[int, int], np.ndarray]:
        """``{(i, j): (types, 2) steps/s}`` for each pair ``i < j`` of equal scale factor sharing devices
        (``Problem.pair_throughputs``). A type without a measurement of the pair gives 0 (they cannot share
        there); pairs that cannot share on any type are left out, as they offer the policy nothing."""
        types = self.device_types if device_types is None else tuple(device_types)
        keys = [_key(job) for job in jobs]
        out = {}
        for i, a in enumerate(keys):
            for j in range(i + 1, len(keys)):
                b = keys[j]
                if a[1] != b[1]:
                    continue
                rates = np.array([self.colocated(a, b, device) or (0.0, 0.0) for device in types]).reshape(-1, 2)
                if (rates > 0).all(axis=1).any():
                    out[(i, j)] = rates
        return out


def _parse_key(text: str) -> JobKey:
    value = ast.literal_eval(text)
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)):
        raise InputError(f"key {text!r} is not a ('job type', scale_factor) tuple")
    return value[0], value[1]


class OnlineThroughputs:
    """Throughput estimates (steps/s) per ``(job_key, device_type)``, refined by measurements while jobs run.

    ``get`` answers, in this order:

    1. measured on this type: the measured rate, ``sum(steps) / sum(seconds)``; with ``halflife_s``, each
       record's weight halves every ``halflife_s`` seconds measured after it (an exponentially weighted mean
       that follows a job whose speed changes); with ``prior_weight_s``, the prior counts as that many seconds
       measured at its rate;
    2. measured on another type (the one measured longest): that rate times the ratio of this type's speed to
       it, from the job's own priors if it has both, else the geometric mean ratio over the jobs that have;
       corrected by how far the priors' ratio was off for the other jobs measured on both types (the
       geometric mean of measured ratio over prior ratio: priors that are proportional to a device's cores
       miss that a quarter core is more than 4x slower, and a table may miss a cluster's slower K80s);
    3. the prior, if known;
    4. the mean of the known priors of other jobs on this type;
    5. ``default``.

    Example:
        >>> est = OnlineThroughputs({(("A", 1), "v100"): 10.0, (("A", 1), "k80"): 2.0, (("B", 1), "v100"): 6.0})
        >>> est.get(("B", 1), "v100"), est.get(("B", 1), "k80")  # prior; mean of known k80 priors
        (6.0, 2.0)
        >>> est.record(("A", 1), "v100", steps=400, seconds=50.0)  # runs at 8/s, not 10
        >>> est.get(("A", 1), "v100"), est.get(("A", 1), "k80")  # measured; k80 scaled by the priors' ratio
        (8.0, 1.6)
        >>> est.set_prior(("B", 1), "k80", 1.5)
        >>> est.record(("B", 1), "v100", 300, 50.0); est.record(("B", 1), "k80", 50, 100.0)  # ratio 12, not 4
        >>> round(est.get(("A", 1), "k80"), 3)  # A's prior ratio 5, corrected by B's measured/prior 3
        0.533
    """

    def __init__(
        self,
        priors: Mapping[tuple[Hashable, str], float | None] | None = None,
        *,
        default: float = 1.0,
        halflife_s: float | None = None,
        prior_weight_s: float = 0.0,
    ) -> None:
        if not (default >= 0 and prior_weight_s >= 0 and (halflife_s is None or halflife_s > 0)):
            raise InputError("default and prior_weight_s must be >= 0 and halflife_s > 0 (or None)")
        self.default, self.halflife_s, self.prior_weight_s = default, halflife_s, prior_weight_s
        self._priors: dict[Hashable, dict[str, float]] = {}
        self._steps: dict[Hashable, dict[str, float]] = {}
        self._seconds: dict[Hashable, dict[str, float]] = {}
        for (job, device), rate in (priors or {}).items():
            self.set_prior(job, device, rate)

    @classmethod
    def from_table(cls, table: ThroughputTable, **options: Any) -> OnlineThroughputs:
        """Estimates starting from every value of ``table`` (job keys ``(job_type, scale_factor)``)."""
        return cls({(k, d): r for d, rates in table.alone_rates.items() for k, r in rates.items()}, **options)

    def set_prior(self, job_key: Hashable, device_type: str, rate: float | None) -> None:
        """Set (or with ``None`` forget) the prior steps/s of ``job_key`` on ``device_type``."""
        if rate is None:
            self._priors.get(job_key, {}).pop(device_type, None)
        elif not (math.isfinite(rate) and rate >= 0):
            raise InputError(f"prior throughput {rate} of {job_key!r} on {device_type} must be finite and >= 0")
        else:
            self._priors.setdefault(job_key, {})[device_type] = float(rate)

    def record(self, job_key: Hashable, device_type: str, steps: float, seconds: float) -> None:
        """Add a measurement: ``job_key`` ran ``steps`` steps in ``seconds`` seconds on ``device_type``."""
        if not (steps >= 0 and math.isfinite(steps) and seconds > 0 and math.isfinite(seconds)):
            raise InputError(f"a measurement needs steps >= 0 and seconds > 0, finite; got {steps}, {seconds}")
        done, spent = self._steps.setdefault(job_key, {}), self._seconds.setdefault(job_key, {})
        decay = 1.0 if self.halflife_s is None else 0.5 ** (seconds / self.halflife_s)
        done[device_type] = done.get(device_type, 0.0) * decay + steps
        spent[device_type] = spent.get(device_type, 0.0) * decay + seconds

    def measured(self, job_key: Hashable, device_type: str) -> float | None:
        """The measured steps/s (with the prior's weight, see above), or ``None`` before any measurement."""
        spent = self._seconds.get(job_key, {}).get(device_type, 0.0)
        if spent <= 0:
            return None
        done = self._steps[job_key][device_type]
        prior = self._priors.get(job_key, {}).get(device_type)
        weight = self.prior_weight_s if prior is not None else 0.0
        return (done + weight * (prior or 0.0)) / (spent + weight)

    def _ratio(self, job_key: Hashable, to: str, frm: str) -> float | None:
        """Speed of type ``to`` over type ``frm``: the job's priors', else the geometric mean over other jobs."""
        own = self._priors.get(job_key, {})
        if own.get(frm, 0.0) > 0 and to in own:
            return own[to] / own[frm]
        logs = [math.log(p[to] / p[frm]) for p in self._priors.values() if p.get(frm, 0.0) > 0 and p.get(to, 0.0) > 0]
        return math.exp(sum(logs) / len(logs)) if logs else None

    def _correction(self, job_key: Hashable, to: str, frm: str) -> float:
        """Geometric mean over the other jobs measured on both types of (measured ratio) / (prior ratio)."""
        logs = []
        for other in self._seconds:
            prior = self._ratio(other, to, frm)
            here, there = self.measured(other, to), self.measured(other, frm)
            if other != job_key and prior and here and there:
                logs.append(math.log(here / there / prior))
        return math.exp(sum(logs) / len(logs)) if logs else 1.0

    def get(self, job_key: Hashable, device_type: str) -> float:
        """The estimated steps/s of ``job_key`` on ``device_type`` (see the class docstring for the order)."""
        here = self.measured(job_key, device_type)
        if here is not None:
            return here
        spent = self._seconds.get(job_key, {})
        for other in sorted(spent, key=spent.__getitem__, reverse=True):
            ratio = self._ratio(job_key, device_type, other)
            rate = self.measured(job_key, other)
            if ratio is not None and rate is not None:
                return rate * ratio * self._correction(job_key, device_type, other)
        prior = self._priors.get(job_key, {}).get(device_type)
        if prior is not None:
            return prior
        known = [p[device_type] for p in self._priors.values() if device_type in p]
        return sum(known) / len(known) if known else self.default
