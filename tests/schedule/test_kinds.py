"""Each schedule's record: its memory counts are what its action lists hold, its versions what they use."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.schedule import (
    KINDS,
    PLANNER_SCHEDULES,
    Op,
    kind,
    make_schedule,
    simulate,
    twobw_min_microbatches,
    warmup,
)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(PLANNER_SCHEDULES),
    st.lists(st.integers(1, 3), min_size=1, max_size=4),
    st.integers(1, 9),
)
def test_memory_counts_match_the_action_lists(name: str, replicas: list[int], microbatches: int) -> None:
    """Any layout and microbatch count, even ones that do not divide: on a run long enough for every
    replica to get its largest share, each worker's peak versions and stash are the record's counts."""
    record = kind(name)
    if name == "2bw":
        microbatches = max(microbatches, twobw_min_microbatches(replicas))
    schedule = make_schedule(name, len(replicas), microbatches, 3 * sum(replicas) + 3, replicas)
    stashed = simulate(schedule, 1.0, 2.0).peak_stashed
    downstream = list(itertools.accumulate(replicas[::-1]))[::-1]
    for w in range(schedule.workers):
        s = schedule.worker_stage[w]
        assert schedule.worker_peak_versions(w) == record.weight_versions(replicas[s], downstream[s]), w
        assert stashed[w] == record.in_flight(replicas[s], downstream[s], microbatches), w
        assert record.stashes(replicas, s) == (schedule.worker_peak_versions(w) > 1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(1, 4))
def test_vertical_sync_stashes_wherever_a_long_run_keeps_two_versions(replicas: list[int], m: int) -> None:
    schedule = make_schedule("pipedream-vs", len(replicas), m, 3 * sum(replicas) + 3, replicas)
    for w in range(schedule.workers):
        stashing = KINDS["pipedream-vs"].stashes(replicas, schedule.worker_stage[w])
        assert stashing == (schedule.worker_peak_versions(w) > 1), w


def test_versions_are_the_ones_the_action_lists_use() -> None:
    for name, replicas, m in [
        ("2bw", [1, 1, 1], 4),
        ("2bw", [2, 1], 3),
        ("pipedream-vs", [2, 1], 1),
        ("pipedream-vs", [1, 3, 2], 2),
        ("pipedream", [3, 1], 2),
    ]:
        record = KINDS[name]
        s = make_schedule(name, len(replicas), m, 6, replicas)
        for w in range(s.workers):
            stage = s.worker_stage[w]
            for k, v in s.forward_versions(w).items():
                pinned = record.version(stage, k, replicas, m)
                assert pinned is None or pinned == v, (name, replicas, w, k)


def test_updates_per_run() -> None:
    assert KINDS["pipedream"].updates(batches=5, microbatches=4, replicas=3) == 7  # rounds of 3 of 20 minibatches
    assert KINDS["2bw"].updates(batches=5, microbatches=4, replicas=3) == 5
    assert KINDS["pipedream"].update_of(7, microbatches=4, replicas=3) == 2
    assert KINDS["flush"].update_of(7, microbatches=4, replicas=3) == 1


def test_warmup_is_the_downstream_workers_shared_by_the_replicas() -> None:
    assert warmup(1, 4) == 4 and warmup(15, 16) == 2 and warmup(2, 3) == 2


def test_the_planner_plans_vertical_sync_as_pipedream() -> None:
    assert "pipedream-vs" not in PLANNER_SCHEDULES and KINDS["pipedream-vs"].plan_as == "pipedream"
    with pytest.raises(ValueError, match="no memory model for pipedream-vs: plan it as pipedream"):
        KINDS["pipedream-vs"].weight_versions(1, 2)


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of 2bw, flush, gpipe, pipedream, pipedream-vs"):
        kind("zigzag")


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["pipedream", "pipedream-vs", "2bw", "flush"]),
    st.lists(st.integers(1, 3), min_size=1, max_size=4),
    st.integers(1, 6),
)
def test_staleness_is_what_the_action_lists_do(name: str, replicas: list[int], microbatches: int) -> None:
    """Per stage, the most updates between the version a forward used and the step that applies its gradient
    (``W(t+1)`` from the gradient at ``W(t - d)``), over the stage's workers, is the record's staleness."""
    record = kind(name)
    if name == "2bw":
        microbatches = max(microbatches, twobw_min_microbatches(replicas))
    schedule = make_schedule(name, len(replicas), microbatches, 3 * sum(replicas) + 3, replicas)
    most = [0] * len(replicas)
    for w, actions in enumerate(schedule.actions):
        steps, used, pending, stale = 0, {}, [], [0]
        for a in actions:
            if a.op is Op.FORWARD:
                used[a.mb] = steps if a.version is None else a.version
            elif a.op is Op.BACKWARD:
                pending.append(used[a.mb])
            elif a.op is Op.STEP:
                stale += [steps - v for v in pending]
                pending, steps = [], steps + 1
        most[schedule.worker_stage[w]] = max(most[schedule.worker_stage[w]], *stale)
    assert most == [record.staleness(s, replicas) for s in range(len(replicas))]
