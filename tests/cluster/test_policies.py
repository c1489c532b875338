"""The scheduling policies: hand-checked optima, and the constraints on random problems."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from conveyor.cluster._policies import SCHEDULING_POLICIES, allocate
from conveyor.cluster._policy_baselines import isolated
from conveyor.cluster._policy_lp import equal_share_throughputs, isolated_throughputs
from conveyor.cluster._policy_time import finish_time_ratios
from conveyor.cluster._problem import Allocation, Problem

# Types fast/slow, one device each; job A is 4x faster on the fast type, B and C 2x.
ABC = Problem((1, 2, 3), ("fast", "slow"), [[4.0, 1.0], [2.0, 1.0], [2.0, 1.0]], [1, 1, 1], [1, 1])


def levels(problem: Problem, allocation: Allocation) -> np.ndarray:
    """LAS's normalised throughputs ``(s_m / w_m) thr_m / T_m^eq``."""
    teq = equal_share_throughputs(problem.throughputs, problem.capacity)
    with np.errstate(divide="ignore", invalid="ignore"):  # nan for jobs that cannot run anywhere
        return problem.scale_factors * allocation.effective_throughputs(problem) / (problem.weights * teq)


def check_valid(problem: Problem, allocation: Allocation) -> None:
    """The constraints every policy keeps."""
    x = allocation.fractions
    assert x.shape == (len(allocation.combos), len(problem.device_types))
    assert np.isfinite(x).all() and (x >= 0).all()
    for combo in allocation.combos:
        assert 1 <= len(combo) <= 2 and all(0 <= i < problem.jobs for i in combo)
        if len(combo) == 2:
            assert combo in problem.pair_throughputs
            assert problem.scale_factors[combo[0]] == problem.scale_factors[combo[1]]
    time = allocation.job_time(problem.jobs)
    assert (time.sum(axis=1) <= 1 + 1e-6).all()
    assert (allocation.devices_used(problem) <= problem.capacity + 1e-6).all()
    assert (time[problem.throughputs == 0] <= 1e-12).all()


def idle_while_waiting(problem: Problem, allocation: Allocation, tol: float = 1e-6) -> bool:
    """Whether some type has idle devices while a job that can run there has time left."""
    idle = problem.capacity - allocation.devices_used(problem) > tol
    waiting = allocation.job_time(problem.jobs).sum(axis=1) < 1 - tol
    return bool(((problem.throughputs > 0) & idle[None, :] & waiting[:, None]).any())


# --- hand-checked optima -------------------------------------------------------------------------------------


def test_aware_las_on_three_jobs_matches_the_hand_optimum() -> None:
    # T^eq = (2.5, 1.5, 1.5). A takes a of the fast type only, B and C split the rest of it and the slow one:
    # 4a / 2.5 = (1 - a + 0.5) / 1.5  ->  a = 15/34, level 12/17 for everyone.
    a = allocate("max_min_fairness_perf", ABC)
    check_valid(ABC, a)
    assert levels(ABC, a) == pytest.approx([12 / 17] * 3, abs=1e-6)
    assert a.fractions[0].tolist() == pytest.approx([15 / 34, 0.0], abs=1e-6)


def test_agnostic_las_gives_equal_time_shares() -> None:
    a = allocate("max_min_fairness", ABC)
    assert a.job_time(3).sum(axis=1) == pytest.approx([2 / 3] * 3, abs=1e-6)


def test_las_weights_and_scale_factors_share_device_time() -> None:
    weighted = Problem((1, 2), ("v100",), [[1.0], [3.0]], [1, 1], [1], weights=[2.0, 1.0])
    assert allocate("max_min_fairness_perf", weighted).fractions.ravel() == pytest.approx([2 / 3, 1 / 3], abs=1e-6)
    # a job on 2 devices gets half the time of a one-device job: equal device-time, 1 x 1 = 2 x 0.5
    scaled = Problem((1, 2), ("v100",), [[1.0], [1.0]], [1, 2], [2])
    assert allocate("max_min_fairness", scaled).fractions.ravel() == pytest.approx([1.0, 0.5], abs=1e-6)


