"""The jobs of a cluster trace, and Gavel's trace format: one job per line, ten tab-separated fields."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from conveyor.errors import InputError

__all__ = ["FIELDS", "KnownJobs", "TraceJob", "format_line", "parse_line", "read_trace", "write_trace"]

# Gavel's order (utils.parse_trace); the first nine are what job.Job.__str__ writes, the last is the arrival time.
FIELDS = (
    "job_type",
    "command",
    "working_directory",
    "num_steps_arg",
    "needs_data_dir",
    "total_steps",
    "scale_factor",
    "priority_weight",
    "SLO",
    "arrival_time",
)


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace.

    Attributes:
        job_type: the model and batch size, as the throughput table names it, e.g. ``'ResNet-18 (batch size 16)'``.
        total_steps: steps the job runs for (a step: one minibatch on one of its devices, as Gavel counts).
        scale_factor: devices it uses at once (1, 2, 4 or 8).
        arrival_s: seconds from the start of the trace at which it arrives.
        priority_weight: its weight in weighted policies (Gavel's traces: 1 or 5).
        slo: its deadline as a multiple of its duration alone on the reference type (``None``: none).
        duration_s: its duration alone on the reference type, when known (generated jobs); not in the file.
        command, working_directory, num_steps_arg, needs_data_dir: how Gavel's workers would launch it;
            kept so that a trace read and written again is the same file. Generated jobs get placeholders
            (the simulator never runs them).

    Example:
        >>> job = TraceJob("A3C", total_steps=1000, scale_factor=1, arrival_s=0.0, slo=2.0)
        >>> job.slo, job.priority_weight, job.command  # a generated job's placeholder command
        (2.0, 1.0, 'generated')
    """

    job_type: str
    total_steps: int
    scale_factor: int
    arrival_s: float
    priority_weight: float = 1.0
    slo: float | None = None
    duration_s: float | None = None
    command: str = "generated"
    working_directory: str = "."
    num_steps_arg: str = "--num_steps"
    needs_data_dir: bool = False

    def __post_init__(self) -> None:
        for name in ("job_type", "command", "working_directory", "num_steps_arg"):
            text = getattr(self, name)
            if not text or any(c in text for c in "\t\r\n"):
                raise InputError(f"job {name} {text!r} must be non-empty text without tabs or line breaks")
        # Whole numbers as ints (Gavel's format writes them with %d), the rest as floats, so equal jobs compare equal.
        for name in ("total_steps", "scale_factor"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, numbers.Integral):
                raise InputError(f"job {self.job_type!r} has {name} {value!r}: give a whole number")
            object.__setattr__(self, name, int(value))
        for name in ("arrival_s", "priority_weight", "slo", "duration_s"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "needs_data_dir", bool(self.needs_data_dir))
        if self.scale_factor < 1:
            raise InputError(
                f"job {self.job_type!r} has scale factor {self.scale_factor}: a job uses at least 1 device"
            )
        if self.total_steps < 1:
            raise InputError(f"job {self.job_type!r} has {self.total_steps} total steps: give at least 1")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise InputError(f"job {self.job_type!r} arrives at {self.arrival_s} s: give a finite time >= 0")
        if not (math.isfinite(self.priority_weight) and self.priority_weight > 0):
            raise InputError(f"job {self.job_type!r} has priority weight {self.priority_weight}: give a number > 0")
        if self.slo is not None and not (math.isfinite(self.slo) and self.slo > 0):
            raise InputError(f"job {self.job_type!r} has SLO {self.slo}: give a multiple of its duration > 0, or None")


def _number(value: float, fmt: str) -> str:
    """``value`` as Gavel writes it (``fmt``) when that reads back exactly, else its shortest exact form (which
    Gavel's ``float()`` reads too), so that a round trip loses nothing."""
    text = fmt % value
    return text if float(text) == value else repr(float(value))


def format_line(job: TraceJob) -> str:
    """The trace line of ``job`` (without the newline), as Gavel's ``Job.__str__`` and generator write it.

    Example:
        >>> format_line(TraceJob("A3C", 1000, 1, 30.0, slo=1.2)).split("\\t")[4:]
        ['0', '1000', '1', '1', '1.200000', '30']
    """
    return "\t".join(
        (
            job.job_type,
            job.command,
            job.working_directory,
            job.num_steps_arg,
            str(int(job.needs_data_dir)),
            str(job.total_steps),
            str(job.scale_factor),
            _number(job.priority_weight, "%d"),
            f"{-1:f}" if job.slo is None else _number(job.slo, "%f"),
            _number(job.arrival_s, "%d"),
        )
    )


