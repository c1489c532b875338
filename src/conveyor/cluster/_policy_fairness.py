"""Least-attained-service (max-min fairness) policies: plain LP, with space sharing, and water filling."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp  # type: ignore[import-untyped]

from conveyor.cluster._policy_lp import (
    Block,
    Layout,
    Solved,
    equal_share_throughputs,
    finish,
    isolated_throughputs,
    level_lp,
    ones_where_runnable,
    packed_layout,
    singles_layout,
    solve,
)
from conveyor.cluster._problem import Allocation, Problem
from conveyor.errors import InputError

__all__ = [
    "max_min_fairness",
    "max_min_fairness_packing",
    "max_min_fairness_perf",
    "max_min_fairness_water_filling",
    "max_min_fairness_water_filling_perf",
]

_FREEZE = 1e-8  # a rising job whose dual share (lambda_m * need_m, summing to 1) exceeds this is saturated
_SLACK = 1e-9  # relative slack on levels carried from one LP to the next (HiGHS meets rows to ~1e-9)


def _check_weights(problem: Problem, name: str) -> None:
    if (problem.weights <= 0).any() or not np.isfinite(problem.weights).all():
        raise InputError(f"{name}: Problem.weights must be finite and positive; give every job a weight > 0")


def _las(problem: Problem, layout: Layout, throughputs: np.ndarray, name: str) -> np.ndarray:
    """The LAS LP over ``layout`` with ``T^eq`` from ``throughputs``; returns x ``(combos, types)``."""
    _check_weights(problem, name)
    x = np.zeros(layout.allowed.shape)
    teq = equal_share_throughputs(throughputs, problem.capacity)
    active = teq > 0
    if not active.any():
        return x
    s = problem.scale_factors.astype(float)
    gain = np.where(active, s / (problem.weights * np.where(active, teq, 1.0)), 0.0)
    # scale t so that the optimum is >= 1: the isolated allocation reaches min(gain * thr_iso)
    iso = isolated_throughputs(throughputs, problem.scale_factors, problem.capacity)
    need = np.full(problem.jobs, float(np.min((gain * iso)[active])))
    solved = level_lp(
        layout, capacity=problem.capacity, gain=gain, need=need, base=np.zeros(problem.jobs), rising=active, what=name
    )
    if solved is None:  # pragma: no cover - x = 0, t = 0 is always feasible
        raise RuntimeError(f"{name}: HiGHS found the max-min LP infeasible; please report this Problem")
    return solved.x


def max_min_fairness_perf(problem: Problem) -> Allocation:
    """Heterogeneity-aware least attained service (Gavel's LAS): maximise the least weighted normalised
    throughput.

    With ``T_m^eq = sum_k T_mk c_k / sum(c)`` (Gavel's "proportional" share: every job ``c_k / n`` of each
    type, rows scaled to sum to 1):

        maximise    t
        subject to  t <= (s_m / w_m) * sum_k T_mk X_mk / T_m^eq      for every job m with T_m^eq > 0
                    sum_k X_mk <= 1,   sum_m s_m X_mk <= c_k,   X >= 0,   X_mk = 0 where T_mk = 0.

    Jobs that cannot run on any type with devices (``T_m^eq = 0``) get nothing and do not pull ``t`` to 0. The
    LP is degenerate: it fixes the least level only, and may leave capacity idle that others could use (see
    :func:`max_min_fairness_water_filling_perf`).

    Example:
        >>> p = Problem((1, 2), ("v100",), [[2.0], [1.0]], [1, 1], [1])
        >>> max_min_fairness_perf(p).fractions.round(6).tolist()  # equal time, whatever the speed
        [[0.5], [0.5]]
    """
    if problem.jobs == 0:
        return Allocation((), np.zeros((0, len(problem.device_types))))
    layout = singles_layout(problem)
    return finish(problem, layout, _las(problem, layout, problem.throughputs, "max_min_fairness_perf"))


def max_min_fairness(problem: Problem) -> Allocation:
    """Heterogeneity-agnostic LAS (Gavel's baseline): :func:`max_min_fairness_perf` with every throughput
    taken as 1 where the job can run (0 where it cannot), so it maximises the least weighted device-time share

        maximise    t
        subject to  t <= (s_m / w_m) * sum_k X_mk / (sum_{k: T_mk > 0} c_k / sum(c))   for every runnable job m

    and the base constraints. A job on ``s_m`` devices gets ``1 / s_m`` of the time of a one-device job: equal
    shares of device-time, as in Gavel.

    Example:
        >>> p = Problem((1, 2, 3), ("fast", "slow"), [[4.0, 1.0], [2.0, 1.0], [2.0, 1.0]], [1, 1, 1], [1, 1])
        >>> max_min_fairness(p).fractions.sum(axis=1).round(6).tolist()  # 2 devices, 3 jobs: 2/3 each
        [0.666667, 0.666667, 0.666667]
    """
    if problem.jobs == 0:
        return Allocation((), np.zeros((0, len(problem.device_types))))
    ones = ones_where_runnable(problem.throughputs)
    layout = singles_layout(problem, ones)
    return finish(problem, layout, _las(problem, layout, ones, "max_min_fairness"))


def max_min_fairness_packing(problem: Problem) -> Allocation:
    """Heterogeneity-aware LAS with space sharing: the LP of :func:`max_min_fairness_perf` over combinations,
    the single jobs and the pairs of ``Problem.pair_throughputs``.

    For combinations c (a pair holds its scale factor ``s_c`` of devices once for both jobs) and their
    throughputs ``T_cmk`` for member m (a single job's own ``T_mk``; a pair's co-located ones):

        maximise    t
        subject to  t <= (s_m / w_m) * sum_{c ∋ m} sum_k T_cmk X_ck / T_m^eq     for every runnable job m
                    sum_{c ∋ m} sum_k X_ck <= 1,   sum_c s_c X_ck <= c_k,   X >= 0,
                    X_ck = 0 where a member cannot run on k alone or makes no progress there in the pair.

    ``T_m^eq`` is the single-job equal share. Gavel writes this LP per job *type* to scale to all pairs; here
    the pairs are listed explicitly, so it is one variable per (pair, type), and only the listed pairs.

    Example:
        >>> pair = {(0, 1): np.array([[0.8, 0.8]])}  # together, each runs at 80% of its speed alone
        >>> p = Problem((1, 2), ("v100",), [[1.0], [1.0]], [1, 1], [1], pair_throughputs=pair)
        >>> a = max_min_fairness_packing(p)
        >>> a.combos, a.effective_throughputs(p).round(6).tolist()
        (((0,), (1,), (0, 1)), [0.8, 0.8])
    """
    if problem.jobs == 0:
        return Allocation((), np.zeros((0, len(problem.device_types))))
    layout = packed_layout(problem)
    return finish(problem, layout, _las(problem, layout, problem.throughputs, "max_min_fairness_packing"))


def _entity_shares(problem: Problem, rising: np.ndarray) -> np.ndarray:
    """Each rising job's weight: its entity's weight split over the entity's rising jobs by job weight."""
    ids, inverse = np.unique(problem.entities, return_inverse=True)
    entity_weight = np.array([float(problem.entity_weights.get(int(e), 1.0)) for e in ids])
    if (entity_weight <= 0).any() or not np.isfinite(entity_weight).all():
        raise InputError("Problem.entity_weights must be finite and positive; give every entity a weight > 0")
    rising_weight = np.where(rising, problem.weights, 0.0)
    totals = np.bincount(inverse, weights=rising_weight, minlength=len(ids))
    return np.where(rising, entity_weight[inverse] * rising_weight / np.where(totals > 0, totals, 1.0)[inverse], 0.0)


def _alone(throughputs: np.ndarray, scale_factors: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """``(jobs,)`` each job's steps/s with the cluster to itself: its fastest types first, ``c_k / s_m`` of
    each, until its time is full."""
    order = np.argsort(-throughputs, axis=1)
    fast = np.take_along_axis(throughputs, order, axis=1)
    room = capacity[order] / scale_factors[:, None].astype(float)
    left = np.ones(throughputs.shape[0])
    best = np.zeros(throughputs.shape[0])
    for k in range(throughputs.shape[1]):
        take = np.where(fast[:, k] > 0, np.minimum(left, room[:, k]), 0.0)
        best += take * fast[:, k]
        left -= take
    return best


def _water_fill(problem: Problem, throughputs: np.ndarray, name: str) -> Allocation:
    _check_weights(problem, name)
    layout = singles_layout(problem, throughputs)
    n = problem.jobs
    teq = equal_share_throughputs(throughputs, problem.capacity)
    active = teq > 0
    if not active.any():
        return finish(problem, layout, np.zeros(layout.allowed.shape))
    gain = np.where(active, 1.0 / np.where(active, teq, 1.0), 0.0)  # y_m = gain_m * thr_m: normalised throughput
    s = problem.scale_factors.astype(float)
    iso = gain * isolated_throughputs(throughputs, problem.scale_factors, problem.capacity)
    shares = _entity_shares(problem, active)
    unit = float(np.min((iso * s / np.where(active, shares, 1.0))[active]))  # the first t is then >= 1
    ceiling = gain * _alone(throughputs, problem.scale_factors, problem.capacity) * (1 - 1e3 * _SLACK)
    level = np.zeros(n)
    rising = active.copy()
    x = np.zeros(layout.allowed.shape)
    for _ in range(n + 1):
        if not rising.any():
            break
        need = _entity_shares(problem, rising) / s * unit
        solved, level = _rise(
            layout, problem.capacity, gain=gain, need=need, level=level, rising=rising, floor=active, what=name
        )
        x, t = solved.x, float(solved.extra[0])
        y = gain * (layout.rate @ x.ravel())
        level = np.where(rising, np.minimum(y, level + need * max(t, 0.0)), level)
        level = np.maximum(level * (1 - _SLACK) - _SLACK, 0.0)
        share = solved.duals[0] * need
        saturated = rising & ((share > _FREEZE) | (level >= ceiling))  # or at its speed with the cluster alone
        if not saturated.any():  # the duals' weights sum to 1: the largest is a saturated job
            saturated[np.argmax(np.where(rising, share, -np.inf))] = True
        rising &= ~saturated
    return finish(problem, layout, _absorbed(problem, layout, x, gain=gain, level=level, active=active, what=name))


def _rise(
    layout: Layout,
    capacity: np.ndarray,
    *,
    gain: np.ndarray,
    need: np.ndarray,
    level: np.ndarray,
    rising: np.ndarray,
    floor: np.ndarray,
    what: str,
) -> tuple[Solved, np.ndarray]:
    """One water-filling step's LP (the rising jobs' levels up by ``t * need``, every other job's held), and the
    levels it started from: carried over a hair too high, they are relaxed once. ``floor``: the jobs held at
    their levels."""

    def step(base: np.ndarray) -> Solved | None:
        return level_lp(
            layout, capacity=capacity, gain=gain, need=need, base=base, rising=rising, floor=floor, free=True, what=what
        )

    solved = step(level)
    if solved is None:  # levels carried over a hair too high: relax them once
        level = level * (1 - 1e3 * _SLACK)
        solved = step(level)
    if solved is not None:
        return solved, level
    raise RuntimeError(f"{what}: HiGHS found a water-filling step infeasible; please report this Problem")


def _absorbed(
    problem: Problem,
    layout: Layout,
    x: np.ndarray,
    *,
    gain: np.ndarray,
    level: np.ndarray,
    active: np.ndarray,
    what: str,
) -> np.ndarray:
    """The allocation at the final levels with the numerical slack absorbed (idle devices left by levels carried a
    hair low, taken up by maximising the sum of normalised throughputs above those levels); ``x`` where that LP
    has numerical trouble of its own."""
    floors = active & (level > 0)
    relative = np.where(floors, gain / np.where(floors, level, 1.0), 0.0)  # y_m / b_m: rows and objective near 1
    scaled = sp.csr_array(sp.diags_array(relative) @ layout.rate)[np.flatnonzero(floors)]
    for relax in (_SLACK, 1e2 * _SLACK, 1e4 * _SLACK):  # HiGHS may find the exact levels a hair infeasible
        blocks = [Block(-scaled, -np.full(int(floors.sum()), 1 - relax))] if floors.any() else []
        try:
            final = solve(layout, problem.capacity, -(layout.rate.T @ relative), blocks=blocks, what=what)
        except RuntimeError:  # numerical trouble in this clean-up only: keep the last step's allocation
            final = None
        if final is not None:
            return final.x
    return x


def max_min_fairness_water_filling_perf(problem: Problem) -> Allocation:
    """Heterogeneity-aware, weighted and hierarchical max-min fairness by water filling (Gavel §4.1).

    Normalised throughput ``y_m(X) = sum_k T_mk X_mk / T_m^eq`` (``T^eq`` as in :func:`max_min_fairness_perf`).
    Entities e (``Problem.entities``) of weight ``W_e`` share the cluster; a job's share is its entity's weight
    split over the entity's *rising* jobs by job weight: ``omega_m = W_e w_m / sum_{rising j in e} w_j``. With
    every job's level ``b_m = 0`` and every runnable job rising, repeat:

        maximise    t
        subject to  y_m(X) >= b_m + t * omega_m / s_m     for rising m
                    y_j(X) >= b_j                          for frozen j
                    (base constraints)

    then raise the rising levels ``b_m += t* omega_m / s_m`` and freeze the rising jobs whose row has a positive
    dual. By LP duality (``sum_m lambda_m (y_m - b_m) <= 0`` for every feasible X at the new levels) such a job
    cannot rise without another falling, and the duals' weights sum to 1, so every step freezes at least one
    job (``t`` is a free variable, so that this holds at ``t* = 0`` too). A job already at its speed with the
    cluster to itself is frozen as well. When all are frozen, no job can rise, so no device type is idle while a
    job that can run on it has time left (``sum_k X_mk < 1``), which the single max-min LP does not ensure. A
    last LP, ``maximise sum_m y_m(X) / b_m`` subject to ``y(X) >= b``, changes nothing in exact arithmetic and
    absorbs the solver's ~1e-9 slack that could otherwise leave a sliver of a device idle. Gavel decides the
    freezing with a big-M MILP instead; the duals need no extra solve.

    Example:
        >>> p = Problem((1, 2, 3), ("v100",), [[1.0]] * 3, [1, 1, 1], [2], entities=[0, 1, 1])
        >>> max_min_fairness_water_filling_perf(p).fractions.round(6).ravel().tolist()  # half per entity
        [1.0, 0.5, 0.5]
    """
    if problem.jobs == 0:
        return Allocation((), np.zeros((0, len(problem.device_types))))
    return _water_fill(problem, problem.throughputs, "max_min_fairness_water_filling_perf")


def max_min_fairness_water_filling(problem: Problem) -> Allocation:
    """Heterogeneity-agnostic water filling (Gavel's ``max_min_fairness_water_filling``):
    :func:`max_min_fairness_water_filling_perf` with every throughput taken as 1 where the job can run, so
    levels are weighted device-time shares. It keeps the no-idle-device property.

    Example:
        >>> p = Problem((1, 2, 3, 4), ("v100",), [[1.0]] * 4, [1] * 4, [2], entities=[0, 0, 1, 1],
        ...             entity_weights={0: 3.0, 1: 1.0})
        >>> max_min_fairness_water_filling(p).fractions.round(6).ravel().tolist()  # entity 0 gets 3/4
        [0.75, 0.75, 0.25, 0.25]
    """
    if problem.jobs == 0:
        return Allocation((), np.zeros((0, len(problem.device_types))))
    return _water_fill(problem, ones_where_runnable(problem.throughputs), "max_min_fairness_water_filling")
