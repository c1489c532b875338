"""Completion-time policies: finish-time fairness (Themis) and the least makespan."""

from __future__ import annotations

import numpy as np

from conveyor.cluster._policy_lp import (
    finish,
    isolated_shares,
    level_lp,
    mean_where_runnable,
    singles_layout,
)
from conveyor.cluster._problem import Allocation, Problem
from conveyor.errors import InputError

__all__ = [
    "finish_time_fairness",
    "finish_time_fairness_perf",
    "finish_time_ratios",
    "min_total_duration",
    "min_total_duration_perf",
]

_ROUNDS = 60  # Dinkelbach-type steps at most (they converge superlinearly: a handful suffice)


def _empty(problem: Problem) -> Allocation:
    return Allocation((), np.zeros((0, len(problem.device_types))))


def _check_times(problem: Problem, name: str) -> None:
    if not np.isfinite(problem.remaining_steps).all() or (problem.remaining_steps < 0).any():
        raise InputError(f"{name}: Problem.remaining_steps must be finite and >= 0")
    if not np.isfinite(problem.elapsed_s).all() or (problem.elapsed_s < 0).any():
        raise InputError(f"{name}: Problem.elapsed_s must be finite and >= 0")


def finish_time_ratios(problem: Problem, throughputs: np.ndarray, thr: np.ndarray) -> np.ndarray:
    """``(jobs,)`` Themis' ``rho_m = (elapsed_m + remaining_m / thr_m) / (elapsed_m + remaining_m / thr_m^iso)``
    of jobs running at ``thr`` steps/s, with ``thr^iso`` the isolated (1/n-share) throughput under
    ``throughputs``; ``nan`` for jobs with nothing left or no isolated throughput, ``inf`` for a stalled job.

    Example:
        >>> p = Problem((1, 2), ("v100",), [[1.0], [1.0]], [1, 1], [1], remaining_steps=[10, 10], elapsed_s=[0, 30])
        >>> finish_time_ratios(p, p.throughputs, np.array([0.5, 0.5])).tolist()  # the isolated shares: 1
        [1.0, 1.0]
    """
    iso = (throughputs * isolated_shares(throughputs, problem.scale_factors, problem.capacity)).sum(axis=1)
    rem, elapsed = problem.remaining_steps, problem.elapsed_s
    active = (rem > 0) & (iso > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        own = elapsed + np.where(thr > 0, rem / thr, np.inf)
        alone = elapsed + rem / iso
        return np.where(active, own / alone, np.nan)


def _ftf(problem: Problem, throughputs: np.ndarray, name: str) -> Allocation:
    _check_times(problem, name)
    layout = singles_layout(problem, throughputs)
    x = isolated_shares(throughputs, problem.scale_factors, problem.capacity)
    iso = (throughputs * x).sum(axis=1)
    rem, elapsed = problem.remaining_steps, problem.elapsed_s
    active = (rem > 0) & (iso > 0)
    if not active.any():
        return finish(problem, layout, x)
    alone = np.where(active, elapsed + rem / np.where(active, iso, 1.0), 1.0)  # E_m
    thr = iso
    rho = 1.0  # the isolated allocation's ratios are all 1
    for _ in range(_ROUNDS):
        # rows divided by E_m thr_m(X^i) > 0: (rho - e_m / E_m) / thr_m(X^i) * thr_m(X) >= R_m / (E_m thr_m(X^i)) + t
        scale = np.where(active, 1.0 / (alone * np.where(active, thr, 1.0)), 0.0)
        gain, base = (rho * alone - elapsed) * scale, rem * scale
        need = active.astype(float)
        solved = level_lp(
            layout, capacity=problem.capacity, gain=gain, need=need, base=base, rising=active, free=True, what=name
        )
        if solved is None or solved.extra[0] <= 1e-12:
            break
        new_thr = layout.rate @ solved.x.ravel()
        new_rho = float(np.nanmax(finish_time_ratios(problem, throughputs, new_thr)))
        if new_rho >= rho:
            break
        x, thr, progress, rho = solved.x, new_thr, rho - new_rho, new_rho
        if progress <= 1e-12 * rho:
            break
    return finish(problem, layout, x)


def finish_time_fairness_perf(problem: Problem) -> Allocation:
    """Heterogeneity-aware finish-time fairness (Themis, as in Gavel): minimise the largest ratio of a job's
    finish time under the allocation to its finish time with a 1/n share of the cluster.

    With ``thr_m(X) = sum_k T_mk X_mk``, ``thr_m^iso`` the throughput of Gavel's isolated allocation
    (``x_mk = (c_k / n) / s_m``, rows scaled to sum <= 1), elapsed ``e_m``, remaining steps ``R_m`` and
    ``E_m = e_m + R_m / thr_m^iso``:

        minimise    max_m rho_m(X),   rho_m(X) = (e_m + R_m / thr_m(X)) / E_m = (e_m thr_m(X) + R_m) / (E_m thr_m(X))
        subject to  sum_k X_mk <= 1,   sum_m s_m X_mk <= c_k,   X >= 0,   X_mk = 0 where T_mk = 0.

    Each ``rho_m`` is a ratio of two affine functions of X, so this is a generalised fractional program, solved
    exactly by the Dinkelbach-type method of Crouzeix, Ferland and Schaible: from the isolated allocation
    (``rho = 1``), with ``X^i`` the current allocation and ``rho^i`` its largest ratio, solve the LP

        maximise    t
        subject to  (rho^i E_m - e_m) thr_m(X) >= R_m + t E_m thr_m(X^i)     for every job m

    and take its X as the next allocation; ``t* > 0`` as long as ``rho^i`` is not optimal, and the ratios fall
    superlinearly. Jobs with no remaining steps, or no isolated throughput, are left out. Weights are not used
    (Gavel's neither).

    Example:
        >>> p = Problem((1, 2), ("a", "b"), [[4.0, 1.0], [1.0, 4.0]], [1, 1], [1, 1], remaining_steps=[20, 20],
        ...             elapsed_s=[10, 0])
        >>> a = finish_time_fairness_perf(p)  # each job on its fast type: rho = (10 + 20/4) / (10 + 20/2.5)
        >>> round(float(np.nanmax(finish_time_ratios(p, p.throughputs, a.effective_throughputs(p)))), 6)
        0.833333
    """
    if problem.jobs == 0:
        return _empty(problem)
    return _ftf(problem, problem.throughputs, "finish_time_fairness_perf")


def finish_time_fairness(problem: Problem) -> Allocation:
    """Heterogeneity-agnostic finish-time fairness: :func:`finish_time_fairness_perf` on a view of the problem
    in which every job runs at its mean throughput (over the types it can run on) on every such type. Gavel
    instead copies the V100 throughput to every type; the mean needs no reference type and keeps every
    job's view finite where it can run.

    Example:
        >>> p = Problem((1, 2), ("a", "b"), [[4.0, 1.0], [1.0, 4.0]], [1, 1], [1, 1])
        >>> finish_time_fairness(p).fractions.sum(axis=1).round(6).tolist()  # blind to speed: whole time each
        [1.0, 1.0]
    """
    if problem.jobs == 0:
        return _empty(problem)
    return _ftf(problem, mean_where_runnable(problem.throughputs), "finish_time_fairness")


def _makespan(problem: Problem, throughputs: np.ndarray, name: str) -> Allocation:
    _check_times(problem, name)
    layout = singles_layout(problem, throughputs)
    x = isolated_shares(throughputs, problem.scale_factors, problem.capacity)
    iso = (throughputs * x).sum(axis=1)
    active = (problem.remaining_steps > 0) & (iso > 0)
    if not active.any():
        return finish(problem, layout, x)
    alone = np.where(active, problem.remaining_steps / np.where(active, iso, 1.0), 0.0)  # R_m / thr_m^iso
    gain = np.where(active, 1.0 / np.where(active, iso, 1.0), 0.0)
    need = alone / alone.max()  # the isolated allocation reaches t = 1
    solved = level_lp(
        layout, capacity=problem.capacity, gain=gain, need=need, base=np.zeros(problem.jobs), rising=active, what=name
    )
    return finish(problem, layout, x if solved is None else solved.x)


def min_total_duration_perf(problem: Problem) -> Allocation:
    """Heterogeneity-aware least makespan: let the last of the jobs finish as early as possible at the
    allocation's rates.

        minimise    max_m R_m / thr_m(X)     ==     maximise  t  subject to  thr_m(X) >= t R_m  for every job m
        subject to  sum_k X_mk <= 1,   sum_m s_m X_mk <= c_k,   X >= 0,   X_mk = 0 where T_mk = 0

    with ``R_m`` the remaining steps and ``thr_m(X) = sum_k T_mk X_mk``: one LP (Gavel bisects on the
    makespan instead). Jobs with nothing left or no usable type are left out.

    Example:
        >>> p = Problem((1, 2, 3), ("fast", "slow"), [[4.0, 1.0], [2.0, 1.0], [2.0, 1.0]], [1, 1, 1], [1, 1])
        >>> a = min_total_duration_perf(p)
        >>> round(float(max(p.remaining_steps / a.effective_throughputs(p))), 6)  # 1 / 1.2 by hand
        0.833333
    """
    if problem.jobs == 0:
        return _empty(problem)
    return _makespan(problem, problem.throughputs, "min_total_duration_perf")


def min_total_duration(problem: Problem) -> Allocation:
    """Heterogeneity-agnostic least makespan: :func:`min_total_duration_perf` on the view in which every job
    runs at its mean throughput on every type it can run on (see :func:`finish_time_fairness`).

    Example:
        >>> p = Problem((1, 2), ("v100",), [[2.0], [1.0]], [1, 1], [1], remaining_steps=[2, 2])
        >>> min_total_duration(p).fractions.round(6).ravel().tolist()  # thr 2 x0 = thr 1 x1: 1/3 and 2/3
        [0.333333, 0.666667]
    """
    if problem.jobs == 0:
        return _empty(problem)
    return _makespan(problem, mean_where_runnable(problem.throughputs), "min_total_duration")
