"""The partitioning optimizer returns the optimum of its cost model (by brute force), within memory limits."""

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import chains

from conveyor.plan._memory import PLANNER_SCHEDULES, stage_bytes
from conveyor.plan._optimizer import PlanError, optimize
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology


@dataclass
class Memory:
    limit: float
    schedule: str
    microbatches: int


def _stage_time(p: Profile, i: int, j: int, r: int, bandwidth: float, per_update: int | None = None) -> float:
    """The physical model on one level, written out: compute shared by the replicas plus a blocking ring
    all-reduce per update; the stage's links carry what enters and leaves it, shared by its replicas."""
    into = p.cut_bytes(i - 1) if i > 0 else 0
    out = p.cut_bytes(j - 1) if j < len(p) else 0
    ring = 2 * (r - 1) * (p.param_bytes(i, j) / r) / bandwidth
    return max(p.compute_s(i, j) / r + ring / (per_update or r), (into + out) / (r * bandwidth))


def _fits(p: Profile, stages: list[tuple[int, int]], reps: tuple[int, ...], memory: Memory | None) -> bool:
    if memory is None:
        return True
    downstream = list(itertools.accumulate(reps[::-1]))[::-1]
    return all(
        stage_bytes(
            p, first=i, stop=j, schedule=memory.schedule, replicas=r, downstream=d, microbatches=memory.microbatches
        )
        <= memory.limit
        for (i, j), r, d in zip(stages, reps, downstream, strict=True)
    )


def _exhaustive(p: Profile, workers: int, bandwidth: float, straight: bool, memory: Memory | None = None) -> float:
    """Try every split into contiguous stages and every replica count per stage that uses every worker."""
    n, best = len(p), float("inf")
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            stages = list(itertools.pairwise(bounds))
            choices = [[1]] * len(stages) if straight else [range(1, workers + 1)] * len(stages)
            for reps in itertools.product(*choices):
                if sum(reps) != workers or not _fits(p, stages, reps, memory):
                    continue
                per_update = None if memory is None or memory.schedule == "pipedream" else memory.microbatches
                t = max(_stage_time(p, i, j, r, bandwidth, per_update) for (i, j), r in zip(stages, reps, strict=True))
                best = min(best, t)
    return best


profiles = chains(max_layers=6)


@settings(max_examples=150, deadline=None)
@given(profiles, st.integers(1, 5), st.floats(1e8, 1e11), st.booleans())
def test_optimum_of_the_cost_model(p: Profile, workers: int, bandwidth: float, straight: bool) -> None:
    expected = _exhaustive(p, workers, bandwidth, straight)
    topology = Topology.parse(f"{workers}:{bandwidth!r}")
    if expected == float("inf"):
        with pytest.raises(PlanError, match="no straight pipeline"):
            optimize(p, topology, straight=straight)
        return
    plan = optimize(p, topology, straight=straight)
    assert plan.seconds_per_minibatch == pytest.approx(expected)
    assert max(s.seconds_per_minibatch for s in plan.stages) == pytest.approx(plan.seconds_per_minibatch)
    assert plan.workers == workers
    assert plan.stages[0].first_layer == 0 and plan.stages[-1].last_layer == len(p) - 1
    assert all(a.last_layer + 1 == b.first_layer for a, b in itertools.pairwise(plan.stages))
    if straight:
        assert all(s.replicas == 1 for s in plan.stages)
    else:
        assert plan.seconds_per_minibatch <= plan.data_parallel_seconds * (1 + 1e-12)


@settings(max_examples=150, deadline=None)
@given(
    profiles,
    st.integers(1, 5),
    st.floats(1e8, 1e11),
    st.sampled_from(PLANNER_SCHEDULES),
    st.floats(1e8, 8e9),
    st.integers(1, 6),
)
def test_optimum_under_a_memory_limit(
    p: Profile, workers: int, bandwidth: float, schedule: str, limit: float, microbatches: int
) -> None:
    memory = Memory(limit, schedule, microbatches)
    expected = _exhaustive(p, workers, bandwidth, False, memory)
    topology = Topology.parse(f"{workers}:{bandwidth!r}")
    if expected == float("inf"):
        with pytest.raises(PlanError, match="the least that fits is about"):
            optimize(p, topology, schedule=schedule, memory=limit, microbatches=microbatches)
        return
    plan = optimize(p, topology, schedule=schedule, memory=limit, microbatches=microbatches)
    assert plan.seconds_per_minibatch == pytest.approx(expected)
    assert all(s.memory_bytes <= limit for s in plan.stages)


