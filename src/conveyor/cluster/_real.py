"""Real mode: the scheduler's rounds drive real ``conveyor train`` jobs on emulated devices, through leases."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.cluster._backends import Backend, Launched
from conveyor.cluster._mechanism import ClusterDevice, Combo, Devices, Rounds
from conveyor.cluster._policies import allocate
from conveyor.cluster._problem import Problem
from conveyor.cluster._simulate import JobRecord, Simulation, active_problem
from conveyor.cluster._throughputs import OnlineThroughputs
from conveyor.cluster._trace import TraceJob
from conveyor.errors import InputError

__all__ = ["DeviceTypes", "Launch", "RealRun", "parse_device_types", "run_real"]


@dataclass(frozen=True)
class DeviceTypes:
    """Emulated device types: ``cores[type]`` CPU cores per device, ``counts[type]`` devices."""

    cores: dict[str, float]
    counts: dict[str, int]

    @property
    def devices(self) -> Devices:
        return Devices(dict(self.counts), per_server=max(self.counts.values()))


def parse_device_types(text: str) -> DeviceTypes:
    """Read ``fast=1.0:2,slow=0.25:2`` (type=cores per device:devices).

    Example:
        >>> parse_device_types("fast=1.0:2,slow=0.25:1")
        DeviceTypes(cores={'fast': 1.0, 'slow': 0.25}, counts={'fast': 2, 'slow': 1})
    """
    cores, counts = {}, {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, spec = part.partition("=")
        per, _, count = spec.partition(":")
        try:
            cores[name], counts[name] = float(per), int(count or 1)
        except ValueError:
            raise InputError(f"cannot read device type {part!r}: write TYPE=CORES:COUNT, e.g. fast=1.0:2") from None
        if not name or cores[name] <= 0 or counts[name] < 1:
            raise InputError(f"device type {part!r} needs a name, cores > 0 and a count >= 1, e.g. slow=0.25:2")
    if not cores:
        raise InputError("no device types given: write e.g. --devices fast=1.0:2,slow=0.25:2")
    return DeviceTypes(cores, counts)


@dataclass
class Launch:
    """One run of a job on some devices, from launch to exit."""

    job_id: int
    device_type: str
    devices: int
    folder: Path
    launched_at: float  # seconds since the run began
    handle: Launched
    planned_at: float = 0.0  # the start of the round it was launched for (it may wait for devices to be freed)
    ended_at: float | None = None
    exit_code: int | None = None

    def epochs(self) -> list[dict[str, Any]]:
        """The epochs this launch finished (its metrics.jsonl)."""
        path = self.folder / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@dataclass
class RealRun:
    """A finished real-mode run: the jobs' records (as the simulator's), every launch, the throughput estimates."""

    simulation: Simulation
    launches: list[Launch]
    estimates: OnlineThroughputs  # epochs/s per (job id, device type), as measured
    device_types: tuple[str, ...]

    def rates(self, job_id: int) -> np.ndarray:
        """Job ``job_id``'s measured epochs/s on each device type (scaled from another type where it never ran)."""
        return np.array([self.estimates.get(job_id, t) for t in self.device_types])

    def restart_s(self) -> dict[str, float]:
        """Mean seconds a launch on each device type spent not training (waiting for its devices' previous job
        to exit, starting, restoring, evaluating, the epoch a lease cut): from its round's start to its exit,
        less its epochs at the measured rate. By type, because a slower device also starts a job more slowly;
        a type no launch used gets the mean of all launches."""
        lost: dict[str, list[float]] = {t: [] for t in self.device_types}
        for launch in self.launches:
            if launch.ended_at is not None:
                training = len(launch.epochs()) / self.estimates.get(launch.job_id, launch.device_type)
                lost[launch.device_type].append(launch.ended_at - launch.planned_at - training)
        every = [x for xs in lost.values() for x in xs]
        return {t: float(np.mean(xs or every or [0.0])) for t, xs in lost.items()}


