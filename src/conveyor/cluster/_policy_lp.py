"""The policies' shared linear-programming layer: variable layouts, reference shares, HiGHS calls, repairs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp  # type: ignore[import-untyped]
from scipy.optimize import linprog  # type: ignore[import-untyped]

from conveyor.cluster._problem import Allocation, Problem
from conveyor.errors import InputError

__all__ = [
    "Block",
    "Layout",
    "Solved",
    "equal_share_throughputs",
    "finish",
    "isolated_shares",
    "isolated_throughputs",
    "level_lp",
    "mean_where_runnable",
    "ones_where_runnable",
    "packed_layout",
    "singles_layout",
    "solve",
]


@dataclass(frozen=True)
class Layout:
    """The allocation variables of an LP: ``x[c * types + k]`` is the time share of combination c on type k.

    Attributes:
        combos: the combinations (tuples of row indices), as in :class:`Allocation`.
        first: ``(combos,)`` the first job of each combination.
        second: ``(combos,)`` the second job of each pair, the first again for a single job.
        scale: ``(combos,)`` devices a combination holds.
        allowed: ``(combos, types)`` where a share may be positive (every member can run there).
        time: ``(jobs, combos * types)`` sparse: ``time @ x`` is each job's share of time.
        rate: ``(jobs, combos * types)`` sparse: ``rate @ x`` is each job's steps/s.
        usage: ``(types, combos * types)`` sparse: ``usage @ x`` is the devices of each type in use.
    """

    combos: tuple[tuple[int, ...], ...]
    first: np.ndarray
    second: np.ndarray
    scale: np.ndarray
    allowed: np.ndarray
    time: sp.csr_array
    rate: sp.csr_array
    usage: sp.csr_array

    @property
    def size(self) -> int:
        return int(self.allowed.size)


def _matrix(rows: np.ndarray, cols: np.ndarray, values: np.ndarray, shape: tuple[int, int]) -> sp.csr_array:
    return sp.csr_array((np.asarray(values, dtype=float), (rows, cols)), shape=shape)


def singles_layout(problem: Problem, throughputs: np.ndarray | None = None) -> Layout:
    """One variable per (job, type), no space sharing; ``throughputs`` replaces the problem's (agnostic views).

    Example:
        >>> p = Problem((7, 8), ("a", "b"), [[1.0, 0.0], [2.0, 3.0]], [1, 2], [1, 4])
        >>> lay = singles_layout(p)
        >>> lay.allowed.tolist(), lay.usage.toarray().tolist()
        ([[True, False], [True, True]], [[1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 0.0, 2.0]])
    """
    t = problem.throughputs if throughputs is None else throughputs
    n, m = t.shape
    cols = np.arange(n * m)
    jobs = np.repeat(np.arange(n), m)
    return Layout(
        combos=tuple((i,) for i in range(n)),
        first=np.arange(n),
        second=np.arange(n),
        scale=problem.scale_factors.astype(float),
        allowed=problem.throughputs > 0,
        time=_matrix(jobs, cols, np.ones(n * m), (n, n * m)),
        rate=_matrix(jobs, cols, t.ravel(), (n, n * m)),
        usage=_matrix(np.tile(np.arange(m), n), cols, np.repeat(problem.scale_factors, m), (m, n * m)),
    )


def packed_layout(problem: Problem) -> Layout:
    """Single jobs (combinations ``0..jobs-1``) then every pair of ``problem.pair_throughputs``.

    A pair holds its (common) scale factor of devices once for both jobs, and may run on a type only where both
    jobs can run alone and both make progress together.

    Raises:
        ValueError: a pair that is not ``(i, j)`` with ``i < j`` of equal scale factors, or whose throughput array
            is not ``(types, 2)`` of finite non-negative numbers.
    """
    n, m = problem.throughputs.shape
    singles = singles_layout(problem)
    pairs = sorted(problem.pair_throughputs)
    if not pairs:
        return singles
    first = np.array([i for i, _ in pairs], dtype=int)
    second = np.array([j for _, j in pairs], dtype=int)
    values = np.array([np.asarray(problem.pair_throughputs[p], dtype=float) for p in pairs])
    if values.shape != (len(pairs), m, 2) or not np.isfinite(values).all() or (values < 0).any():
        raise InputError(f"Problem.pair_throughputs: give each pair a finite, non-negative ({m}, 2) array")
    if ((first < 0) | (first >= second) | (second >= n)).any():
        raise InputError(f"Problem.pair_throughputs: keys must be row-index pairs (i, j) with 0 <= i < j < {n}")
    if (problem.scale_factors[first] != problem.scale_factors[second]).any():
        raise InputError("Problem.pair_throughputs: only jobs with equal scale factors may share devices")
    t = problem.throughputs
    allowed = (t[first] > 0) & (t[second] > 0) & (values > 0).all(axis=2)
    p = len(pairs)
    cols = n * m + np.arange(p * m)
    size = (n + p) * m
    pair_rows = np.concatenate([np.repeat(first, m), np.repeat(second, m)])
    pair_cols = np.concatenate([cols, cols])
    rate = _matrix(pair_rows, pair_cols, np.concatenate([values[:, :, 0].ravel(), values[:, :, 1].ravel()]), (n, size))
    usage = _matrix(np.tile(np.arange(m), p), cols, np.repeat(problem.scale_factors[first], m), (m, size))
    return Layout(
        combos=singles.combos + tuple((int(i), int(j)) for i, j in pairs),
        first=np.concatenate([singles.first, first]),
        second=np.concatenate([singles.second, second]),
        scale=np.concatenate([singles.scale, problem.scale_factors[first].astype(float)]),
        allowed=np.vstack([singles.allowed, allowed]),
        time=sp.hstack(
            [singles.time, _matrix(pair_rows, pair_cols - n * m, np.ones(2 * p * m), (n, p * m))], format="csr"
        ),
        rate=sp.hstack([singles.rate, rate[:, n * m :]], format="csr"),
        usage=sp.hstack([singles.usage, usage[:, n * m :]], format="csr"),
    )


def ones_where_runnable(throughputs: np.ndarray) -> np.ndarray:
    """The heterogeneity-agnostic view of LAS: 1 wherever a job can run, 0 elsewhere."""
    return (throughputs > 0).astype(float)


def mean_where_runnable(throughputs: np.ndarray) -> np.ndarray:
    """The heterogeneity-agnostic view of the time-based policies: each job's mean throughput over the types
    it can run on, wherever it can run (0 elsewhere)."""
    runnable = throughputs > 0
    count = np.maximum(runnable.sum(axis=1, keepdims=True), 1)
    return np.where(runnable, throughputs.sum(axis=1, keepdims=True) / count, 0.0)


def equal_share_throughputs(throughputs: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """``(jobs,)`` Gavel's "proportional" reference ``T_m^eq = sum_k T_mk x_k`` with ``x_k = (c_k / n) / max row
    sum``; every row being ``c / n``, this is ``x_k = c_k / sum(c)``.

    Example:
        >>> equal_share_throughputs(np.array([[4.0, 1.0], [2.0, 1.0]]), np.array([1.0, 1.0])).tolist()
        [2.5, 1.5]
    """
    total = float(capacity.sum())
    if throughputs.shape[0] == 0 or total <= 0:
        return np.zeros(throughputs.shape[0])
    return throughputs @ (capacity / total)


def isolated_shares(throughputs: np.ndarray, scale_factors: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """``(jobs, types)`` Gavel's "isolated" allocation, a 1/n share of the cluster: ``x_mk = (c_k / n) / s_m``,
    rows divided by ``max(1, row sum)``, and 0 where the job cannot run (that share would be wasted anyway)."""
    n = throughputs.shape[0]
    if n == 0:
        return np.zeros_like(throughputs)
    x = (capacity[None, :] / n) / scale_factors[:, None].astype(float)
    x = x / np.maximum(x.sum(axis=1, keepdims=True), 1.0)
    return np.where(throughputs > 0, x, 0.0)


def isolated_throughputs(throughputs: np.ndarray, scale_factors: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """``(jobs,)`` each job's steps/s under :func:`isolated_shares`.

    Example:
        >>> isolated_throughputs(np.array([[4.0, 1.0], [2.0, 1.0]]), np.array([1, 2]), np.array([1.0, 1.0]))
        array([2.5 , 0.75])
    """
    rates: np.ndarray = (throughputs * isolated_shares(throughputs, scale_factors, capacity)).sum(axis=1)
    return rates


@dataclass(frozen=True)
class Block:
    """Rows ``a_x @ x + a_extra @ extra <= upper`` of an LP (``a_extra`` None: no extra columns used)."""

    a_x: sp.csr_array
    upper: np.ndarray
    a_extra: sp.csr_array | np.ndarray | None = None


@dataclass(frozen=True)
class Solved:
    """An LP's optimum: ``x`` as ``(combos, types)``, the extra variables, and each block's duals (>= 0, the
    objective's loss per unit of tightening, for a minimisation)."""

    x: np.ndarray
    extra: np.ndarray
    duals: tuple[np.ndarray, ...]
    objective: float


def solve(
    layout: Layout,
    capacity: np.ndarray,
    cost_x: np.ndarray,
    *,
    blocks: Sequence[Block] = (),
    cost_extra: np.ndarray | None = None,
    bounds_extra: np.ndarray | None = None,
    what: str = "policy",
) -> Solved | None:
    """Minimise ``cost_x @ x + cost_extra @ extra`` over the base constraints (``0 <= x``, ``x = 0`` where not
    allowed, each job's time <= 1, each type's devices <= capacity) and ``blocks``, with HiGHS.

    Returns:
        The optimum, or None when the LP is infeasible.

    Raises:
        RuntimeError: HiGHS failed otherwise (unbounded, numerical trouble).
    """
    size = layout.size
    extra = 0 if cost_extra is None else len(cost_extra)
    jobs = layout.time.shape[0]

    def padded(a_x: sp.csr_array, a_extra: sp.csr_array | np.ndarray | None) -> sp.csr_array:
        if extra == 0:
            return a_x
        right = sp.csr_array((a_x.shape[0], extra)) if a_extra is None else sp.csr_array(a_extra)
        return sp.hstack([a_x, right], format="csr")

    all_blocks = [Block(layout.time, np.ones(jobs)), Block(layout.usage, capacity.astype(float)), *blocks]
    a_ub = sp.vstack([padded(b.a_x, b.a_extra) for b in all_blocks], format="csc")
    b_ub = np.concatenate([np.asarray(b.upper, dtype=float) for b in all_blocks])
    bounds = np.zeros((size + extra, 2))
    bounds[:size, 1] = np.where(layout.allowed.ravel(), np.inf, 0.0)
    if extra:
        bounds[size:] = np.array([[0.0, np.inf]] * extra) if bounds_extra is None else bounds_extra
    cost = np.concatenate([cost_x, [] if cost_extra is None else cost_extra])
    # HiGHS' interior point (with crossover to a vertex) is several times faster than its simplex on these
    # LPs (2048 jobs: 0.1 s against 0.6 s); the dual simplex is the fallback when it stalls.
    for method in ("highs-ipm", "highs-ds"):
        result = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method=method)
        if result.status in (0, 2):
            break
    if result.status == 2:
        return None
    if result.status != 0:
        raise RuntimeError(
            f"HiGHS could not solve the {what} LP ({result.message}); check that the Problem's "
            "throughputs, capacities and deadlines are finite and within a few orders of magnitude"
        )
    marginals = -np.asarray(result.ineqlin.marginals)
    edges = np.cumsum([0] + [len(b.upper) for b in all_blocks])
    duals = tuple(marginals[edges[i] : edges[i + 1]] for i in range(2, len(all_blocks)))
    x = np.asarray(result.x)
    return Solved(x[:size].reshape(layout.allowed.shape), x[size:], duals, float(result.fun))


