"""The simulator: hand-computed completion times, restarts, metrics, bad input, aware against agnostic."""

from __future__ import annotations

import numpy as np
import pytest

from conveyor.cluster import Devices, TraceJob, simulate_cluster


def _job(steps: float, arrival: float = 0.0, scale: int = 1, job_type: str = "a", slo: float | None = None):
    return TraceJob(job_type, total_steps=int(steps), scale_factor=scale, arrival_s=arrival, slo=slo)


def test_one_job_finishes_mid_round_at_its_rate() -> None:
    sim = simulate_cluster([_job(1000)], lambda job: np.array([2.0]), Devices({"v100": 1}), "max_min_fairness_perf")
    record = sim.jobs[0]
    assert record.finish_s == pytest.approx(500.0) and record.jct_s == pytest.approx(500.0)
    assert sim.rounds == 2 and sim.utilization == pytest.approx(500 / 720)
    assert record.device_s == {"v100": pytest.approx(500.0)}


def test_two_jobs_take_turns_on_one_device() -> None:
    # Each needs two rounds alone; LAS alternates them: A runs rounds 1 and 3, B rounds 2 and 4.
    jobs = [_job(720), _job(720)]
    sim = simulate_cluster(jobs, lambda job: np.array([1.0]), Devices({"v100": 1}), "max_min_fairness", round_s=360)
    assert sorted(r.finish_s for r in sim.jobs) == [pytest.approx(3 * 360), pytest.approx(4 * 360)]
    assert sim.average_jct_s() == pytest.approx(3.5 * 360)
    assert sim.makespan_s == pytest.approx(4 * 360)
    assert sim.utilization == pytest.approx(1.0)
    assert sum(r.preemptions for r in sim.jobs) >= 2


def test_a_moved_job_pays_its_restart() -> None:
    jobs = [_job(720), _job(720)]
    plain = simulate_cluster(jobs, lambda job: np.array([1.0]), Devices({"v100": 1}), "max_min_fairness")
    paying = simulate_cluster(jobs, lambda job: np.array([1.0]), Devices({"v100": 1}), "max_min_fairness", restart_s=60)
    assert paying.average_jct_s() > plain.average_jct_s()
    # Every round starts the job that did not hold the device the round before: 60 s lost in each, so each
    # job does 300 s of work per turn and needs a third turn (A: rounds 1, 3, 5; B: 2, 4, 6).
    assert [r.finish_s for r in plain.jobs] == [pytest.approx(1080.0), pytest.approx(1440.0)]
    assert [r.finish_s for r in paying.jobs] == [pytest.approx(4 * 360 + 180), pytest.approx(5 * 360 + 180)]


def test_the_restart_cost_can_depend_on_the_device_type() -> None:
    # One job that runs only on the slow type: 720 s of work at 1 step/s; a restart of 60 s on "slow" costs
    # the first round 60 s, so it finishes at 780 s; a restart charged on "fast" only does not touch it.
    jobs, cluster = [_job(720)], Devices({"fast": 1, "slow": 1})
    slow_only = lambda job: np.array([0.0, 1.0])  # noqa: E731
    on_slow = simulate_cluster(jobs, slow_only, cluster, "max_min_fairness_perf", restart_s={"fast": 0.0, "slow": 60.0})
    on_fast = simulate_cluster(jobs, slow_only, cluster, "max_min_fairness_perf", restart_s={"fast": 60.0, "slow": 0.0})
    assert on_slow.jobs[0].finish_s == pytest.approx(780.0) and on_fast.jobs[0].finish_s == pytest.approx(720.0)
    with pytest.raises(ValueError, match=r"no seconds for device types \['slow'\]"):
        simulate_cluster(jobs, slow_only, cluster, "max_min_fairness_perf", restart_s={"fast": 1.0})


def test_late_arrivals_and_a_window() -> None:
    jobs = [_job(360), _job(360, arrival=10_000.0)]
    sim = simulate_cluster(jobs, lambda job: np.array([1.0]), Devices({"v100": 1}), "fifo")
    assert sim.jobs[1].start_s == pytest.approx(10_000.0) and sim.jobs[1].jct_s == pytest.approx(360.0)
    assert sim.average_jct_s((1, 2)) == pytest.approx(360.0)


def test_prices_give_the_cost() -> None:
    sim = simulate_cluster(
        [_job(3600, scale=2)], lambda job: np.array([1.0]), Devices({"v100": 2}), "fifo", prices={"v100": 3.0}
    )
    assert sim.cost == pytest.approx(2 * 3.0)  # two devices for an hour


def test_slo_violations_are_counted() -> None:
    # Two jobs of one round each, both due within 1.2x their duration: one of them must be late.
    jobs = [_job(360, slo=1.2), _job(360, slo=1.2)]
    sim = simulate_cluster(jobs, lambda job: np.array([1.0]), Devices({"v100": 1}), "fifo")
    assert sim.slo_violations == 1


def test_heterogeneity_awareness_shortens_completion_times() -> None:
    # Job type "a" is 10x faster on v100, "b" barely cares: aware LAS gives v100 to the "a" jobs.
    speeds = {"a": np.array([10.0, 1.0]), "b": np.array([1.2, 1.0])}
    jobs = [
        _job(20_000, job_type="a"),
        _job(2_000, job_type="b"),
        _job(20_000, job_type="a"),
        _job(2_000, job_type="b"),
    ]
    devices = Devices({"v100": 1, "k80": 1})
    agnostic = simulate_cluster(jobs, lambda job: speeds[job.job_type], devices, "max_min_fairness")
    aware = simulate_cluster(jobs, lambda job: speeds[job.job_type], devices, "max_min_fairness_perf")
    assert aware.average_jct_s() < agnostic.average_jct_s()


def test_bad_input_fails_in_one_line() -> None:
    with pytest.raises(ValueError, match="needs 4 devices"):
        simulate_cluster([_job(10, scale=4)], lambda job: np.array([1.0]), Devices({"v100": 2}), "fifo")
    with pytest.raises(ValueError, match="cannot run on any device type"):
        simulate_cluster([_job(10)], lambda job: np.array([0.0]), Devices({"v100": 2}), "fifo")
    with pytest.raises(ValueError, match="unknown policy"):
        simulate_cluster([_job(10)], lambda job: np.array([1.0]), Devices({"v100": 2}), "no-such-policy")