def test_makespan_on_three_jobs_matches_the_hand_optimum() -> None:
    # A on the fast type only (a = 1 - 2b), B and C b of it and half the slow one: 4 - 8b = 2b + 0.5 -> thr 1.2
    a = allocate("min_total_duration_perf", ABC)
    check_valid(ABC, a)
    assert max(ABC.remaining_steps / a.effective_throughputs(ABC)) == pytest.approx(1 / 1.2, abs=1e-6)
    agnostic = allocate("min_total_duration", ABC)  # blind to speed: no better than the aware optimum
    assert max(ABC.remaining_steps / agnostic.effective_throughputs(ABC)) >= 1 / 1.2 - 1e-9


def test_finish_time_fairness_matches_hand_optima() -> None:
    # no time elapsed: rho_m = thr_iso / thr; thr_iso = T (1/3, 1/3) = (2/3) T^eq, so max rho = 1 / (3/2 * 12/17)
    a = allocate("finish_time_fairness_perf", ABC)
    check_valid(ABC, a)
    rho = finish_time_ratios(ABC, ABC.throughputs, a.effective_throughputs(ABC))
    assert rho.max() == pytest.approx(17 / 18, abs=1e-6)
    # each job alone on its fast type: rho = (10 + 20/4) / (10 + 20/2.5) = 5/6 for A, 5/8 for B: A bounds it
    p = Problem(
        (1, 2), ("a", "b"), [[4.0, 1.0], [1.0, 4.0]], [1, 1], [1, 1], remaining_steps=[20, 20], elapsed_s=[10, 0]
    )
    a = allocate("finish_time_fairness_perf", p)
    assert a.effective_throughputs(p)[0] == pytest.approx(4.0, abs=1e-6)
    assert np.nanmax(finish_time_ratios(p, p.throughputs, a.effective_throughputs(p))) == pytest.approx(5 / 6)


