"""Gavel's synthetic jobs: Philly-derived sizes and durations, Poisson arrivals, optional priorities and SLOs."""

from __future__ import annotations

import numpy as np

from conveyor.cluster._throughputs import ThroughputTable
from conveyor.cluster._trace import TraceJob
from conveyor.errors import InputError

__all__ = [
    "DISTRIBUTED_FAMILIES",
    "GAVEL_JOB_TYPES",
    "generate_jobs",
    "sample_arrivals",
    "sample_durations",
    "sample_job_types",
    "sample_priorities",
    "sample_scale_factors",
    "sample_slos",
]

# Gavel's job table (job_table.py): the model families and the batch sizes it measured.
GAVEL_JOB_TYPES: tuple[str, ...] = (
    *(f"ResNet-18 (batch size {b})" for b in (16, 32, 64, 128, 256)),
    *(f"ResNet-50 (batch size {b})" for b in (16, 32, 64, 128)),
    *(f"Transformer (batch size {b})" for b in (16, 32, 64, 128, 256)),
    *(f"LM (batch size {b})" for b in (5, 10, 20, 40, 80)),
    *(f"Recommendation (batch size {b})" for b in (512, 1024, 2048, 4096, 8192)),
    "A3C",
    "CycleGAN",
)
# The families Gavel runs on more than one device (its table has scale factors 2, 4, 8 only for these).
DISTRIBUTED_FAMILIES: tuple[str, ...] = ("ResNet-18", "ResNet-50", "Transformer", "LM")

SCALE_FACTORS = np.array([1, 2, 4, 8])
SCALE_PROBABILITIES = np.array([0.70, 0.10, 0.15, 0.05])


def sample_scale_factors(rng: np.random.Generator, n: int) -> np.ndarray:
    """Devices per job, from Philly's job sizes as Gavel models them: 1, 2, 4 or 8 with probabilities
    0.70, 0.10, 0.15 and 0.05.

    Example:
        >>> sample_scale_factors(np.random.default_rng(0), 6).tolist()
        [1, 1, 1, 1, 4, 4]
    """
    return np.asarray(rng.choice(SCALE_FACTORS, size=n, p=SCALE_PROBABILITIES), dtype=int)


def sample_durations(rng: np.random.Generator, n: int) -> np.ndarray:
    """Seconds each job runs alone on the reference type, from Philly's durations as Gavel models them:
    ``60 * 10**U(1.5, 3)`` (about 32 minutes to 17 hours) with probability 0.8, else ``60 * 10**U(3, 4)``
    (17 to 167 hours).

    Example:
        >>> d = sample_durations(np.random.default_rng(0), 1000)
        >>> bool(d.min() >= 60 * 10**1.5 and d.max() <= 60 * 10**4)
        True
    """
    short = rng.random(n) < 0.8
    exponent = np.where(short, rng.uniform(1.5, 3.0, n), rng.uniform(3.0, 4.0, n))
    return np.asarray(60.0 * 10.0**exponent)


