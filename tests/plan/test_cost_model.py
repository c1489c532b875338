"""The cost model's terms against hand-computed cases, and PipeDream's terms against its optimizer's figures."""

from pathlib import Path

import pytest

from conveyor.plan import Profile, Topology, allreduce_s, optimize
from conveyor.plan._cost_model import stage_seconds


def test_a_ring_all_reduce_moves_2_r_minus_1_over_r_of_the_weights_per_link() -> None:
    # 100 MB among 4 workers at 125 MB/s: 6 steps of 25 MB, 0.2 s each, plus 6 latencies.
    assert allreduce_s(100e6, 4, 1e-3, 1.25e8) == pytest.approx(6 * (1e-3 + 0.2))
    assert allreduce_s(100e6, 1, 1e-3, 1.25e8) == 0.0


def test_physical_stage_sums_compute_and_its_all_reduce_per_update() -> None:
    t = Topology.parse("8:1e9/1ms")
    # 4 replicas, 8 s of compute per minibatch, 1 GB of weights, one update per round of 4 minibatches:
    # 8 / 4 + 6 * (1 ms + 0.25 s) / 4.
    assert float(stage_seconds("physical", t, 0, 8.0, 1e9, 0, 0, 4)) == pytest.approx(2 + 6 * 0.251 / 4)
    # An update per batch of 16 microbatches shares the same all-reduce among 16.
    assert float(stage_seconds("physical", t, 0, 8.0, 1e9, 0, 0, 4, 16)) == pytest.approx(2 + 6 * 0.251 / 16)


def test_physical_links_carry_what_enters_and_leaves_shared_by_the_replicas() -> None:
    t = Topology.parse("8:1e9")
    # A middle stage on 2 replicas receiving 3 GB and sending 1 GB per minibatch (each gradient the other way):
    # each replica's link carries (3 + 1) / 2 GB each way per minibatch, more than its 1 s of compute.
    assert float(stage_seconds("physical", t, 0, 2.0, 0, 3e9, 1e9, 2)) == pytest.approx(2.0)
    assert float(stage_seconds("physical", t, 0, 6.0, 0, 3e9, 1e9, 2)) == pytest.approx(3.0)  # compute bound


def test_an_outer_level_ring_goes_at_the_slowest_link_it_crosses() -> None:
    t = Topology.parse("2:1e8,2:1e9/2ms")  # slow inside the servers, fast between them
    # 2 servers each taking 1 s per minibatch; a ring of 2 over level 1: 2 steps of 0.5 GB at 1e8 B/s.
    expected = 1.0 / 2 + 2 * (2e-3 + 0.5e9 / 1e8) / 2
    assert float(stage_seconds("physical", t, 1, 1.0, 1e9, 0, 0, 2)) == pytest.approx(expected)


def test_pipedream_terms() -> None:
    t = Topology.parse("4:1e9")
    # (compute + 4 (m - 1) W / (m B)) / m, links 2 C / (m B) for the larger of input and output.
    assert float(stage_seconds("pipedream", t, 0, 8.0, 1e9, 0, 0, 4)) == pytest.approx((8 + 3) / 4)
    assert float(stage_seconds("pipedream", t, 0, 0.1, 0, 3e9, 1e9, 2)) == pytest.approx(3.0)
    assert float(stage_seconds("pipedream", t, 0, 0.1, 0, 0, 1e9, 2, first=True)) == pytest.approx(0.05)


def test_unknown_cost_model_is_refused() -> None:
    p = Profile.chain("toy", [1.0], [1.0], [0], [0])
    with pytest.raises(ValueError, match="unknown cost model 'fast': use one of physical, pipedream"):
        optimize(p, Topology.parse("2:1e9"), cost_model="fast")


def test_the_plan_records_its_cost_model(pipedream_profiles: Path) -> None:
    vgg = Profile.load(pipedream_profiles / "vgg16")
    assert optimize(vgg, Topology.parse("4:1.25e9")).cost_model == "physical"
    assert optimize(vgg, Topology.parse("4:1.25e9"), cost_model="pipedream").cost_model == "pipedream"