def bisected_ftf(problem: Problem) -> float:
    """The least max rho by bisection on rho with a dense feasibility LP (an independent check)."""
    t, s, c = problem.throughputs, problem.scale_factors, problem.capacity
    n, m = t.shape
    iso = isolated_throughputs(t, s, c)
    alone = problem.elapsed_s + problem.remaining_steps / iso
    a_time = np.kron(np.eye(n), np.ones(m))
    a_cap = np.hstack([np.diag(np.full(m, float(si))) for si in s])
    bounds = [(0, None if tk > 0 else 0) for tk in t.ravel()]
    lo, hi = float(max(problem.elapsed_s / alone)), 1.0
    for _ in range(40):
        rho = (lo + hi) / 2
        need = problem.remaining_steps / (rho * alone - problem.elapsed_s)
        a_thr = -np.kron(np.eye(n), np.ones(m)) * t.ravel()[None, :]
        a_ub = np.vstack([a_time, a_cap, a_thr])
        b_ub = np.concatenate([np.ones(n), c, -need])
        ok = linprog(np.zeros(n * m), A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs").status == 0
        lo, hi = (lo, rho) if ok else (rho, hi)
    return hi


def test_finish_time_fairness_matches_bisection_with_elapsed_time() -> None:
    rng = np.random.default_rng(3)
    for _ in range(3):
        t = rng.uniform(0.5, 4.0, size=(6, 3)) * np.array([1.0, 2.0, 3.0])
        p = Problem(
            tuple(range(6)),
            ("k80", "p100", "v100"),
            t,
            rng.choice([1, 2], 6),
            [2, 2, 1],
            remaining_steps=rng.uniform(10, 1000, 6),
            elapsed_s=rng.uniform(0, 500, 6),
        )
        a = allocate("finish_time_fairness_perf", p)
        rho = np.nanmax(finish_time_ratios(p, p.throughputs, a.effective_throughputs(p)))
        assert rho == pytest.approx(bisected_ftf(p), abs=1e-7)


def test_max_sum_throughput_normalises_by_each_jobs_best_type() -> None:
    # raw steps/s would put the 100-steps/s job on the fast type; normalised, job 2 loses less on the slow one
    p = Problem((1, 2), ("fast", "slow"), [[100.0, 10.0], [2.0, 1.5]], [1, 1], [1, 1])
    assert allocate("max_sum_throughput_perf", p).fractions == pytest.approx(np.eye(2), abs=1e-9)


def test_min_cost_buys_the_cheapest_throughput_and_keeps_others_at_their_isolated_rate() -> None:
    # job 1: SLO 0.5 steps/s: 1/8 V100 ($3 * 1/8) beats 1/2 K80 ($1 * 1/2). Job 2: no SLO, isolated rate.
    p = Problem(
        (1, 2),
        ("v100", "k80"),
        [[4.0, 1.0], [4.0, 1.0]],
        [1, 1],
        [2, 2],
        prices=[3.0, 1.0],
        remaining_steps=[100, 100],
        deadline_s=[200, math.inf],
    )
    a = allocate("min_cost", p)
    check_valid(p, a)
    thr = a.effective_throughputs(p)
    iso = isolated_throughputs(p.throughputs, p.scale_factors, p.capacity)
    assert thr == pytest.approx([0.5, iso[1]], abs=1e-6)
    assert a.fractions[0] == pytest.approx([0.125, 0.0], abs=1e-6)
    assert a.notes == ()


@pytest.mark.parametrize("name", ["max_throughput_per_dollar", "min_cost"])
def test_infeasible_slo_is_noted_and_the_others_still_hold(name: str) -> None:
    # job 7 would need 1000 steps/s (it can do 4 at most); job 8's SLO (1 step/s) is easy
    p = Problem(
        (7, 8, 9),
        ("v100", "k80"),
        [[4.0, 1.0]] * 3,
        [1, 1, 1],
        [1, 2],
        prices=[3.0, 1.0],
        remaining_steps=[1000, 100, 50],
        deadline_s=[1, 100, math.inf],
    )
    a = allocate(name, p)
    check_valid(p, a)
    assert len(a.notes) == 1 and "job 7 " in a.notes[0] and "8" not in a.notes[0].split("hold")[0]
    assert a.effective_throughputs(p)[1] >= 1.0 - 1e-6


def test_feasible_slos_are_met_by_max_throughput_per_dollar() -> None:
    p = Problem(
        (1, 2, 3),
        ("v100", "k80"),
        [[4.0, 1.0], [3.0, 2.0], [2.0, 0.0]],
        [1, 1, 1],
        [1, 1],
        prices=[3.0, 1.0],
        remaining_steps=[300, 100, 100],
        deadline_s=[100, 100, math.inf],
    )
    a = allocate("max_throughput_per_dollar", p)
    assert a.notes == ()
    assert (a.effective_throughputs(p)[:2] >= np.array([3.0, 1.0]) - 1e-6).all()


def test_fifo_follows_arrival_order_and_fifo_perf_picks_the_fastest_type() -> None:
    p = Problem(
        (1, 2, 3), ("k80", "v100"), [[1.0, 3.0], [1.0, 2.0], [1.0, 5.0]], [1, 1, 1], [1, 1], arrival_s=[5.0, 0.0, 9.0]
    )
    # arrival order: job 2, job 1, job 3. Agnostic: the first type with room; aware: the fastest free type
    assert allocate("fifo", p).fractions.tolist() == [[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]
    assert allocate("fifo_perf", p).fractions.tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    # a job that cannot fit even in the empty cluster does not block those behind it
    big = Problem((1, 2), ("v100",), [[1.0], [1.0]], [8, 1], [4])
    assert allocate("fifo", big).fractions.ravel().tolist() == [0.0, 1.0]


def test_gandiva_packs_only_good_pairs_and_only_when_oversubscribed() -> None:
    pairs = {(0, 1): np.array([[0.8, 0.7]]), (2, 3): np.array([[0.4, 0.4]])}  # the second pair loses throughput
    p = Problem((1, 2, 3, 4), ("v100",), [[1.0]] * 4, [1] * 4, [2], pair_throughputs=pairs)
    a = allocate("gandiva", p)
    check_valid(p, a)
    assert (0, 1) in a.combos and a.fractions[a.combos.index((0, 1))].sum() > 0
    assert a.fractions[a.combos.index((2, 3))].sum() == 0
    roomy = Problem((1, 2, 3, 4), ("v100",), [[1.0]] * 4, [1] * 4, [4], pair_throughputs=pairs)
    assert allocate("gandiva", roomy).fractions[:4].ravel() == pytest.approx([1.0] * 4)


def test_packing_beats_time_slicing_when_pairs_keep_over_60_percent() -> None:
    pairs = {(0, 1): np.array([[0.7, 0.65]]), (2, 3): np.array([[0.62, 0.9]])}
    p = Problem((1, 2, 3, 4), ("v100",), [[1.0]] * 4, [1] * 4, [2], pair_throughputs=pairs)
    packed, plain = allocate("max_min_fairness_packing", p), allocate("max_min_fairness_perf", p)
    check_valid(p, packed)
    assert levels(p, plain).min() == pytest.approx(0.5)  # T^eq = 1: half the time each
    assert levels(p, packed).min() > 0.62 - 1e-6  # at least both pairs all the time


def test_water_filling_fills_what_the_max_min_lp_leaves_idle() -> None:
    # Job 3 alone on type b bounds the least level; jobs 1 and 2 on type a only need to reach it, so the
    # max-min LP may leave type a partly idle. Water filling raises them to half of type a each.
    p = Problem((1, 2, 3), ("a", "b"), [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], [1, 1, 1], [1, 3])
    lp, wf = allocate("max_min_fairness_perf", p), allocate("max_min_fairness_water_filling_perf", p)
    check_valid(p, wf)
    assert levels(p, lp).min() == pytest.approx(levels(p, wf).min(), abs=1e-6)  # both max-min optimal
    assert not idle_while_waiting(p, wf)
    assert wf.fractions[:2, 0] == pytest.approx([0.5, 0.5], abs=1e-6)
    if idle_while_waiting(p, lp):  # what HiGHS returns today: a degenerate vertex with type a 1/3 idle
        assert wf.devices_used(p)[0] > lp.devices_used(p)[0] + 1e-3


def test_water_filling_is_hierarchical_over_entities() -> None:
    # entity 0 (weight 3) has 2 jobs, entity 1 (weight 1) has 2: 3/4 and 1/4 of the 2 devices
    p = Problem(
        (1, 2, 3, 4), ("v100",), [[1.0]] * 4, [1] * 4, [2], entities=[0, 0, 1, 1], entity_weights={0: 3.0, 1: 1.0}
    )
    assert allocate("max_min_fairness_water_filling", p).fractions.ravel() == pytest.approx([0.75, 0.75, 0.25, 0.25])
    # one job per entity, capped at its whole time: the other entity's jobs share what it cannot use
    q = Problem((1, 2, 3), ("v100",), [[1.0]] * 3, [1, 1, 1], [2], entities=[0, 1, 1], entity_weights={0: 3.0})
    assert allocate("max_min_fairness_water_filling_perf", q).fractions.ravel() == pytest.approx([1.0, 0.5, 0.5])


def test_allocate_rejects_unknown_names_and_bad_inputs() -> None:
    with pytest.raises(ValueError, match="unknown policy 'lottery'; choose one of: max_min_fairness, "):
        allocate("lottery", ABC)
    negative = Problem((1,), ("v100",), [[1.0]], [1], [1], weights=[0.0])
    with pytest.raises(ValueError, match="weight > 0"):
        allocate("max_min_fairness_perf", negative)
    mixed = Problem((1, 2), ("v100",), [[1.0], [1.0]], [1, 2], [2], pair_throughputs={(0, 1): np.ones((1, 2))})
    with pytest.raises(ValueError, match="equal scale factors"):
        allocate("max_min_fairness_packing", mixed)


@pytest.mark.parametrize("name", list(SCHEDULING_POLICIES))
def test_an_empty_problem_gets_an_empty_allocation(name: str) -> None:
    a = allocate(name, Problem((), ("k80", "v100"), np.zeros((0, 2)), [], [4, 4]))
    assert a.combos == () and a.fractions.shape == (0, 2)


# --- every policy on random problems ---------------------------------------------------------------------------


@st.composite
def problems(draw: st.DrawFn) -> Problem:
    n = draw(st.integers(1, 8))
    m = draw(st.integers(1, 3))
    speed = st.one_of(st.just(0.0), st.floats(0.1, 10.0))
    t = np.array(draw(st.lists(st.lists(speed, min_size=m, max_size=m), min_size=n, max_size=n)))
    scale = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=n, max_size=n))
    capacity = draw(st.lists(st.integers(0, 8), min_size=m, max_size=m))
    deadline = draw(st.lists(st.one_of(st.just(math.inf), st.floats(0.5, 1000.0)), min_size=n, max_size=n))
    pairs = {}
    for i in range(n):
        for j in range(i + 1, n):
            if scale[i] == scale[j] and draw(st.booleans()):
                pairs[(i, j)] = np.array(draw(st.lists(st.tuples(speed, speed), min_size=m, max_size=m)))
    return Problem(
        tuple(range(100, 100 + n)),
        tuple(f"t{k}" for k in range(m)),
        t,
        scale,
        capacity,
        weights=draw(st.lists(st.floats(0.5, 4.0), min_size=n, max_size=n)),
        remaining_steps=draw(st.lists(st.one_of(st.just(0.0), st.floats(1.0, 1e4)), min_size=n, max_size=n)),
        elapsed_s=draw(st.lists(st.one_of(st.just(0.0), st.floats(1.0, 1e3)), min_size=n, max_size=n)),
        deadline_s=deadline,
        prices=draw(st.lists(st.floats(0.1, 5.0), min_size=m, max_size=m)),
        arrival_s=draw(st.lists(st.floats(0.0, 100.0), min_size=n, max_size=n)),
        entities=draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)),
        entity_weights={e: draw(st.floats(0.5, 3.0)) for e in range(3)},
        pair_throughputs=pairs,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_policy_keeps_the_constraints(problem: Problem) -> None:
    for name in SCHEDULING_POLICIES:
        check_valid(problem, allocate(name, problem))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_optimising_policies_do_no_worse_than_their_references(problem: Problem) -> None:
    iso = isolated_throughputs(problem.throughputs, problem.scale_factors, problem.capacity)
    runs = iso > 0
    lp = allocate("max_min_fairness_perf", problem)
    if runs.any():
        # the isolated share is feasible: LAS's least level, FTF's largest ratio and the makespan do as well
        assert levels(problem, lp)[runs].min() >= levels(problem, isolated(problem))[runs].min() - 1e-6
        packed = allocate("max_min_fairness_packing", problem)
        assert levels(problem, packed)[runs].min() >= levels(problem, lp)[runs].min() - 1e-6
        left = runs & (problem.remaining_steps > 0)
        if left.any():
            ftf = allocate("finish_time_fairness_perf", problem)
            rho = finish_time_ratios(problem, problem.throughputs, ftf.effective_throughputs(problem))
            assert np.nanmax(rho[left]) <= 1 + 1e-6
            span = allocate("min_total_duration_perf", problem).effective_throughputs(problem)
            rem = problem.remaining_steps[left]
            assert max(rem / np.maximum(span[left], 1e-300)) <= max(rem / iso[left]) * (1 + 1e-6)
    # water filling: no usable device idle while a job waits; its least level is LAS's
    wf = allocate("max_min_fairness_water_filling_perf", problem)
    assert not idle_while_waiting(problem, wf)
    assert not idle_while_waiting(problem, allocate("max_min_fairness_water_filling", problem))
    if runs.any() and len(set(problem.entities.tolist())) == 1:
        assert levels(problem, wf)[runs].min() == pytest.approx(levels(problem, lp)[runs].min(), rel=1e-5)
    # SLO policies: every SLO not named in a note is met
    slo = np.isfinite(problem.deadline_s) & (problem.remaining_steps > 0)
    for name in ("max_throughput_per_dollar", "min_cost"):
        a = allocate(name, problem)
        named = {int(i) for note in a.notes for i in re.findall(r"\d+", note.split("cannot")[0])}
        met = a.effective_throughputs(problem) >= problem.remaining_steps / problem.deadline_s * (1 - 1e-6) - 1e-9
        assert all(met[i] for i in np.flatnonzero(slo) if problem.job_ids[i] not in named)


