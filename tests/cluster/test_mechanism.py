"""The round-based mechanism: realised time shares converge to X, leases, placement, capacity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cluster import Allocation, Devices, Problem, Rounds


def _problem(jobs: int, types: tuple[str, ...], scale: list[int] | None = None, capacity: list[int] | None = None):
    return Problem(
        tuple(range(100, 100 + jobs)),
        types,
        np.ones((jobs, len(types))),
        scale or [1] * jobs,
        capacity or [1] * len(types),
    )


def _shares(rounds: Rounds, problem: Problem, count: int) -> np.ndarray:
    """Fraction of rounds each job ran on each type."""
    ran = np.zeros((problem.jobs, len(problem.device_types)))
    for _ in range(count):
        for combo, devices in rounds.next_round(problem).items():
            ran[problem.job_ids.index(combo[0]), problem.device_types.index(devices[0].type)] += 1
        rounds.record(1.0)
    return ran / count


def test_time_shares_converge_to_the_allocation() -> None:
    # Three jobs on one fast and one slow device: every device busy, shares unequal.
    problem = _problem(3, ("fast", "slow"))
    x = np.array([[0.5, 0.25], [0.25, 0.5], [0.25, 0.25]])
    rounds = Rounds(Devices({"fast": 1, "slow": 1}))
    rounds.set_allocation(problem, Allocation.singles(x))
    np.testing.assert_allclose(_shares(rounds, problem, 400), x, atol=0.02)


def test_multi_device_jobs_converge_too() -> None:
    # A 2-device job and two 1-device jobs on 2 devices of one type: the 2-device job half the time.
    problem = _problem(3, ("v100",), scale=[2, 1, 1], capacity=[2])
    x = np.array([[0.5], [0.5], [0.5]])
    rounds = Rounds(Devices({"v100": 2}))
    rounds.set_allocation(problem, Allocation.singles(x))
    np.testing.assert_allclose(_shares(rounds, problem, 200), x, atol=0.02)


def test_a_job_keeping_its_type_keeps_its_devices() -> None:
    problem = _problem(2, ("v100",), capacity=[4])
    rounds = Rounds(Devices({"v100": 4}))
    rounds.set_allocation(problem, Allocation.singles(np.array([[1.0], [1.0]])))
    first = rounds.next_round(problem)
    rounds.record(1.0)
    assert rounds.next_round(problem) == first
    assert all(rounds.kept(combo) for combo in first)


def test_placement_keeps_a_multi_device_job_on_one_server() -> None:
    # Two servers of 4; a 4-device job and four 1-device jobs: the big one gets a whole server.
    problem = _problem(5, ("v100",), scale=[1, 1, 1, 1, 4], capacity=[8])
    rounds = Rounds(Devices({"v100": 8}, per_server=4))
    rounds.set_allocation(problem, Allocation.singles(np.ones((5, 1))))
    placement = rounds.next_round(problem)
    assert len(placement) == 5
    assert len({d.server for d in placement[(104,)]}) == 1


def test_a_finished_job_is_skipped() -> None:
    problem = _problem(2, ("v100",))
    rounds = Rounds(Devices({"v100": 1}))
    rounds.set_allocation(problem, Allocation.singles(np.array([[0.5], [0.5]])))
    smaller = Problem((101,), ("v100",), [[1.0]], [1], [1])
    assert list(rounds.next_round(smaller)) == [(101,)]


def test_device_types_must_match() -> None:
    rounds = Rounds(Devices({"v100": 1}))
    with pytest.raises(ValueError, match="device types"):
        rounds.set_allocation(_problem(1, ("k80",)), Allocation.singles(np.ones((1, 1))))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([1, 1, 1, 2, 4]), min_size=1, max_size=10), st.integers(0, 2**31 - 1))
def test_rounds_never_exceed_capacity_or_run_a_job_twice(scales: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    types = ("a", "b")
    capacity = [4, 2]
    problem = Problem(tuple(range(len(scales))), types, rng.uniform(0, 2, (len(scales), 2)), scales, capacity)
    x = rng.uniform(0, 1, (len(scales), 2)) * (problem.throughputs > 0)
    rounds = Rounds(Devices(dict(zip(types, capacity, strict=True)), per_server=2))
    rounds.set_allocation(problem, Allocation.singles(x))
    for _ in range(5):
        placement = rounds.next_round(problem)
        rounds.record(1.0)
        devices = [d for placed in placement.values() for d in placed]
        assert len(devices) == len(set(devices))  # no device twice
        for combo, placed in placement.items():
            assert len(placed) == scales[combo[0]] and len({d.type for d in placed}) == 1
            assert problem.throughputs[combo[0], types.index(placed[0].type)] > 0
