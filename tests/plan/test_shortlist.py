"""The layout run: every schedule on every worker count planned and simulated, the fastest to accuracy first."""

import pytest

from conveyor.plan import PlanError, Profile, RuntimeCosts, Topology, layout_key, predict, shortlist

SCHEDULES = ["flush", "2bw", "pipedream", "gpipe"]


def _profile(compute_s: float, weight_bytes: float, cut_bytes: float) -> Profile:
    """Four layers of ``compute_s`` (a third forward), ``weight_bytes`` each, ``cut_bytes`` between them."""
    return Profile.chain(
        "toy",
        forward_s=[compute_s / 3] * 4,
        backward_s=[2 * compute_s / 3] * 4,
        output_bytes=[cut_bytes] * 4,
        param_bytes=[weight_bytes] * 4,
        batch_size=16,
    )


def _microbatches(workers: int) -> int:
    return 1 if workers == 1 else 4


def test_each_entry_is_its_plans_simulation_and_the_fastest_to_accuracy_comes_first() -> None:
    profile, topology = _profile(1e-3, 1e6, 1e4), Topology.parse("4:1e9")
    found = shortlist(
        profile, topology, schedules=SCHEDULES, microbatches=_microbatches, batches=12, worker_counts=[1, 2, 3, 4]
    )
    assert sum(s.workers == 1 for s in found) == 1  # one worker alone is one layout: a plain loop
    assert sorted({s.workers for s in found}) == [1, 2, 3, 4]
    layouts = [(s.schedule, s.plan.config, tuple(st.last_layer for st in s.plan.stages)) for s in found]
    assert len(layouts) == len(set(layouts))  # each once, whichever searches found it
    assert {s.schedule for s in found if s.workers == 4} == set(SCHEDULES)
    assert found[0].time_to_accuracy == min(s.time_to_accuracy for s in found)
    for s in found:
        assert s.topology.workers == s.workers == s.plan.workers
        again = predict(s.plan, profile, s.topology, 12 * s.plan.microbatches)
        assert (s.seconds, s.samples_per_s) == (again.seconds, again.samples_per_s)
        assert s.to_json()["config"] == s.plan.config


def test_a_small_model_runs_alone_and_a_large_one_on_every_worker() -> None:
    slow_link = Topology.parse("4:1e7")  # 10 MB/s: a pipeline's activations and DP's weights cost seconds
    small = _profile(1e-4, 1e6, 1e5)
    found = shortlist(
        small, slow_link, schedules=SCHEDULES, microbatches=_microbatches, batches=8, worker_counts=[1, 4]
    )
    assert found[0].workers == 1 and found[0].plan.config == "1"
    large = _profile(1.0, 1e3, 1e3)  # a second of compute a layer, a kilobyte to send
    found = shortlist(
        large, slow_link, schedules=SCHEDULES, microbatches=_microbatches, batches=8, worker_counts=[1, 4]
    )
    assert found[0].workers == 4


def test_the_one_worker_layout_runs_its_own_profile() -> None:
    profile, topology = _profile(1e-3, 1e3, 1e3), Topology.parse("2:1e9")
    alone = _profile(1e-5, 1e3, 1e3)  # one worker alone with every core: a hundred times faster
    found = shortlist(
        profile, topology, schedules=["flush"], microbatches=_microbatches, batches=8, worker_counts=[1, 2], alone=alone
    )
    assert found[0].workers == 1 and found[0].profile is alone


def test_a_tie_goes_to_fewer_workers() -> None:
    """On one core two workers without weights or messages take as long as one: the run takes one."""
    profile, topology = _profile(1e-3, 0, 0), Topology.parse("2:1e12")
    found = shortlist(
        profile,
        topology,
        schedules=["flush"],
        microbatches=lambda workers: 4,
        batches=8,
        worker_counts=[1, 2],
        runtime=RuntimeCosts(cores=1),
    )
    two = next(s for s in found if s.workers == 2 and s.plan.config == "2")  # data parallelism
    assert found[0].workers == 1 and found[0].time_to_accuracy == pytest.approx(two.time_to_accuracy, rel=1e-3)


def test_a_gain_within_the_figures_spread_does_not_change_the_layout() -> None:
    profile, topology = _profile(1e-3, 0, 0), Topology.parse("2:1e12")  # two workers nearly twice as fast
    options = {"schedules": ["flush"], "microbatches": lambda workers: 4, "batches": 8, "worker_counts": [1, 2]}
    assert shortlist(profile, topology, **options)[0].workers == 2  # type: ignore[arg-type]
    noisy = shortlist(profile, topology, **options, tie=1.5)  # type: ignore[arg-type]
    assert noisy[0].workers == 1  # figures that vary 150%: a gain of 2x is not told from noise
    assert min(s.time_to_accuracy for s in noisy) < noisy[0].time_to_accuracy


def test_fewer_workers_are_planned_on_one_level_only() -> None:
    two_servers = Topology.parse("2:1e9,2:1e8")
    with pytest.raises(PlanError, match="one level"):
        shortlist(
            _profile(1e-3, 0, 0),
            two_servers,
            schedules=["flush"],
            microbatches=_microbatches,
            batches=4,
            worker_counts=[1, 4],
        )
    found = shortlist(_profile(1e-3, 0, 0), two_servers, schedules=["flush"], microbatches=_microbatches, batches=4)
    assert {s.workers for s in found} == {4}


def test_a_layout_is_predicted_as_a_run_of_it_measured() -> None:
    profile, topology = _profile(1e-3, 0, 0), Topology.parse("2:1e12")  # two workers nearly twice as fast
    options = {"schedules": ["flush"], "microbatches": lambda workers: 4, "batches": 8, "worker_counts": [1, 2]}
    simulated = shortlist(profile, topology, **options)  # type: ignore[arg-type]
    two = simulated[0]
    assert two.workers == 2 and two.key == layout_key("flush", [2], [4], 4) == "flush 2 [4] x4"
    assert two.ratio == 1.0 and two.to_json()["measured_over_simulated"] == 1.0
    # Runs of each two-worker layout measured a third of its simulated rate: one worker is faster now.
    ratios = {s.key: 1 / 3 for s in simulated if s.workers == 2}
    measured = shortlist(profile, topology, **options, ratios=ratios)  # type: ignore[arg-type]
    assert measured[0].workers == 1 and measured[0].ratio == 1.0
    again = next(s for s in measured if s.key == two.key)
    assert (again.samples_per_s, again.ratio) == (two.samples_per_s, 1 / 3)  # the simulation itself unchanged
    assert again.time_to_accuracy == pytest.approx(3 * two.time_to_accuracy)
    assert again.to_json()["measured_over_simulated"] == 1 / 3
