"""Throughput and cost policies, with deadlines (SLOs): the most normalised steps, per dollar, the least cost."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.sparse as sp  # type: ignore[import-untyped]

from conveyor.cluster._policy_lp import Block, Layout, finish, isolated_throughputs, singles_layout, solve
from conveyor.cluster._problem import Allocation, Problem
from conveyor.errors import InputError

__all__ = ["max_sum_throughput_perf", "max_throughput_per_dollar", "min_cost"]

_MISSED = 1e-7  # a phase-one shortfall (fraction of the SLO's gap) above this misses the SLO
_NOTHING = 1e-12  # a guaranteed rate below this fraction of the job's best throughput is no guarantee at all


def _empty(problem: Problem) -> Allocation:
    return Allocation((), np.zeros((0, len(problem.device_types))))


def _floor_block(layout: Layout, floors: np.ndarray) -> list[Block]:
    """Rows ``thr_m(x) >= floors_m`` for the positive floors, scaled to ``-thr_m / floor_m <= -1``."""
    rows = np.flatnonzero(floors > 0)
    if rows.size == 0:
        return []
    scaled = sp.csr_array(sp.diags_array(1.0 / floors[rows]) @ layout.rate[rows])
    return [Block(-scaled, -np.ones(rows.size))]


def _normalised(problem: Problem) -> np.ndarray:
    """``T_mk / T_m^max``: each job's throughput relative to its best type (0 for a job that runs nowhere)."""
    best = problem.throughputs.max(axis=1, keepdims=True) if problem.throughputs.size else np.zeros((0, 1))
    relative: np.ndarray = problem.throughputs / np.where(best > 0, best, 1.0)
    return relative


def _phase_one(
    problem: Problem, layout: Layout, *, required: np.ndarray, floors: np.ndarray, fallback: np.ndarray, name: str
) -> np.ndarray:
    """The SLO jobs that a least-shortfall LP has to miss: each SLO job m may fall short by a fraction
    ``u_m in [0, 1]`` of its gap ``required_m - fallback_m``; minimise ``sum_m u_m`` (an LP stand-in for the
    number of missed SLOs) with every other job at its floor."""
    soft = np.flatnonzero(required > fallback)
    hard = floors.copy()
    hard[soft] = 0.0
    gap = 1.0 - fallback[soft] / required[soft]
    scaled = sp.csr_array(sp.diags_array(1.0 / required[soft]) @ layout.rate[soft])
    shortfall = sp.csr_array((gap, (np.arange(soft.size), np.arange(soft.size))), shape=(soft.size, soft.size))
    blocks = [*_floor_block(layout, hard), Block(-scaled, -np.ones(soft.size), -shortfall)]
    bounds = np.tile([0.0, 1.0], (soft.size, 1))
    solved = solve(
        layout,
        problem.capacity,
        np.zeros(layout.size),
        blocks=blocks,
        cost_extra=np.ones(soft.size),
        bounds_extra=bounds,
        what=name,
    )
    missed = np.zeros(problem.jobs, dtype=bool)
    missed[soft] = True if solved is None else solved.extra > _MISSED
    return missed


def _with_slos(
    problem: Problem, name: str, fallback: np.ndarray, objective: Callable[[np.ndarray], np.ndarray]
) -> Allocation:
    """Optimise ``objective(floors) @ x`` with every job's throughput at least its floor: ``remaining / deadline``
    for a job with an SLO (finite ``deadline_s``), ``fallback`` for the others and for missed SLOs.

    When the SLOs cannot all be met, :func:`_phase_one` picks those to drop; the others still hold. The note
    names the dropped ones.
    """
    layout = singles_layout(problem)
    rem, deadline = problem.remaining_steps, problem.deadline_s
    if not np.isfinite(rem).all() or (rem < 0).any():
        raise InputError(f"{name}: Problem.remaining_steps must be finite and >= 0")
    slo = np.isfinite(deadline) & (rem > 0)
    missed = slo & (deadline <= 0)
    with np.errstate(divide="ignore"):
        required = np.where(slo & ~missed, rem / np.where(slo & ~missed, deadline, 1.0), 0.0)
    floors = np.where(slo & ~missed, required, fallback)
    floors = np.where(floors > _NOTHING * problem.throughputs.max(axis=1), floors, 0.0)
    solved = solve(layout, problem.capacity, objective(floors), blocks=_floor_block(layout, floors), what=name)
    dropped_all = False
    if solved is None:
        missed |= _phase_one(problem, layout, required=required, floors=floors, fallback=fallback, name=name)
        floors = np.where(missed, fallback, floors)
        for relax in (1.0, 1.0 - 1e-7):
            solved = solve(
                layout, problem.capacity, objective(floors), blocks=_floor_block(layout, floors * relax), what=name
            )
            if solved is not None:
                break
        if solved is None:  # pragma: no cover - phase one proved these floors feasible
            dropped_all, missed, floors = True, slo.copy(), fallback
            solved = solve(layout, problem.capacity, objective(floors), blocks=_floor_block(layout, floors), what=name)
    notes: tuple[str, ...] = ()
    if missed.any():
        rows = np.flatnonzero(missed)
        ids = ", ".join(str(problem.job_ids[i]) for i in rows)
        kept = "no SLO is kept" if dropped_all else "the other SLOs hold"
        if rows.size == 1:
            what = f"the SLO (deadline_s) of job {ids} cannot be met with the cluster's capacity; it runs without it"
        else:
            what = f"the SLOs (deadline_s) of jobs {ids} cannot be met with the cluster's capacity; they run without"
        notes = (f"{name}: {what} and {kept}",)
    x = np.zeros(layout.allowed.shape) if solved is None else solved.x
    return finish(problem, layout, x, notes)


