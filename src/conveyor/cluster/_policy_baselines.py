"""Baselines without an optimiser: FIFO, Gandiva-style time slicing with packing, and the isolated share."""

from __future__ import annotations

import numpy as np

from conveyor.cluster._policy_lp import finish, isolated_shares, packed_layout, singles_layout
from conveyor.cluster._problem import Allocation, Problem

__all__ = ["fifo", "fifo_perf", "gandiva", "isolated"]


def _empty(problem: Problem) -> Allocation:
    return Allocation((), np.zeros((0, len(problem.device_types))))


def _fifo(problem: Problem, fastest: bool) -> Allocation:
    t, s = problem.throughputs, problem.scale_factors
    free = problem.capacity.astype(float).copy()
    x = np.zeros(t.shape)
    ever = (t > 0) & (problem.capacity[None, :] >= s[:, None])  # where each job fits in the empty cluster
    for m in np.lexsort((np.arange(problem.jobs), problem.arrival_s)):
        if not ever[m].any():
            continue  # it could never run: it must not hold up the queue
        fits = ever[m] & (free >= s[m])
        if not fits.any():
            break  # first come, first served: nobody overtakes the head of the queue
        k = int(np.argmax(np.where(fits, t[m], -np.inf))) if fastest else int(np.argmax(fits))
        x[m, k] = 1.0
        free[k] -= s[m]
    return finish(problem, singles_layout(problem), x)


def fifo(problem: Problem) -> Allocation:
    """First come, first served, heterogeneity-agnostic: in order of ``arrival_s`` (then row), each job takes
    ``s_m`` whole devices (``X_mk = 1``) of the first type in ``device_types`` order that can run it and has
    them free; the first job that fits nowhere stops the queue (no backfilling). A job that would not fit even
    in the empty cluster is skipped instead, so it cannot block the queue forever.

    A fixed type order (Gavel picks a random free type) keeps the answer deterministic and stable from one
    round to the next.

    Example:
        >>> p = Problem((1, 2, 3), ("k80", "v100"), [[1.0, 3.0]] * 3, [1, 2, 1], [1, 2], arrival_s=[0, 1, 2])
        >>> fifo(p).fractions.tolist()  # job 1 on the K80, job 2 on both V100s, job 3 waits
        [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    """
    if problem.jobs == 0:
        return _empty(problem)
    return _fifo(problem, fastest=False)


def fifo_perf(problem: Problem) -> Allocation:
    """Heterogeneity-aware FIFO: as :func:`fifo`, but each job takes the free type on which it is fastest.

    Example:
        >>> p = Problem((1, 2, 3), ("k80", "v100"), [[1.0, 3.0]] * 3, [1, 2, 1], [1, 2], arrival_s=[0, 1, 2])
        >>> fifo_perf(p).fractions.tolist()  # job 1 takes a V100; job 2 (2 devices) fits nowhere and stops the queue
        [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    """
    if problem.jobs == 0:
        return _empty(problem)
    return _fifo(problem, fastest=True)


def _pairs(problem: Problem, allowed: dict[tuple[int, ...], np.ndarray]) -> list[tuple[int, int]]:
    """Greedy pairing: pairs whose co-located throughputs, relative to each job's own and averaged over the types
    both can use, sum above 1 (time slicing the two gives 1), best first, each job in one pair at most."""
    t = problem.throughputs
    scored = []
    for (i, j), values in problem.pair_throughputs.items():
        ok = allowed[(i, j)]
        if not ok.any():
            continue
        v = np.asarray(values, dtype=float)[ok]
        gain = float(np.mean(v[:, 0] / t[i, ok] + v[:, 1] / t[j, ok]))
        if gain > 1.0:
            scored.append((-gain, i, j))
    taken: set[int] = set()
    chosen = []
    for _, i, j in sorted(scored):
        if i not in taken and j not in taken:
            taken |= {i, j}
            chosen.append((i, j))
    return chosen


def gandiva(problem: Problem) -> Allocation:
    """A Gandiva-style baseline (Xiao et al., OSDI'18, as Gavel simulates it), heterogeneity-agnostic: time
    slicing of equal shares of every type, and space sharing when the cluster is oversubscribed.

    Units are the single jobs, and, when the jobs ask for more devices than the cluster has
    (``sum_m s_m > sum_k c_k``), the pairs of ``Problem.pair_throughputs`` that a greedy pass picks: best
    first by ``g = mean_k (T'_ik / T_ik + T'_jk / T_jk)`` (co-located over alone, averaged over the types
    both can use, blind to which is faster), only if ``g > 1`` (better than time slicing the two), each job
    in one pair at most. Gavel pairs jobs at random and keeps pairs across rounds; this is stateless. With U
    units, unit u gets ``x_uk = (c_k / U) / s_u`` of every type it can run on, its row scaled to sum <= 1.

    Example:
        >>> pair = {(0, 1): np.array([[0.8, 0.8]])}
        >>> p = Problem((1, 2, 3), ("v100",), [[1.0]] * 3, [1, 1, 1], [2], pair_throughputs=pair)
        >>> a = gandiva(p)  # 3 jobs on 2 devices: jobs 1 and 2 share one, job 3 the other
        >>> a.combos, a.fractions.ravel().tolist()
        (((0,), (1,), (2,), (0, 1)), [0.0, 0.0, 1.0, 1.0])
    """
    if problem.jobs == 0:
        return _empty(problem)
    layout = packed_layout(problem)
    n = problem.jobs
    pair_allowed: dict[tuple[int, ...], np.ndarray] = {
        combo: layout.allowed[c] for c, combo in enumerate(layout.combos) if len(combo) == 2
    }
    oversubscribed = problem.scale_factors.sum() > problem.capacity.sum()
    chosen = _pairs(problem, pair_allowed) if oversubscribed else []
    paired = {i for pair in chosen for i in pair}
    index = {combo: c for c, combo in enumerate(layout.combos)}
    units = [c for c in range(n) if c not in paired] + [index[pair] for pair in chosen]
    units = [c for c in units if layout.allowed[c].any()]
    x = np.zeros(layout.allowed.shape)
    if units:
        rows = (problem.capacity[None, :] / len(units)) / layout.scale[units][:, None]
        rows = np.where(layout.allowed[units], rows, 0.0)
        x[units] = rows / np.maximum(rows.sum(axis=1, keepdims=True), 1.0)
    return finish(problem, layout, x)


def isolated(problem: Problem) -> Allocation:
    """Gavel's isolated share: every job ``x_mk = (c_k / n) / s_m`` of each type it can run on, its row scaled
    to sum <= 1 (the reference of finish-time fairness).

    Example:
        >>> isolated(Problem((1, 2), ("v100",), [[1.0], [1.0]], [1, 2], [2])).fractions.ravel().tolist()
        [1.0, 0.5]
    """
    if problem.jobs == 0:
        return _empty(problem)
    t = problem.throughputs
    return finish(problem, singles_layout(problem), isolated_shares(t, problem.scale_factors, problem.capacity))