def level_lp(
    layout: Layout,
    *,
    capacity: np.ndarray,
    gain: np.ndarray,
    need: np.ndarray,
    base: np.ndarray,
    rising: np.ndarray,
    floor: np.ndarray | None = None,
    free: bool = False,
    what: str = "policy",
) -> Solved | None:
    """The max-min LP: maximise ``t`` subject to ``gain_m * thr_m(x) >= base_m + need_m * t`` for the jobs in
    ``rising`` and ``gain_m * thr_m(x) >= base_m`` for those in ``floor``, with ``thr = rate @ x``.

    ``t`` is non-negative unless ``free``. The duals of the ``rising`` rows come back in ``duals[0]``
    (one per job, 0 outside ``rising``).
    """
    jobs = layout.time.shape[0]
    rows = np.flatnonzero(rising)
    # each row divided by its largest right-hand coefficient, so that rows of very different jobs stay near 1
    size = np.maximum(np.abs(base), np.where(rising, np.abs(need), 0.0))
    row_scale = 1.0 / np.where(size > 0, size, 1.0)
    scaled = sp.csr_array(sp.diags_array(gain * row_scale) @ layout.rate)
    blocks = [Block(-scaled[rows], -(base * row_scale)[rows], (need * row_scale)[rows].reshape(-1, 1))]
    if floor is not None and (fixed := np.flatnonzero(floor & ~rising)).size:
        blocks.append(Block(-scaled[fixed], -(base * row_scale)[fixed]))
    bounds = np.array([[-np.inf if free else 0.0, np.inf]])
    solved = solve(
        layout,
        capacity,
        np.zeros(layout.size),
        blocks=blocks,
        cost_extra=np.array([-1.0]),
        bounds_extra=bounds,
        what=what,
    )
    if solved is None:
        return None
    duals = np.zeros(jobs)
    duals[rows] = solved.duals[0] * row_scale[rows]
    return Solved(solved.x, solved.extra, (duals,), -solved.objective)


def finish(problem: Problem, layout: Layout, x: np.ndarray, notes: tuple[str, ...] = ()) -> Allocation:
    """The allocation of ``x``, repaired to satisfy the constraints exactly: negatives and disallowed shares to
    0, a job's combinations scaled down if its time exceeds 1, a type's shares scaled down if over capacity
    (LP solvers meet constraints only to about 1e-7)."""
    x = np.where(layout.allowed, np.maximum(x, 0.0), 0.0)
    time = layout.time @ x.ravel()
    shrink = 1.0 / np.maximum(time, 1.0)
    x = x * np.minimum(shrink[layout.first], shrink[layout.second])[:, None]
    used = layout.scale @ x
    x = x * np.where(used > problem.capacity, problem.capacity / np.where(used > 0, used, 1.0), 1.0)[None, :]
    return Allocation(layout.combos, x, notes)
