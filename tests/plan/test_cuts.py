"""Cuts of layer graphs: PipeDream's down-sets, each crossing tensor counted once, and plans over them."""

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.plan import PlanError, Profile, Topology, optimize
from conveyor.plan._cuts import cuts_of
from conveyor.plan._profiles import Layer


@st.composite
def graphs(draw: st.DrawFn, max_layers: int = 6) -> Profile:
    """Random DAGs in topological order, each layer after the first fed by one to two earlier ones."""
    n = draw(st.integers(2, max_layers))
    edges = set()
    for b in range(1, n):
        for a in draw(st.sets(st.integers(0, b - 1), min_size=1, max_size=2)):
            edges.add((a, b))
    layers = tuple(
        Layer(
            str(i),
            "",
            draw(st.floats(1e-3, 1.0)),
            draw(st.floats(1e-3, 1.0)),
            draw(st.integers(0, 10**9)),
            draw(st.integers(0, 10**9)),
        )
        for i in range(n)
    )
    return Profile("dag", layers, tuple(sorted(edges)))


def _down_sets(p: Profile) -> list[frozenset[int]]:
    """Every set of layers closed under producers, by brute force."""
    n = len(p)
    return [
        frozenset(s)
        for k in range(n + 1)
        for s in itertools.combinations(range(n), k)
        if all(a in s for a, b in p.edges if b in s)
    ]


@settings(max_examples=100, deadline=None)
@given(graphs())
def test_cuts_are_down_sets_grown_from_the_first_layer(p: Profile) -> None:
    cuts = cuts_of(p)
    every = set(_down_sets(p))
    assert cuts.sets[0] == frozenset() and cuts.sets[-1] == frozenset(range(len(p)))
    assert all(s in every for s in cuts.sets)
    assert all(0 in s for s in cuts.sets[1:])  # PipeDream starts from the first source
    for s in cuts.sets[1:]:  # each crossing tensor once: outputs of layers inside consumed outside
        expected = sum(p.layers[a].output_bytes for a in {a for a, b in p.edges if a in s and b not in s})
        assert cuts.crossing(p)[cuts.sets.index(s)] == expected


def test_a_chain_is_cut_at_its_prefixes() -> None:
    p = Profile.chain("c", forward_s=[1.0] * 3, backward_s=[1.0] * 3, output_bytes=[1] * 3, param_bytes=[1] * 3)
    assert cuts_of(p).sets == tuple(frozenset(range(k)) for k in range(4))


def test_published_profiles_have_pipedreams_state_counts(pipedream_profiles: Path) -> None:
    # "Total number of states" printed by PipeDream's optimizer (msr-fiddle/pipedream, run on these files).
    expected = {
        "alexnet": 22,
        "vgg16": 40,
        "resnet18": 100,
        "resnet50": 240,
        "densenet121": 430,
        "gnmt": 99,
        "squeezenet1_0": 99,
        "resnet101": 410,
    }
    for model, states in expected.items():
        assert len(cuts_of(Profile.load(pipedream_profiles / model)).sets) == states + 1, model  # + the empty set


def test_too_many_down_sets_fall_back_to_the_order_and_say_why(pipedream_profiles: Path) -> None:
    p = Profile.load(pipedream_profiles / "inception_v3")
    cuts = cuts_of(p)
    assert len(cuts.sets) == len(p) + 1 and "more than 1000 down-sets" in cuts.why_not_graph
    assert "more than 1000 down-sets" in optimize(p, Topology.parse("4:1e9")).note


def _brute_force(p: Profile, workers: int, bandwidth: float) -> float:
    """Every chain of nested down-sets from nothing to everything, every replica count: the physical model."""
    sets = cuts_of(p).sets
    best = float("inf")

    def crossing(s: frozenset[int]) -> int:
        return sum(p.layers[a].output_bytes for a in {a for a, b in p.edges if a in s and b not in s})

    def chains(current: frozenset[int]) -> list[list[frozenset[int]]]:
        if len(current) == len(p):
            return [[current]]
        return [[current, *rest] for s in sets if current < s for rest in chains(s)]

    for chain in chains(frozenset()):
        stages = list(itertools.pairwise(chain))
        for reps in itertools.product(range(1, workers + 1), repeat=len(stages)):
            if sum(reps) != workers:
                continue
            slowest = 0.0
            for (a, b), r in zip(stages, reps, strict=True):
                layers = b - a
                compute = sum(p.layers[i].forward_s + p.layers[i].backward_s for i in layers)
                ring = 2 * (r - 1) * sum(p.layers[i].param_bytes for i in layers) / r / bandwidth
                links = (crossing(a) + crossing(b)) / (r * bandwidth)
                slowest = max(slowest, compute / r + ring / r, links)
            best = min(best, slowest)
    return best


@settings(max_examples=60, deadline=None)
@given(graphs(max_layers=5), st.integers(1, 3), st.floats(1e8, 1e10))
def test_plans_over_a_graph_are_the_optimum_over_its_cuts(p: Profile, workers: int, bandwidth: float) -> None:
    expected = _brute_force(p, workers, bandwidth)
    plan = optimize(p, Topology.parse(f"{workers}:{bandwidth!r}"))
    assert plan.seconds_per_minibatch == pytest.approx(expected)
    ordered = plan.in_order(p)  # each stage a range of the plan's order, which is topological
    assert all(a < b for a, b in ordered.edges)
    assert sorted(lay.name for lay in ordered.layers) == sorted(lay.name for lay in p.layers)


def test_cutting_between_branches_beats_every_prefix_of_one_order() -> None:
    # Two branches a -> (b1, b2) -> c, listed b1 then b2. The best 2-stage split puts a and b2 first (a heavy
    # activation from b1, 10 s on the link, would cross otherwise); prefixes of the listed order cannot.
    layer = Layer("x", "", 1.0, 1.0, 10, 0)
    layers = (layer, Layer("b1", "", 1.0, 1.0, 10**10, 0), Layer("b2", "", 1.0, 1.0, 10, 0), layer)
    p = Profile("branches", layers, ((0, 1), (0, 2), (1, 3), (2, 3)))
    plan = optimize(p, Topology.parse("2:1e9"), straight=True)
    assert plan.layers == (0, 2, 1, 3)
    assert [lay.name for lay in plan.in_order(p).layers[: plan.stages[0].last_layer + 1]] == ["x", "b2"]
    assert plan.seconds_per_minibatch == pytest.approx(4.0)  # two layers' compute per stage; 20 bytes cross


def test_an_impossible_straight_pipeline_is_refused() -> None:
    p = Profile.chain("c", forward_s=[1.0], backward_s=[1.0], output_bytes=[1], param_bytes=[1])
    with pytest.raises(PlanError, match="no straight pipeline"):
        optimize(p, Topology.parse("2:1e9"), straight=True)
