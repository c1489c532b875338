"""Plan files: the simulator's predictions agree with the planner's steady state, and files read back."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import chains

from conveyor.plan import PlanFileError, predict
from conveyor.plan._memory import PLANNER_SCHEDULES
from conveyor.plan._optimizer import PlanError, optimize
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology
from conveyor.plan.parts import plan_file, read_plan_file

profiles = chains(max_layers=5)


@settings(max_examples=40, deadline=None)
@given(profiles, st.integers(1, 4), st.floats(1e8, 1e11), st.sampled_from(["pipedream", "2bw"]), st.booleans())
def test_long_asynchronous_runs_approach_the_planners_steady_state(
    p: Profile, workers: int, bandwidth: float, schedule: str, straight: bool
) -> None:
    """The simulator runs the plan's action lists; the planner's one minibatch per slowest stage or link
    bounds it, and a straight pipeline with negligible transfers reaches it once fill and drain fade out.
    (Transfers lengthen 1F1B's round trip, which the steady state does not see: the first stage admits one
    minibatch per stage, and each comes back after every stage's compute plus every hop both ways.
    Replicas of a stage meet at every all-reduce while the next stage serves them in turn. See the tests
    below.)"""
    topology = Topology.parse(f"{workers}:{bandwidth!r}")
    try:
        plan = optimize(p, topology, straight, schedule=schedule)
    except PlanError:
        return  # more workers than layers for a straight pipeline
    sim = predict(plan, p, topology, minibatches=400 * workers)
    steady = 1 / plan.seconds_per_minibatch
    assert sim.samples_per_s <= steady * (1 + 1e-9)
    hops = sum(2 * p.cut_bytes(st.last_layer) / bandwidth for st in plan.stages[:-1])
    if (straight or len(plan.stages) == 1) and hops <= 0.01 * plan.seconds_per_minibatch:
        assert sim.samples_per_s >= steady * 0.95


def test_replicas_wait_for_each_other_at_the_all_reduce() -> None:
    """2-1-1: the two first-stage replicas finish their backwards a second apart (the next stage serves
    them in turn) and every update waits for both; the simulator shows the 2/3 the steady state misses."""
    p = Profile.chain(
        "r",
        forward_s=[1.0, 0.5, 0.5],
        backward_s=[1.0, 0.5, 0.5],
        output_bytes=[0, 0, 0],
        param_bytes=[0, 75_000_001, 25_000_000],
    )
    topology = Topology.parse("4:1e8")
    plan = optimize(p, topology)
    assert plan.config == "2-1-1" and plan.seconds_per_minibatch == pytest.approx(1.0)
    assert predict(plan, p, topology, minibatches=1600).samples_per_s == pytest.approx(2 / 3, rel=1e-3)


def test_a_busy_link_falls_short_of_the_steady_state() -> None:
    """Four 2 s stages, the middle cut crossed by 3.3 s of activation per minibatch (and as long a gradient
    the other way): the link is the bottleneck, but 1F1B sends a gradient only after its backward and the
    next activation only after that forward, so the link idles between them and the run falls short of one
    minibatch per 3.3 s."""
    p = Profile.chain(
        "link", forward_s=[1.0] * 4, backward_s=[1.0] * 4, output_bytes=[0, 2 * 651537052, 0, 0], param_bytes=[0] * 4
    )
    topology = Topology.parse("4:389387262.0")
    plan = optimize(p, topology, straight=True)
    link_s = 2 * 651537052 / 389387262.0
    assert plan.seconds_per_minibatch == pytest.approx(link_s)
    assert predict(plan, p, topology, minibatches=1600).samples_per_s < 0.95 / link_s


def test_flush_pays_a_bubble_every_step() -> None:
    p = Profile.chain("four", forward_s=[1.0] * 4, backward_s=[2.0] * 4, output_bytes=[0] * 4, param_bytes=[0] * 4)
    topology = Topology.parse("4:1e9")
    plan = optimize(p, topology, straight=True, schedule="flush", microbatches=4)
    sim = predict(plan, p, topology, minibatches=400)
    # Per step: (M + P - 1) slots of 3 s for M = 4 microbatches of one sample.
    assert sim.samples_per_s == pytest.approx(4 / (7 * 3.0))


@pytest.mark.parametrize("schedule", PLANNER_SCHEDULES)
def test_plan_file_round_trip(schedule: str, tmp_path: Path) -> None:
    p = Profile.chain(
        "five",
        forward_s=[1.0, 3.0, 1.0, 1.0, 1.0],
        backward_s=[2.0] * 5,
        output_bytes=[100] * 5,
        param_bytes=[10, 10, 10, 10, 10**9],
        batch_size=8,
    )
    topology = Topology.parse("4:1e9")
    plan = optimize(p, topology, schedule=schedule)
    data = plan_file(plan, p, topology=topology)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    spec = read_plan_file(path)
    assert spec.schedule == schedule and spec.workers == 4 and spec.layers == 5
    assert spec.replicas == [s.replicas for s in plan.stages]
    assert spec.balance == [s.last_layer - s.first_layer + 1 for s in plan.stages]
    assert [r for st in data["stages"] for r in st["ranks"]] == [0, 1, 2, 3]
    assert data["noam"] == plan.noam and data["microbatches"] == spec.microbatches
    assert set(data["predicted"]) >= {"samples_per_s", "speedup_vs_dp", "speedup_vs_single"}
    assert data["predicted"]["speedup_vs_single"] > 1


def test_a_baseline_that_does_not_fit_has_no_speedup() -> None:
    p = Profile.chain(
        "big", forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], output_bytes=[1, 1], param_bytes=[10**9, 10**9]
    )
    topology = Topology.parse("2:1e12")
    plan = optimize(p, topology, schedule="flush", memory=2.5e9)  # one layer per worker fits, both do not
    data = plan_file(plan, p, topology=topology)
    assert data["predicted"]["speedup_vs_dp"] is None and data["predicted"]["speedup_vs_single"] is None
    assert plan.config == "1-1"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (None, "cannot read plan file"),
        ("not json", "is not a Conveyor plan file"),
        ('{"schedule": "flush", "stages": []}', "is not a Conveyor plan file"),
        (
            '{"schedule": "flush", "microbatches": 2, "stages": [{"first_layer": 0, "last_layer": 1, "replicas": 1},'
            ' {"first_layer": 3, "last_layer": 4, "replicas": 1}]}',
            "without gaps",
        ),
    ],
)
def test_bad_plan_files(text: str | None, match: str, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(PlanFileError, match=match):
        read_plan_file(path)
