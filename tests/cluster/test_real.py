"""Real mode: the scheduler runs real ``conveyor train`` jobs on emulated devices, preempting through leases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from emulation import needs_root

from conveyor.cluster import LocalBackend, TraceJob, parse_device_types, run_real

pytestmark = [needs_root, pytest.mark.timeout(300)]

COMMAND = "conveyor train --model mlp --batch-size 64"


def _job(epochs: int, arrival: float = 0.0, command: str = COMMAND) -> TraceJob:
    return TraceJob(
        "mlp", total_steps=epochs, scale_factor=1, arrival_s=arrival, command=command, num_steps_arg="--epochs"
    )


def _epochs(folder: Path, job: int) -> int:
    return sum(len(p.read_text().splitlines()) for p in (folder / f"job{job}").glob("launch-*/metrics.jsonl"))


def test_two_jobs_on_two_emulated_devices(tmp_path: Path) -> None:
    jobs = [_job(2), _job(1, arrival=2.0)]
    with LocalBackend() as backend:
        run = run_real(
            jobs, parse_device_types("fast=1.0:1,slow=0.5:1"), "max_min_fairness_perf", backend, tmp_path, round_s=20.0
        )
    for i, record in enumerate(run.simulation.jobs):
        assert record.finish_s is not None and record.jct_s > 0
        assert _epochs(tmp_path, i) == jobs[i].total_steps  # every epoch run exactly once
        assert (tmp_path / f"job{i}" / "checkpoint.pt").exists()
    assert run.simulation.jobs[1].start_s >= 2.0  # not before it arrived
    assert {launch.device_type for launch in run.launches} <= {"fast", "slow"}
    assert all(launch.exit_code == 0 for launch in run.launches)
    assert (run.rates(0) > 0).all()
    # A launch's start-up, restore and exit: some seconds, and a part of a launch's time (however fast the machine).
    restarts = run.restart_s()
    longest = max(launch.ended_at - launch.planned_at for launch in run.launches if launch.ended_at is not None)
    assert set(restarts) == {"fast", "slow"} and all(0 < s <= longest for s in restarts.values())
    assert all(launch.launched_at >= launch.planned_at for launch in run.launches)


def test_a_preempted_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    # Two jobs of 2 epochs, one device, rounds of 1 s: shorter than any launch's start-up, so a launch's lease has
    # ended by its first epoch's end and it stops there, saving its checkpoint (a job runs at least one epoch
    # under a lease). The preemption follows the job's progress, its first checkpoint, on any machine: each job
    # needs several launches, every launch after its first resumes from the checkpoint, and no epoch is run twice
    # or lost.
    jobs = [_job(2), _job(2)]
    with LocalBackend() as backend:
        run = run_real(jobs, parse_device_types("only=1.0:1"), "max_min_fairness", backend, tmp_path, round_s=1.0)
    later = [launch for launch in run.launches if launch.folder.name != "launch-0"]
    assert later, "no job was preempted and relaunched"
    for launch in later:
        summary = json.loads((launch.folder / "summary.json").read_text())
        assert summary["epochs_before"] > 0
    for i in range(2):
        assert _epochs(tmp_path, i) == 2
        assert run.simulation.jobs[i].finish_s is not None