def sample_arrivals(rng: np.random.Generator, n: int, jobs_per_hour: float) -> np.ndarray:
    """Arrival times (s) of a Poisson process of ``jobs_per_hour``: the first job at 0, then exponential gaps of
    mean ``3600 / jobs_per_hour``; ``jobs_per_hour = 0``: every job at 0 (Gavel's static traces).

    Example:
        >>> sample_arrivals(np.random.default_rng(0), 3, 0).tolist()
        [0.0, 0.0, 0.0]
        >>> a = sample_arrivals(np.random.default_rng(0), 10_000, 60.0)
        >>> 55 < float(np.diff(a).mean()) < 65
        True
    """
    if not jobs_per_hour >= 0:
        raise InputError(f"jobs_per_hour is {jobs_per_hour}: give a rate >= 0 (0: every job arrives at once)")
    if jobs_per_hour == 0 or n == 0:
        return np.zeros(n)
    gaps = rng.exponential(3600.0 / jobs_per_hour, n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def sample_priorities(rng: np.random.Generator, n: int) -> np.ndarray:
    """Priority weights as Gavel draws them: 5 with probability 0.2, else 1.

    Example:
        >>> sorted(set(sample_priorities(np.random.default_rng(0), 100).tolist()))
        [1.0, 5.0]
    """
    return np.where(rng.random(n) <= 0.2, 5.0, 1.0)


def sample_slos(rng: np.random.Generator, n: int) -> np.ndarray:
    """SLOs as multiples of each job's duration, as Gavel draws them: 1.2 with probability 0.33, 2.0 with 0.34,
    10.0 with 0.33.

    Example:
        >>> sorted(set(sample_slos(np.random.default_rng(0), 100).tolist()))
        [1.2, 2.0, 10.0]
    """
    r = rng.random(n)
    return np.where(r < 0.33, 1.2, np.where(r < 0.67, 2.0, 10.0))


def sample_job_types(
    rng: np.random.Generator, scale_factors: np.ndarray, table: ThroughputTable, reference: str = "v100"
) -> list[str]:
    """A job type per job, uniform over the table's types that run on its scale factor on ``reference``.

    Gavel draws uniformly over its 26 types and redraws until a multi-device job gets a distributed type;
    drawing uniformly over those types is the same distribution, and it follows whatever table is given (a
    type is "distributed" at scale ``s`` when the table has it on ``s`` devices).

    Raises:
        ValueError: no type of the table runs on some scale factor asked for.

    Example:
        >>> t = ThroughputTable.from_dict({"v100": {"('A', 1)": {"null": 1.0}, "('A', 2)": {"null": 2.0},
        ...                                          "('B', 1)": {"null": 1.0}}})
        >>> sample_job_types(np.random.default_rng(0), np.array([2, 2, 2]), t)
        ['A', 'A', 'A']
    """
    if reference not in table.alone_rates:
        raise InputError(f"reference device type {reference!r} is not in {table.source} ({list(table.device_types)})")
    rates = table.alone_rates[reference]
    out = [""] * len(scale_factors)
    for scale in np.unique(scale_factors):
        candidates = [t for t in table.job_types if rates.get((t, int(scale)), 0.0) > 0]
        if not candidates:
            raise InputError(
                f"no job type of {table.source} runs on {scale} devices of {reference}: generate single-device "
                "jobs (multi_gpu=False) or use a table with multi-device throughputs"
            )
        where = np.flatnonzero(scale_factors == scale)
        for i, pick in zip(where, rng.integers(len(candidates), size=len(where)), strict=True):
            out[i] = candidates[pick]
    return out


def generate_jobs(
    count: int,
    *,
    jobs_per_hour: float,
    seed: int = 0,
    multi_gpu: bool = True,
    priorities: bool = False,
    slos: bool = False,
    table: ThroughputTable | None = None,
    reference: str = "v100",
) -> list[TraceJob]:
    """``count`` jobs as Gavel's generator makes them (``utils.generate_job``), arriving as a Poisson process.

    Each job gets a scale factor (:func:`sample_scale_factors`, or 1 without ``multi_gpu``), a type
    (:func:`sample_job_types`), a duration alone on ``reference`` (:func:`sample_durations`), and runs
    ``duration * throughput`` steps, its throughput on ``scale_factor`` devices of ``reference`` alone (cut to a
    whole number, as Gavel's traces store it). Each draw has its own random stream from ``seed``, so turning
    priorities or SLOs on leaves the rest of the trace as it was.

    Args:
        count: how many jobs.
        jobs_per_hour: the arrival rate (0: all arrive at 0, Gavel's static traces).
        seed: the random seed; the same seed gives the same jobs.
        multi_gpu: draw scale factors (else every job uses one device).
        priorities: draw priority weights (:func:`sample_priorities`), else 1.
        slos: draw SLOs (:func:`sample_slos`), else none.
        table: the throughputs (default: Gavel's published table, :meth:`ThroughputTable.load`).
        reference: the device type durations are measured on.

    Example:
        >>> t = ThroughputTable.from_dict({"v100": {"('A', 1)": {"null": 2.0}, "('B', 1)": {"null": 3.0}}})
        >>> jobs = generate_jobs(3, jobs_per_hour=6, seed=1, multi_gpu=False, slos=True, table=t)
        >>> [(j.job_type, j.scale_factor, j.slo, round(j.arrival_s)) for j in jobs]
        [('A', 1, 1.2, 0), ('B', 1, 1.2, 111), ('B', 1, 2.0, 260)]
        >>> jobs[0].total_steps == int(jobs[0].duration_s * 2.0)  # its duration at its throughput on v100
        True
    """
    if count < 0:
        raise InputError(f"count is {count}: give a number of jobs >= 0")
    table = ThroughputTable.load() if table is None else table
    types, scales, durations, arrivals, weights, deadlines = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(6)
    )
    scale_factors = sample_scale_factors(scales, count) if multi_gpu else np.ones(count, dtype=int)
    job_types = sample_job_types(types, scale_factors, table, reference)
    duration_s = sample_durations(durations, count)
    arrival_s = sample_arrivals(arrivals, count, jobs_per_hour)
    priority = sample_priorities(weights, count) if priorities else np.ones(count)
    slo = sample_slos(deadlines, count) if slos else np.full(count, np.nan)
    rates = table.alone_rates[reference]
    return [
        TraceJob(
            job_type=job_types[i],
            total_steps=max(1, int(duration_s[i] * rates[(job_types[i], int(scale_factors[i]))])),
            scale_factor=int(scale_factors[i]),
            arrival_s=float(arrival_s[i]),
            priority_weight=float(priority[i]),
            slo=None if np.isnan(slo[i]) else float(slo[i]),
            duration_s=float(duration_s[i]),
        )
        for i in range(count)
    ]