def max_sum_throughput_perf(problem: Problem) -> Allocation:
    """The most total throughput, each job's steps/s normalised by its best type's:

        maximise    sum_m sum_k (T_mk / T_m^max) X_mk,      T_m^max = max_k T_mk
        subject to  sum_k X_mk <= 1,   sum_m s_m X_mk <= c_k,   X >= 0,   X_mk = 0 where T_mk = 0.

    Gavel sums raw steps/s, so jobs with many small steps dominate; normalising makes every job's full-speed
    second worth the same. Deadlines and weights are not used.

    Example:
        >>> p = Problem((1, 2), ("fast", "slow"), [[4.0, 1.0], [2.0, 1.5]], [1, 1], [1, 1])
        >>> max_sum_throughput_perf(p).fractions.round(6).tolist()  # job 2 loses least on the slow type
        [[1.0, 0.0], [0.0, 1.0]]
    """
    if problem.jobs == 0:
        return _empty(problem)
    layout = singles_layout(problem)
    solved = solve(layout, problem.capacity, -_normalised(problem).ravel(), what="max_sum_throughput_perf")
    return finish(problem, layout, np.zeros(layout.allowed.shape) if solved is None else solved.x)


def max_throughput_per_dollar(problem: Problem) -> Allocation:
    """The most normalised throughput per dollar, meeting the SLOs (Gavel's ``ThroughputNormalizedByCostSum``
    with SLOs):

        maximise    sum_m sum_k (T_mk / T_m^max) X_mk / price_k
        subject to  thr_m(X) = sum_k T_mk X_mk >= R_m / D_m      for every job m with a finite deadline D_m
                    sum_k X_mk <= 1,   sum_m s_m X_mk <= c_k,   X >= 0,   X_mk = 0 where T_mk = 0.

    As in Gavel, the price is per device (not per job's ``s_m`` devices). If the SLOs cannot all be met, an LP
    that minimises the summed fractions by which SLOs fall short picks those to drop; the others still hold,
    and a note names the dropped jobs.

    Example:
        >>> p = Problem((1, 2), ("v100", "k80"), [[2.0, 1.0], [1.0, 1.0]], [1, 1], [1, 1], prices=[3.0, 1.0],
        ...             remaining_steps=[100, 100], deadline_s=[100, 1])
        >>> a = max_throughput_per_dollar(p)  # job 2 would need 100 steps/s; the K80 is worth more to it
        >>> a.fractions.round(6).tolist()
        [[1.0, 0.0], [0.0, 1.0]]
        >>> print(a.notes[0])  # doctest: +NORMALIZE_WHITESPACE
        max_throughput_per_dollar: the SLO (deadline_s) of job 2 cannot be met with the cluster's capacity; it
        runs without it and the other SLOs hold
    """
    if problem.jobs == 0:
        return _empty(problem)
    prices = problem.prices
    if (prices <= 0).any() or not np.isfinite(prices).all():
        raise InputError(
            "max_throughput_per_dollar: Problem.prices must be finite and positive (dollars per "
            "device-hour of each type)"
        )
    per_dollar = (_normalised(problem) / prices[None, :]).ravel()
    return _with_slos(problem, "max_throughput_per_dollar", np.zeros(problem.jobs), lambda floors: -per_dollar)


def min_cost(problem: Problem) -> Allocation:
    """The least dollars to finish every job, each at a guaranteed rate:

        minimise    sum_m (R_m / rho_m) * sum_k price_k s_m X_mk
        subject to  thr_m(X) = sum_k T_mk X_mk >= rho_m     for every job m with steps left
                    sum_k X_mk <= 1,   sum_m s_m X_mk <= c_k,   X >= 0,   X_mk = 0 where T_mk = 0

    with ``rho_m = R_m / D_m`` for a job with a finite deadline D_m (its SLO) and, for the others, the
    throughput of Gavel's isolated allocation (a 1/n share of the cluster), so that no job starves.
    ``R_m / rho_m`` is the job's duration at its guaranteed rate, ``sum_k price_k s_m X_mk`` its dollars per
    hour. If the SLOs cannot all be met, an LP that minimises the summed fractions of the SLOs' gaps above
    the isolated rate that fall short picks those to drop (they get the isolated rate; the other SLOs hold),
    and a note names them.

    Example:
        >>> p = Problem((1,), ("v100", "k80"), [[4.0, 1.0]], [1], [1, 1], prices=[3.0, 1.0],
        ...             remaining_steps=[100], deadline_s=[200])
        >>> min_cost(p).fractions.round(6).tolist()  # 0.5 steps/s: 1/8 of a V100 ($0.375/h) beats 1/2 a K80
        [[0.125, 0.0]]
    """
    if problem.jobs == 0:
        return _empty(problem)
    prices = problem.prices
    if (prices < 0).any() or not np.isfinite(prices).all():
        raise InputError("min_cost: Problem.prices must be finite and >= 0 (dollars per device-hour of each type)")
    iso = isolated_throughputs(problem.throughputs, problem.scale_factors, problem.capacity)
    rem = problem.remaining_steps
    fallback = np.where(rem > 0, iso, 0.0)
    dollars = prices[None, :] * problem.scale_factors[:, None]

    def objective(floors: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            duration = np.where(floors > 0, rem / floors, 0.0)
        cost = duration[:, None] * dollars
        top = cost.max() if cost.size else 0.0
        scaled: np.ndarray = (cost / top if top > 0 else cost).ravel()
        return scaled

    return _with_slos(problem, "min_cost", fallback, objective)