def parse_line(line: str, where: str = "trace line") -> TraceJob:
    """One trace line (Gavel's or ours) as a job; ``where`` prefixes error messages (``path:line``).

    Raises:
        ValueError: the line does not have ten fields or a field is not what Gavel's format holds.

    Example:
        >>> parse_line("A3C\\tpython3 main.py\\trl\\t--max-steps\\t0\\t1000\\t1\\t5\\t-1.000000\\t12.5").priority_weight
        5.0
    """
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != len(FIELDS):
        raise InputError(
            f"{where}: {len(fields)} tab-separated fields, Gavel's trace format has {len(FIELDS)} ({', '.join(FIELDS)})"
        )
    job_type, command, working_directory, num_steps_arg = fields[:4]

    def number(index: int, kind: type[int] | type[float]) -> float:
        try:
            return kind(fields[index])
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise InputError(f"{where}: field {FIELDS[index]} is {fields[index]!r}, not {noun}") from None

    needs_data_dir = number(4, int)
    if needs_data_dir not in (0, 1):
        raise InputError(f"{where}: field needs_data_dir is {fields[4]!r}; write 0 or 1")
    scale_factor = int(number(6, int))
    if scale_factor < 1:
        raise InputError(f"{where}: scale factor {scale_factor} < 1; a job uses at least 1 device")
    slo = number(8, float)
    try:
        return TraceJob(
            job_type=job_type,
            total_steps=int(number(5, int)),
            scale_factor=scale_factor,
            arrival_s=number(9, float),
            priority_weight=number(7, float),
            slo=None if slo < 0 else slo,
            command=command,
            working_directory=working_directory,
            num_steps_arg=num_steps_arg,
            needs_data_dir=bool(needs_data_dir),
        )
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None


class KnownJobs(Protocol):
    """What a trace is checked against: a throughput table (:class:`~conveyor.cluster.ThroughputTable` keeps it)."""

    @property
    def source(self) -> str:
        """Where the table came from, for messages."""
        ...

    @property
    def job_types(self) -> tuple[str, ...]:
        """The job types it knows."""
        ...

    def has(self, job_type: str, scale_factor: int) -> bool:
        """Whether it has a throughput for the job type on ``scale_factor`` devices."""
        ...

    def scale_factors(self, job_type: str) -> tuple[int, ...]:
        """The scale factors it has for ``job_type``."""
        ...


def read_trace(
    path: str | os.PathLike[str], known_types: Collection[str] | None = None, *, table: KnownJobs | None = None
) -> list[TraceJob]:
    """The jobs of a trace file (Gavel's format), in file order; blank lines are skipped.

    Args:
        path: the trace.
        known_types: the job types allowed (``None``: any, or ``table``'s).
        table: a throughput table every job's ``(job_type, scale_factor)`` must be in.

    Raises:
        ValueError: a line is malformed, names an unknown job type or a (type, scale) the table lacks.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "trace.txt"
        >>> write_trace([TraceJob("A3C", 1000, 1, 0.0), TraceJob("CycleGAN", 50, 1, 7.25)], path)
        >>> [(j.job_type, j.arrival_s) for j in read_trace(path, known_types={"A3C", "CycleGAN"})]
        [('A3C', 0.0), ('CycleGAN', 7.25)]
    """
    path = Path(path)
    if known_types is None and table is not None:
        known_types = table.job_types
    known = None if known_types is None else frozenset(known_types)
    origin = f"the throughput table {table.source}" if table is not None else "the given known_types"
    jobs = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            job = parse_line(line, f"{path}:{number}")
            if known is not None and job.job_type not in known:
                example = f" (e.g. {min(known)!r})" if known else ""
                raise InputError(
                    f"{path}:{number}: unknown job type {job.job_type!r}; {origin} knows {len(known)} types{example}: "
                    "rename the job or use a table that has it"
                )
            if table is not None and not table.has(job.job_type, job.scale_factor):
                scales = table.scale_factors(job.job_type)
                raise InputError(
                    f"{path}:{number}: {origin} has no throughput for {job.job_type!r} on {job.scale_factor} devices "
                    f"(it has scale factors {list(scales)}): change the scale factor or the table"
                )
            jobs.append(job)
    return jobs


def write_trace(jobs: Iterable[TraceJob], path: str | os.PathLike[str]) -> None:
    """Write ``jobs`` in Gavel's trace format, one line each (Gavel's ``parse_trace`` reads it).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "trace.txt"
        >>> write_trace([TraceJob("A3C", 1000, 1, 0.0)], path)
        >>> path.read_text().count("\\t")
        9
    """
    Path(path).write_text("".join(format_line(job) + "\n" for job in jobs), encoding="utf-8")