def reference_water_filling(problem: Problem) -> np.ndarray:
    """Normalised throughputs by textbook progressive filling, with a dense LP per job to decide which can
    still rise (slow, independent of the policy's dual-based freezing)."""
    t, s, c = problem.throughputs, problem.scale_factors, problem.capacity
    n, m = t.shape
    teq = equal_share_throughputs(t, c)
    y_rows = np.kron(np.eye(n), np.ones(m)) * (t / teq[:, None]).ravel()[None, :]  # y = y_rows @ x
    base_a = np.vstack([np.kron(np.eye(n), np.ones(m)), np.hstack([np.diag(np.full(m, float(si))) for si in s])])
    base_b = np.concatenate([np.ones(n), c])
    bounds = [(0, None if tk > 0 else 0) for tk in t.ravel()] + [(None, None)]
    level, rising = np.zeros(n), np.ones(n, dtype=bool)
    while rising.any():
        w = np.where(rising, problem.weights, 0.0)
        step = np.where(rising, w / w.sum() / s, 0.0)
        a_ub = np.vstack([np.hstack([base_a, np.zeros((n + m, 1))]), np.hstack([-y_rows, step[:, None]])])
        res = linprog(np.r_[np.zeros(n * m), -1.0], A_ub=a_ub, b_ub=np.r_[base_b, -level], bounds=bounds)
        level = level + step * res.x[-1] - 1e-10
        for j in np.flatnonzero(rising):  # can job j rise with nobody below their level?
            a_ub = np.vstack([base_a, -y_rows])
            top = linprog(-y_rows[j], A_ub=a_ub, b_ub=np.r_[base_b, -level], bounds=bounds[:-1])
            rising[j] = -top.fun > level[j] + 1e-7
    return level


def test_water_filling_matches_textbook_progressive_filling() -> None:
    rng = np.random.default_rng(11)
    for _ in range(4):
        n = 6
        t = rng.uniform(0.5, 4.0, size=(n, 3)) * (rng.random((n, 3)) > 0.3)
        t[np.arange(n), rng.integers(0, 3, n)] = rng.uniform(0.5, 4.0, n)  # every job runs somewhere
        p = Problem(
            tuple(range(n)),
            ("k80", "p100", "v100"),
            t,
            rng.choice([1, 2], n),
            [2, 1, 3],
            weights=rng.uniform(0.5, 2.0, n),
        )
        wf = allocate("max_min_fairness_water_filling_perf", p)
        teq = equal_share_throughputs(p.throughputs, p.capacity)
        assert wf.effective_throughputs(p) / teq == pytest.approx(reference_water_filling(p), abs=1e-6)
