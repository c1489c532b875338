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
    table = _rate_table(jobs, rates, devices)
    run = _ClusterRun(
        jobs,
        table,
        devices=devices,
        policy=policy,
        round_s=round_s,
        prices=prices or {},
        pair_rates=pair_rates,
        restart_s=restart_s,
        reallocate_s=reallocate_s,
    )
    wanted = set(range(*window)) if window else set(range(len(jobs)))
    while any(run.records[i].finish_s is None for i in wanted) and run.now < max_s:
        run.admit()
        run.reallocate()
        run.play_round()
        if run.retire() and progress is not None:
            progress(run.finished, len(jobs))
    return run.result()


def _rate_table(jobs: Sequence[TraceJob], rates: Rates, devices: Devices) -> np.ndarray:
    """Every job's steps/s on each device type (jobs by device types), each job checked to run somewhere."""
    types = devices.types
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
    return table


class _ClusterRun:
    """:func:`simulate_cluster`'s state from round to round: the jobs in the cluster, their steps left, the
    allocation in force, and the totals so far."""

    def __init__(
        self,
        jobs: Sequence[TraceJob],
        table: np.ndarray,
        *,
        devices: Devices,
        policy: str,
        round_s: float,
        prices: dict[str, float],
        pair_rates: PairRates | None,
        restart_s: float | dict[str, float],
        reallocate_s: float,
    ) -> None:
        types = devices.types
        self.restart_by_type = restart_s if isinstance(restart_s, dict) else dict.fromkeys(types, restart_s)
        if missing := set(types) - set(self.restart_by_type):
            raise InputError(f"restart_s has no seconds for device types {sorted(missing)}: give one per type")
        self.jobs, self.table, self.devices, self.policy, self.pair_rates = jobs, table, devices, policy, pair_rates
        self.round_s, self.reallocate_s = round_s, reallocate_s
        self.price = np.array([prices.get(t, 0.0) for t in types])
        fastest = table.max(axis=1) if len(jobs) else np.zeros(0)
        self.records = [JobRecord(i, float(spec.arrival_s)) for i, spec in enumerate(jobs)]
        for i, spec in enumerate(jobs):
            if spec.slo is not None and spec.slo > 0:
                self.records[i].deadline_s = spec.arrival_s + spec.slo * spec.total_steps / fastest[i]
        self.remaining = np.array([float(spec.total_steps) for spec in jobs])
        self.order = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_s, i))
        self.mechanism = Rounds(devices, fill_idle=not policy.startswith("fifo"))
        self.active: list[int] = []  # the ids of the jobs in the cluster
        self.problem: Problem | None = None  # the policy's view of them; None once jobs went
        self.rounds_run, self.now, self.arrived, self.finished = 0, 0.0, 0, 0
        self.solves: list[float] = []
        self.notes: list[str] = []
        self.busy, self.cost = 0.0, 0.0
        self.allocated_at = 0.0
        self.allocated_for: tuple[int, ...] = ()  # the jobs the allocation in force was made for

    def admit(self) -> None:
        """The jobs that arrived by now join (with none in the cluster, time moves to the next arrival)."""
        jobs, order = self.jobs, self.order
        if not self.active and self.arrived < len(order):
            self.now = max(self.now, jobs[order[self.arrived]].arrival_s)
        changed = False
        while self.arrived < len(order) and jobs[order[self.arrived]].arrival_s <= self.now:
            self.active.append(order[self.arrived])
            self.arrived, changed = self.arrived + 1, True
        if self.problem is None or changed:  # jobs came (changed) or went (the problem was reset)
            self.problem = active_problem(
                self.active,
                jobs=jobs,
                table=self.table,
                remaining=self.remaining,
                records=self.records,
                now=self.now,
                devices=self.devices,
                price=self.price,
                pair_rates=self.pair_rates,
            )

    def reallocate(self) -> None:
        """A new allocation for the jobs now, if they changed and either ``reallocate_s`` has passed since the
        last or none of them holds one."""
        problem = self.problem
        assert problem is not None
        if problem.job_ids == self.allocated_for or (
            self.now - self.allocated_at < self.reallocate_s and set(self.allocated_for) & set(problem.job_ids)
        ):
            return
        self.allocated_for, self.allocated_at = problem.job_ids, self.now
        began = time.perf_counter()
        allocation = allocate(self.policy, problem)
        self.solves.append(time.perf_counter() - began)
        self.notes += [f"t={self.now:.0f}s: {note}" for note in allocation.notes]
        self.mechanism.set_allocation(problem, allocation)

    def play_round(self) -> None:
        """One round: the placed jobs run (the preempted ones counted), and time moves on by ``round_s``."""
        assert self.problem is not None
        placement = self.mechanism.next_round(self.problem)
        for combo in self.mechanism.previous:
            if not self.mechanism.kept(combo):
                for job in combo:
                    self.records[job].preemptions += int(self.remaining[job] > 0)
        ran: dict[Combo, float] = {
            combo: self._run(combo, placed[0].type, len(placed)) for combo, placed in placement.items()
        }
        self.mechanism.record(self.round_s, ran)
        self.now += self.round_s
        self.rounds_run += 1

    def _run(self, combo: Combo, device_type: str, held: int) -> float:
        """``combo``'s jobs for this round on ``held`` devices of ``device_type``: the seconds they held them."""
        jobs, records, remaining = self.jobs, self.records, self.remaining
        k = self.devices.types.index(device_type)
        speeds = _speeds(combo, k, jobs, self.table, self.pair_rates)
        restart = 0.0 if self.mechanism.kept(combo) else self.restart_by_type[device_type]
        longest = 0.0
        for job, speed in zip(combo, speeds, strict=True):
            records[job].start_s = self.now if records[job].start_s is None else records[job].start_s
            work_s = min(max(self.round_s - restart, 0.0), remaining[job] / speed)
            remaining[job] -= work_s * speed
            if remaining[job] <= 1e-9 * jobs[job].total_steps:
                remaining[job] = 0.0
                records[job].finish_s = self.now + restart + work_s
            longest = max(longest, restart + work_s)
        for job in combo:
            device_s = records[job].device_s
            device_s[device_type] = device_s.get(device_type, 0.0) + longest * held / len(combo)
        self.busy += longest * held
        self.cost += longest * held * self.price[k] / 3600
        return longest

    def retire(self) -> bool:
        """Whether jobs finished this round (they leave, and the policy's view is rebuilt at the next)."""
        done = [job for job in self.active if self.remaining[job] == 0.0]
        if done:
            self.active = [job for job in self.active if self.remaining[job] > 0.0]
            self.finished += len(done)
            self.problem = None
        return bool(done)

    def result(self) -> Simulation:
        end = max([self.now] + [r.finish_s for r in self.records if r.finish_s is not None])
        return Simulation(
            policy=self.policy,
            jobs=self.records,
            end_s=end,
            busy_device_s=self.busy,
            devices=self.devices.total,
            cost=self.cost,
            solves=self.solves,
            rounds=self.rounds_run,
            notes=self.notes,
        )


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