@settings(max_examples=60, deadline=None)
@given(profiles, st.integers(1, 3), st.integers(1, 3), st.sampled_from(PLANNER_SCHEDULES), st.floats(1e8, 8e9))
def test_hierarchical_plans_fit(p: Profile, inner: int, outer: int, schedule: str, limit: float) -> None:
    topology = Topology.parse(f"{inner}:1e10,{outer}:1e9")
    try:
        plan = optimize(p, topology, schedule=schedule, memory=limit)
    except PlanError:
        return
    assert all(s.memory_bytes <= limit for s in plan.stages) and plan.workers == inner * outer
    # The search adds an outer stage's whole all-reduce to its inner pipeline's slowest stage; each stage's own
    # figure charges it only its own weights, so none exceeds the plan's.
    assert max(s.seconds_per_minibatch for s in plan.stages) <= plan.seconds_per_minibatch * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(profiles, st.integers(1, 4), st.floats(1e8, 1e11), st.floats(1e8, 1e11))
def test_an_outer_level_of_one_unit_changes_nothing(p: Profile, inner: int, bw: float, outer_bw: float) -> None:
    flat = optimize(p, Topology.parse(f"{inner}:{bw!r}"))
    nested = optimize(p, Topology.parse(f"{inner}:{bw!r},1:{outer_bw!r}"))
    assert nested.seconds_per_minibatch == pytest.approx(flat.seconds_per_minibatch)
    assert nested.config == flat.config and nested.workers == inner


def test_fast_links_inside_slow_links_outside() -> None:
    # Two equal layers, heavy weights: across the slow level, replicating costs more than pipelining.
    p = Profile.chain(
        "two", forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], output_bytes=[1000, 1000], param_bytes=[10**9, 10**9]
    )
    plan = optimize(p, Topology.parse("2:1e12,2:1e8"))
    assert plan.config == "2-2"
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [(0, 0), (1, 1)]
    # Each stage: 2 s of compute over 2 replicas joined at 1 TB/s, plus a ring all-reduce of 1 GB per update
    # of 2 minibatches, 2 steps of 0.5 GB: 1 + 2 * 0.5e9 / 1e12 / 2 s per minibatch.
    assert plan.seconds_per_minibatch == pytest.approx(1.0005, rel=1e-9)


def test_straight_pipeline_with_more_workers_than_layers_is_reported() -> None:
    p = Profile.chain("two", forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], output_bytes=[1, 1], param_bytes=[1, 1])
    with pytest.raises(PlanError, match="use at most 2 workers"):
        optimize(p, Topology.parse("3:1e9"), straight=True)


def test_vgg16_memory_limit_changes_the_plan(pipedream_profiles: Path) -> None:
    """Stashing two minibatches of VGG-16's activations (the profile's batch of 64) on the 15-way stage
    takes about 29 GB; with 16 GB per worker the planner must choose another split."""
    vgg = Profile.load(pipedream_profiles / "vgg16")
    topology = Topology.parse("16:1.25e9")
    free = optimize(vgg, topology)
    assert max(s.memory_bytes for s in free.stages) > 16e9
    limited = optimize(vgg, topology, memory=16e9)
    assert max(s.memory_bytes for s in limited.stages) <= 16e9
    assert limited.seconds_per_minibatch > free.seconds_per_minibatch


def test_vgg16_that_fits_nowhere_says_how_much_would(pipedream_profiles: Path) -> None:
    vgg = Profile.load(pipedream_profiles / "vgg16")
    with pytest.raises(PlanError, match=r"fits in 4e\+09 bytes .* the least that fits is about 5\.\d+e\+09"):
        optimize(vgg, Topology.parse("16:1.25e9"), schedule="2bw", memory=4e9)


def test_unknown_schedule_is_reported() -> None:
    p = Profile.chain("one", forward_s=[1.0], backward_s=[1.0], output_bytes=[1], param_bytes=[1])
    with pytest.raises(PlanError, match="the planner knows schedules pipedream, 2bw, flush, gpipe, not 'zb'"):
        optimize(p, Topology.parse("1:1e9"), schedule="zb")
