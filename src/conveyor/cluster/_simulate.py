"""The cluster simulator: jobs arrive, a policy allocates, rounds run them, and the metrics Gavel reports."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from conveyor.cluster._mechanism import Combo, Devices, Rounds
from conveyor.cluster._policies import allocate
from conveyor.cluster._problem import Problem
from conveyor.cluster._trace import TraceJob
from conveyor.errors import InputError

__all__ = ["JobRecord", "Simulation", "simulate_cluster"]

ROUND_S = 360.0  # Gavel's default round: 6 minutes


Rates = Callable[[TraceJob], np.ndarray]  # a job's steps/s on each device type (0: cannot run there)
PairRates = Callable[[TraceJob, TraceJob], "np.ndarray | None"]  # (types, 2) steps/s of two jobs sharing devices


@dataclass
class JobRecord:
    """One job's fate: when it arrived, first ran, finished, and the device time it used."""

    job_id: int
    arrival_s: float
    start_s: float | None = None
    finish_s: float | None = None
    deadline_s: float = float("inf")
    device_s: dict[str, float] = field(default_factory=dict)  # device-seconds held, per type
    preemptions: int = 0  # times it lost its devices while unfinished

    @property
    def jct_s(self) -> float:
        return float("inf") if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass
class Simulation:
    """A finished simulation: every job's record and the cluster's totals."""

    policy: str
    jobs: list[JobRecord]
    end_s: float
    busy_device_s: float
    devices: int
    cost: float
    solves: list[float]  # seconds each allocation took to compute
    rounds: int
    notes: list[str]

    def average_jct_s(self, window: tuple[int, int] | None = None) -> float:
        """Mean completion time of the jobs with ids in ``[start, end)`` (all jobs by default); ``inf`` if
        one of them did not finish."""
        picked = [r for r in self.jobs if window is None or window[0] <= r.job_id < window[1]]
        return float(np.mean([r.jct_s for r in picked])) if picked else float("nan")

    @property
    def makespan_s(self) -> float:
        return max((r.finish_s for r in self.jobs if r.finish_s is not None), default=0.0) - min(
            (r.arrival_s for r in self.jobs), default=0.0
        )

    @property
    def utilization(self) -> float:
        """Busy device-time over all device-time from the first arrival to the end."""
        span = self.end_s - min((r.arrival_s for r in self.jobs), default=0.0)
        return self.busy_device_s / (self.devices * span) if span > 0 else 0.0

    @property
    def slo_violations(self) -> int:
        return sum(1 for r in self.jobs if r.deadline_s < float("inf") and (r.finish_s or np.inf) > r.deadline_s)