def run_real(
    jobs: Sequence[TraceJob],
    device_types: DeviceTypes,
    policy: str,
    backend: Backend,
    folder: Path,
    *,
    round_s: float = 60.0,
    prior: Callable[[TraceJob, str], float] | None = None,
    grace_s: float = 60.0,
    poll_s: float = 0.2,
    progress: Callable[[int, int], None] | None = None,
) -> RealRun:
    """Run ``jobs`` for real: each is ``command num_steps_arg REMAINING`` (a ``conveyor train`` command line,
    its steps being epochs) on the devices the rounds give it.

    Half way through each round the next round is planned (as Gavel does, so that leases are extended
    before they run out): a job placed again on the devices it holds gets its lease file extended to the
    next round's end and keeps running; the others' leases end with the round, so they checkpoint and exit
    by then (the scheduler waits for them, at most ``grace_s``, before giving their devices away). At the
    round's end the plan is made again, with the jobs that finished or arrived since (so an arrival waits for
    the next round's start, as in the simulator, not for the next half-way plan), and jobs placed on devices
    they do not hold, or whose leases were not extended, are launched there with ``--resume`` from their
    checkpoint, ``--workers`` their scale factor and ``--devices TYPE=CORES:SCALE``. Throughputs start from
    ``prior`` (default: proportional to a device's cores) and become each job's measured epochs per second
    as soon as it has run two epochs on a type, or that scaled by the priors' ratio on a type it has not run
    on (:class:`OnlineThroughputs`).
    """
    folder.mkdir(parents=True, exist_ok=True)
    run = _RealRounds(
        jobs, device_types, policy=policy, backend=backend, folder=folder, prior=prior, poll_s=poll_s, progress=progress
    )
    try:
        end = run.play(round_s=round_s, grace_s=grace_s)
    finally:
        for launch in run.running.values():
            backend.stop(launch.handle)
    busy = sum(sum(r.device_s.values()) for r in run.records)
    simulation = Simulation(
        policy=policy,
        jobs=run.records,
        end_s=end,
        busy_device_s=busy,
        devices=run.devices.total,
        cost=0.0,
        solves=run.solves,
        rounds=run.rounds,
        notes=run.notes,
    )
    return RealRun(simulation, run.launches, run.rates, run.devices.types)


