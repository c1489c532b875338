"""The memory model's weight-version and stash counts are those of the schedules' action lists."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.plan._memory import PLANNER_SCHEDULES, in_flight, stage_bytes, weight_versions
from conveyor.plan._optimizer import step_microbatches
from conveyor.plan._profiles import Layer, Profile
from conveyor.schedule._schedule import make_schedule
from conveyor.schedule._simulate import simulate


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(PLANNER_SCHEDULES), st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(1, 8))
def test_counts_match_the_action_lists(schedule: str, replicas: list[int], at_least: int) -> None:
    microbatches = step_microbatches(schedule, replicas, at_least)
    if schedule == "pipedream":  # one microbatch per step; a run long enough to reach the steady state
        plan = make_schedule(schedule, len(replicas), 1, 3 * microbatches * sum(replicas), replicas)
    else:
        plan = make_schedule(schedule, len(replicas), microbatches, 3, replicas)
    stashed = simulate(plan, 1.0, 2.0).peak_stashed
    downstream = list(itertools.accumulate(replicas[::-1]))[::-1]
    for w in range(plan.workers):
        s = plan.worker_stage[w]
        assert plan.worker_peak_versions(w) == weight_versions(schedule, replicas[s], downstream[s])
        assert stashed[w] == in_flight(schedule, replicas[s], downstream[s], microbatches)


def test_stage_bytes_adds_versions_gradients_optimizer_and_stash() -> None:
    layers = (Layer("a", "", 0.0, 0.0, 7, 100, 30, 200), Layer("b", "", 0.0, 0.0, 7, 10, 3, 20))
    p = Profile("m", layers, ((0, 1),))
    # PipeDream, one replica, 3 workers from here on: 3 versions + 1 gradient of 110 B, 220 B of optimizer
    # state, 3 microbatches of 33 B saved.
    assert stage_bytes(p, 0, 2, "pipedream", 1, 3, 8) == 4 * 110 + 220 + 3 * 33
    assert stage_bytes(p, 0, 2, "gpipe", 2, 3, 8) == 2 * 110 + 220 + 4 * 33


def test_output_bytes_stand_in_when_saved_bytes_were_not_measured() -> None:
    p = Profile.chain("m", [0.0, 0.0], [0.0, 0.0], [5, 6], [0, 0])
    assert stage_bytes(p, 0, 2, "flush", 1, 1, 4) == 11


def test_unknown_schedule() -> None:
    with pytest.raises(ValueError, match="pipedream, 2bw, flush, gpipe"):
        in_flight("zero-bubble", 1, 1, 1)