def simulate_cluster(
    jobs: Sequence[TraceJob],
    rates: Rates,
    devices: Devices,
    policy: str,
    *,
    round_s: float = ROUND_S,
    prices: dict[str, float] | None = None,
    pair_rates: PairRates | None = None,
    restart_s: float | dict[str, float] = 0.0,
    window: tuple[int, int] | None = None,
    max_s: float = float("inf"),
    reallocate_s: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
) -> Simulation:
    """Run ``jobs`` (ids = their index) on ``devices`` under ``policy`` in rounds of ``round_s``.

    At each round's start the jobs that arrived join; when the set of jobs changed, the policy computes a new
    allocation from the jobs' throughputs, remaining steps, waiting times and deadlines. :class:`Rounds` picks
    the round's jobs and devices; a job runs at its throughput on its devices' type (or its co-located
    throughput when sharing), losing ``restart_s`` (seconds, or seconds by device type: a slow device also
    starts a job slowly) whenever it starts on devices it did not hold the round
    before (a checkpoint restore), and finishes mid-round when its steps run out (its devices then idle to
    the round's end, as in Gavel). A job's deadline is ``arrival + slo * duration``, its duration being its
    steps at its fastest type. ``reallocate_s``: the policy runs again at most this often (Gavel's simulator
    waits 1920 s between allocations, so arrivals wait for the next one; 0: whenever jobs come or go;
    an allocation is always made when no job in the cluster has one). The run stops once every job (or
    every job of ``window``) has finished, or at ``max_s`` (unfinished jobs then count as infinite
    completion times).

    Example:
        >>> jobs = [TraceJob("a", total_steps=720, scale_factor=1, arrival_s=0.0)]
        >>> fast_and_slow = Devices({"fast": 1, "slow": 1})
        >>> sim = simulate_cluster(jobs, lambda job: np.array([2.0, 1.0]), fast_and_slow, "max_min_fairness_perf")
        >>> sim.jobs[0].finish_s, sim.rounds  # 720 steps at 2 steps/s on the fast device: one round
        (360.0, 1)
    """
    types = devices.types
    prices = prices or {}
    price = np.array([prices.get(t, 0.0) for t in types])
    table = np.array([rates(spec) for spec in jobs]).reshape(len(jobs), len(types))
    if len(jobs) and (bad := np.flatnonzero((table <= 0).all(axis=1) | np.isnan(table).any(axis=1))).size:
        raise InputError(
            f"job {int(bad[0])} ({jobs[int(bad[0])].job_type}) cannot run on any device type of "
            f"the cluster: give it a throughput on one of {', '.join(types)}"
        )
    for i, spec in enumerate(jobs):
        if not any(spec.scale_factor <= devices.counts[t] and table[i, k] > 0 for k, t in enumerate(types)):
            raise InputError(
                f"job {i} needs {spec.scale_factor} devices of one type but the cluster has "
                f"{devices.counts}: remove it or add devices"
            )
    fastest = table.max(axis=1) if len(jobs) else np.zeros(0)
    restart_by_type = restart_s if isinstance(restart_s, dict) else dict.fromkeys(types, restart_s)
    if missing := set(types) - set(restart_by_type):
        raise InputError(f"restart_s has no seconds for device types {sorted(missing)}: give one per type")
    records = [JobRecord(i, float(spec.arrival_s)) for i, spec in enumerate(jobs)]
    for i, spec in enumerate(jobs):
        if spec.slo is not None and spec.slo > 0:
            records[i].deadline_s = spec.arrival_s + spec.slo * spec.total_steps / fastest[i]
    remaining = np.array([float(spec.total_steps) for spec in jobs])
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_s, i))
    rounds_run, now, arrived = 0, 0.0, 0
    active: list[int] = []  # the ids of the jobs in the cluster
    mechanism = Rounds(devices, fill_idle=not policy.startswith("fifo"))
    problem: Problem | None = None
    solves: list[float] = []
    notes: list[str] = []
    busy, cost = 0.0, 0.0
    wanted = set(range(*window)) if window else set(range(len(jobs)))
    finished, allocated_at = 0, 0.0
    allocated_for: tuple[int, ...] = ()
    while any(records[i].finish_s is None for i in wanted) and now < max_s:
        if not active and arrived < len(order):
            now = max(now, jobs[order[arrived]].arrival_s)
        changed = False
        while arrived < len(order) and jobs[order[arrived]].arrival_s <= now:
            active.append(order[arrived])
            arrived, changed = arrived + 1, True
        if problem is None or changed:  # jobs came (changed) or went (problem reset below)
            problem = active_problem(
                active,
                jobs=jobs,
                table=table,
                remaining=remaining,
                records=records,
                now=now,
                devices=devices,
                price=price,
                pair_rates=pair_rates,
            )
        if problem.job_ids != allocated_for and (
            now - allocated_at >= reallocate_s or not set(allocated_for) & set(problem.job_ids)
        ):
            allocated_for, allocated_at = problem.job_ids, now
            began = time.perf_counter()
            allocation = allocate(policy, problem)
            solves.append(time.perf_counter() - began)
            notes += [f"t={now:.0f}s: {note}" for note in allocation.notes]
            mechanism.set_allocation(problem, allocation)
        placement = mechanism.next_round(problem)
        ran: dict[Combo, float] = {}
        for combo in mechanism.previous:
            if not mechanism.kept(combo):
                for job in combo:
                    records[job].preemptions += int(remaining[job] > 0)
        for combo, placed in placement.items():
            k = types.index(placed[0].type)
            speeds = _speeds(combo, k, jobs, table, pair_rates)
            restart = 0.0 if mechanism.kept(combo) else restart_by_type[placed[0].type]
            longest = 0.0
            for job, speed in zip(combo, speeds, strict=True):
                records[job].start_s = now if records[job].start_s is None else records[job].start_s
                work_s = min(max(round_s - restart, 0.0), remaining[job] / speed)
                remaining[job] -= work_s * speed
                if remaining[job] <= 1e-9 * jobs[job].total_steps:
                    remaining[job] = 0.0
                    records[job].finish_s = now + restart + work_s
                longest = max(longest, restart + work_s)
            ran[combo] = longest
            for job in combo:
                records[job].device_s[placed[0].type] = records[job].device_s.get(placed[0].type, 0.0) + (
                    longest * len(placed) / len(combo)
                )
            busy += longest * len(placed)
            cost += longest * len(placed) * price[k] / 3600
        mechanism.record(round_s, ran)
        now += round_s
        rounds_run += 1
        done = [job for job in active if remaining[job] == 0.0]
        if done:
            active = [job for job in active if remaining[job] > 0.0]
            finished += len(done)
            problem = None
            if progress is not None:
                progress(finished, len(jobs))
    end = max([now] + [r.finish_s for r in records if r.finish_s is not None])
    return Simulation(policy, records, end, busy, devices.total, cost, solves, rounds_run, notes)


def active_problem(
    active: Sequence[int],
    *,
    jobs: Sequence[TraceJob],
    table: np.ndarray,
    remaining: np.ndarray,
    records: list[JobRecord],
    now: float,
    devices: Devices,
    price: np.ndarray,
    pair_rates: PairRates | None,
) -> Problem:
    """The policy's view now of the jobs ``active`` (ids into ``jobs`` and every per-job array): their
    throughputs (rows of ``table``), remaining steps, waiting times, deadlines; pairs that may share devices."""
    pairs: dict[tuple[int, int], np.ndarray] = {}
    if pair_rates is not None:
        for a in range(len(active)):
            for b in range(a + 1, len(active)):
                ja, jb = jobs[active[a]], jobs[active[b]]
                if ja.scale_factor == jb.scale_factor and (both := pair_rates(ja, jb)) is not None:
                    pairs[(a, b)] = both
    return Problem(
        job_ids=tuple(active),
        device_types=devices.types,
        throughputs=table[list(active)],
        scale_factors=[jobs[j].scale_factor for j in active],
        capacity=[devices.counts[t] for t in devices.types],
        weights=[jobs[j].priority_weight for j in active],
        remaining_steps=remaining[list(active)],
        elapsed_s=[now - records[j].arrival_s for j in active],
        deadline_s=[max(records[j].deadline_s - now, 1.0) for j in active],
        prices=price,
        arrival_s=[records[j].arrival_s for j in active],
        pair_throughputs=pairs,
    )


def _speeds(
    combo: Combo, k: int, jobs: Sequence[TraceJob], table: np.ndarray, pair_rates: PairRates | None
) -> list[float]:
    if len(combo) == 1:
        return [float(table[combo[0], k])]
    assert pair_rates is not None
    both = pair_rates(jobs[combo[0]], jobs[combo[1]])
    assert both is not None
    return [float(both[k, 0]), float(both[k, 1])]