class _RealRounds:
    """:func:`run_real`'s state: the jobs' records, the launches running and done, the throughputs measured, the
    allocation in force; seconds count from its creation."""

    def __init__(
        self,
        jobs: Sequence[TraceJob],
        device_types: DeviceTypes,
        *,
        policy: str,
        backend: Backend,
        folder: Path,
        prior: Callable[[TraceJob, str], float] | None,
        poll_s: float,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.jobs, self.device_types, self.policy = jobs, device_types, policy
        self.backend, self.folder = backend, folder
        self.poll_s, self.progress = poll_s, progress
        self.devices = device_types.devices
        types = self.devices.types
        self.records = [JobRecord(i, float(job.arrival_s)) for i, job in enumerate(jobs)]
        self.done = np.zeros(len(jobs))  # epochs finished by launches that exited
        self.rates = OnlineThroughputs(
            {(j, t): prior(jobs[j], t) if prior else device_types.cores[t] for j in range(len(jobs)) for t in types}
        )
        self.running: dict[int, Launch] = {}
        self.launches: list[Launch] = []
        self.mechanism = Rounds(self.devices, fill_idle=not policy.startswith("fifo"))
        self.notes: list[str] = []
        self.solves: list[float] = []
        self.order = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_s, i))
        self.start, self.start_unix = time.monotonic(), time.time()
        self.arrived, self.rounds = 0, 0
        self.planned_for: tuple[int, ...] = ()
        self.problem: Problem | None = None

    def clock(self) -> float:
        return time.monotonic() - self.start

    def lease(self, job: int, until: float) -> None:
        from conveyor.job import write_lease  # imports torch: only real runs need it

        (self.folder / f"job{job}").mkdir(parents=True, exist_ok=True)
        write_lease(self.folder / f"job{job}" / "lease.json", self.start_unix + until)

    def play(self, *, round_s: float, grace_s: float) -> float:
        """Rounds until every job has finished; the seconds they took."""
        round_start, placement = 0.0, self.plan()
        while any(r.finish_s is None for r in self.records):
            if not placement and not self.running:  # an empty cluster: wait for the next arrival
                waiting = [self.jobs[j].arrival_s for j in self.order[self.arrived :]]
                time.sleep(max(0.0, min(waiting) - self.clock()) if waiting else self.poll_s)
                round_start, placement = self.clock(), self.plan()
                continue
            self.launch(placement, round_start=round_start, until=round_start + round_s)
            self.rounds += 1
            placement = self.end_round(round_start, round_s=round_s, grace_s=grace_s)
            round_start += round_s
        return self.clock()

    def launch(self, placement: dict[Combo, tuple[ClusterDevice, ...]], *, round_start: float, until: float) -> None:
        """Lease every placed job its devices ``until``, and launch those not running (a job that finished after
        the placement was planned is left out)."""
        for combo, placed in placement.items():
            job = combo[0]
            if self.records[job].finish_s is not None:
                continue
            self.lease(job, until)
            if job not in self.running:
                launch = _launch(
                    self.jobs[job],
                    job_id=job,
                    remaining=self.jobs[job].total_steps - self.done[job],
                    device_type=placed[0].type,
                    count=len(placed),
                    device_types=self.device_types,
                    folder=self.folder,
                    backend=self.backend,
                    now=self.clock(),
                )
                launch.planned_at = round_start
                self.launches.append(launch)
                self.running[job] = launch
                record = self.records[job]
                record.start_s = launch.launched_at if record.start_s is None else record.start_s

    def end_round(
        self, round_start: float, *, round_s: float, grace_s: float
    ) -> dict[Combo, tuple[ClusterDevice, ...]]:
        """The round from its launches on: half way, the next round planned and the leases of the jobs it keeps
        extended; at its end, the plan made again with the jobs that finished or arrived since, and the jobs
        leaving their devices waited for (at most ``grace_s``, then stopped). The next round's placement."""
        self.reap(round_start + round_s / 2)
        self.mechanism.record(round_s)
        placement = self.plan()
        extended = {combo[0] for combo in placement if self.mechanism.kept(combo)}
        for job in extended:
            self.lease(job, round_start + 2 * round_s)  # before the current lease runs out
        end = round_start + round_s
        self.reap(end)
        # jobs that finished or arrived in the round's second half: plan again with them, as the simulator does at
        # each round's start (unchanged jobs give the same placement: the mechanism is deterministic)
        placement = self.plan(again=True)
        kept = {c[0] for c in placement if self.mechanism.kept(c) and c[0] in self.running and c[0] in extended}
        leaving = {job for job in self.running if job not in kept}
        for job in leaving:
            self.lease(job, end)
        self.reap(self.clock() + grace_s, leaving)
        for job in leaving & set(self.running):  # did not stop by its lease: stop it (its epoch in flight is lost)
            self.backend.stop(self.running[job].handle)
        self.reap(self.clock() + grace_s, leaving)
        return placement

    def reap(self, until: float, jobs_gone: set[int] | None = None) -> None:
        """Collect exits until ``until`` (devices a job freed early idle to then, as in the simulator), or until
        ``jobs_gone`` have all exited, or every job has finished."""
        while any(r.finish_s is None for r in self.records):
            for job, launch in list(self.running.items()):
                if (code := self.backend.poll(launch.handle)) is not None:
                    launch.exit_code, launch.ended_at = code, self.clock()
                    del self.running[job]
                    _account(launch, self.jobs[job], self.records[job], self.done, self.rates)
                    if self.records[job].finish_s is not None and self.progress is not None:
                        self.progress(sum(r.finish_s is not None for r in self.records), len(self.jobs))
            if self.clock() >= until or (jobs_gone is not None and not jobs_gone & set(self.running)):
                return
            time.sleep(self.poll_s)

    def plan(self, again: bool = False) -> dict[Combo, tuple[ClusterDevice, ...]]:
        """The next round's placement, from a new allocation where the jobs in the cluster changed."""
        now, jobs, order = self.clock(), self.jobs, self.order
        while self.arrived < len(order) and jobs[order[self.arrived]].arrival_s <= now:
            self.arrived += 1
        active = tuple(j for j in sorted(order[: self.arrived]) if self.records[j].finish_s is None)
        if active != self.planned_for or self.problem is None:  # jobs came or went: a new allocation
            types = self.devices.types
            table = np.array([[self.rates.get(j, t) for t in types] for j in range(len(jobs))])
            # a job whose last epoch is done but whose process has not exited yet still needs its devices
            running = [len(self.running[j].epochs()) if j in self.running else 0 for j in range(len(jobs))]
            remaining = np.array([max(job.total_steps - self.done[j] - running[j], 1.0) for j, job in enumerate(jobs)])
            self.problem = active_problem(
                active,
                jobs=jobs,
                table=table,
                remaining=remaining,
                records=self.records,
                now=now,
                devices=self.devices,
                price=np.ones(len(types)),
                pair_rates=None,
            )
            began = time.perf_counter()
            allocation = allocate(self.policy, self.problem)
            self.solves.append(time.perf_counter() - began)
            self.notes.extend(allocation.notes)
            self.mechanism.set_allocation(self.problem, allocation)
            self.planned_for = active
        return self.mechanism.next_round(self.problem, again) if active else {}


