"""The 2BW planner: the best width x depth x microbatch x recomputation under memory, by brute force."""

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.plan._optimizer import PlanError
from conveyor.plan._planner2bw import plan_2bw
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology
from conveyor.schedule._schedule import twobw_min_microbatches


def _profile(n: int, per_sample: list[float], weights: list[int], acts: list[int], sizes: list[int]) -> Profile:
    """The same chain at several microbatch sizes: times grow with the size plus a fixed overhead."""

    def at(b: int) -> Profile:
        fwd = [1e-3 + t * b for t in per_sample]
        return Profile.chain(
            "m",
            forward_s=fwd,
            backward_s=[2 * f for f in fwd],
            output_bytes=[a * b for a in acts],
            param_bytes=weights,
            batch_size=b,
        )

    first, *rest = sizes
    return replace(at(first), variants=tuple(at(b) for b in rest))


def _brute_force(p: Profile, workers: int, bandwidth: float, batch: int, memory: float) -> float:
    """Samples/s of the best configuration, trying every split of every candidate."""
    best = 0.0
    for b in p.batch_sizes:
        q, m = p.at(b), batch // b
        for w in range(1, workers + 1):
            d = workers // w
            if workers % w or batch % b or m % w or d > len(q) or m < twobw_min_microbatches([w] * d):
                continue
            for recompute, cuts in itertools.product((False, True), itertools.combinations(range(1, len(q)), d - 1)):
                bounds = [0, *cuts, len(q)]
                slowest = 0.0
                for k, (i, j) in enumerate(itertools.pairwise(bounds)):
                    layers = q.layers[i:j]
                    f = sum(x.forward_s for x in layers)
                    c = f * (2 if recompute else 1) + sum(x.backward_s for x in layers)
                    weights = sum(x.param_bytes for x in layers)
                    stash = sum(x.output_bytes for x in layers)
                    inflight = d - k
                    received = q.cut_bytes(i - 1) if i else 0
                    held = inflight * received + stash if recompute else inflight * stash
                    if 3 * weights + held > memory:
                        slowest = math.inf
                    sent = q.cut_bytes(j - 1) if j < len(q) else 0
                    allreduce = 2 * (w - 1) * (weights / w) / bandwidth  # a ring, once per step of m
                    link = (received + sent) / (w * bandwidth)  # each replica's link, both ways at once
                    slowest = max(slowest, c / w + allreduce / m, link)
                best = max(best, b / slowest)
    return best


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.floats(1e-4, 1e-2), min_size=n, max_size=n),
            st.lists(st.integers(0, 10**8), min_size=n, max_size=n),
            st.lists(st.integers(0, 10**7), min_size=n, max_size=n),
        )
    ),
    st.sampled_from([[1, 2, 4], [2], [4, 8]]),
    st.sampled_from([1, 2, 4]),
    st.floats(1e8, 1e11),
    st.sampled_from([16, 32, 24]),
    st.floats(1e8, 2e9),
)
def test_best_configuration_by_brute_force(
    chain: tuple, sizes: list[int], workers: int, bandwidth: float, batch: int, memory: float
) -> None:
    p = _profile(*chain, sizes)
    expected = _brute_force(p, workers, bandwidth, batch, memory)
    topology = Topology.parse(f"{workers}:{bandwidth!r}")
    if expected == 0.0:
        with pytest.raises(PlanError, match="no PipeDream-2BW configuration"):
            plan_2bw(p, topology, batch, memory)
        return
    plan, candidates = plan_2bw(p, topology, batch, memory)
    b = batch // plan.microbatches
    assert b / plan.seconds_per_minibatch == pytest.approx(expected)
    assert max(c.samples_per_s or 0 for c in candidates) == pytest.approx(expected)
    assert all(s.memory_bytes <= memory for s in plan.stages) and plan.workers == workers


def test_recomputation_when_activations_do_not_fit() -> None:
    """Eight equal layers, 400 MB of activations per microbatch each, 2.1 GB per worker on 4 workers.
    Without recomputation the stages near the input hold several microbatches, so only lopsided splits fit
    (four layers on the last stage); recomputing keeps only the stages' inputs and allows even splits,
    whose extra forward costs less than the imbalance."""
    p = _profile(8, [1e-3] * 8, [10**6] * 8, [10**8] * 8, [4])
    plan, candidates = plan_2bw(p, Topology.parse("4:1e12"), batch_size=64, memory=2.1e9)
    assert plan.recompute
    lopsided = max(c.samples_per_s or 0 for c in candidates if not c.recompute)
    assert 0 < lopsided < 4 / plan.seconds_per_minibatch
    free, _ = plan_2bw(p, Topology.parse("4:1e12"), batch_size=64)
    assert not free.recompute and free.seconds_per_minibatch < plan.seconds_per_minibatch


def test_no_configuration_says_why() -> None:
    p = _profile(2, [1e-3] * 2, [10**9] * 2, [10] * 2, [3])
    with pytest.raises(PlanError, match="not a whole number of microbatches"):
        plan_2bw(p, Topology.parse("2:1e10"), batch_size=16)