def _account(launch: Launch, job: TraceJob, record: JobRecord, done: np.ndarray, rates: OnlineThroughputs) -> None:
    """Book an exited launch: its device time, its epochs, its measured rate; a failure is an error."""
    assert launch.ended_at is not None
    record.device_s[launch.device_type] = (
        record.device_s.get(launch.device_type, 0.0) + (launch.ended_at - launch.launched_at) * launch.devices
    )
    epochs = launch.epochs()
    done[launch.job_id] += len(epochs)
    if len(epochs) > 1:  # the first epoch's time includes warm-up: rates from the ones after it
        rates.record(launch.job_id, launch.device_type, len(epochs) - 1, epochs[-1]["seconds"] - epochs[0]["seconds"])
    if launch.exit_code != 0:
        raise RuntimeError(
            f"job {launch.job_id} exited with status {launch.exit_code} on {launch.device_type}: "
            f"see {launch.folder / 'log.txt'}"
        )
    if done[launch.job_id] >= job.total_steps:
        record.finish_s = launch.ended_at
    else:  # its lease ran out: preempted, to resume from its checkpoint
        record.preemptions += 1


def _launch(
    job: TraceJob,
    *,
    job_id: int,
    remaining: float,
    device_type: str,
    count: int,
    device_types: DeviceTypes,
    folder: Path,
    backend: Backend,
    now: float,
) -> Launch:
    """Start ``job`` on ``count`` devices of ``device_type`` for its ``remaining`` epochs, resuming if it ran
    before."""
    home = folder / f"job{job_id}"
    run = home / f"launch-{len(list(home.glob('launch-*')))}"
    checkpoint = home / "checkpoint.pt"
    argv = [
        *shlex.split(job.command),
        job.num_steps_arg,
        str(int(remaining)),
        "--workers",
        str(count),
        "--devices",
        f"{device_type}={device_types.cores[device_type]}:{count}",
        "--run-dir",
        str(run),
        "--checkpoint",
        str(checkpoint),
        "--lease",
        str(home / "lease.json"),
    ]
    if checkpoint.exists():
        argv += ["--resume", str(checkpoint)]
    if argv[0] == "conveyor":  # this interpreter's conveyor, whatever PATH says
        argv = [sys.executable, "-m", "conveyor.cli", *argv[1:]]
    run.mkdir(parents=True)
    handle = backend.launch(f"job{job_id}", argv, device_type=device_type, devices=count, log=run / "log.txt")
    return Launch(job_id, device_type, count, run, now, handle)
