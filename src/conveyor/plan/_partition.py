"""The planner's dynamic program: best pipelines over layer ranges and unit counts, level by level.

See :mod:`conveyor.plan._optimizer` for the recursion and :mod:`conveyor.plan._cost_model` for its terms.
Memory enters through the warm-up of each stage, which depends on the workers after it
(:mod:`conveyor.plan._memory`). The recursion therefore runs from the back: a pipeline over ``[i, j)`` on
``m`` units is one stage, or a first stage ``[i, s)`` on ``m'`` units followed by a best pipeline over
``[s, j)`` on ``m - m'`` units, all of which are downstream of the first stage.

An inner level's pipelines are copied ``m'`` times by a stage of the level above, and workers of later
outer stages follow them. Per copy, that is ``extra = (m - m') * unit / m'`` more downstream workers,
which the innermost level solves for on a grid of values (rounded up, so plans always fit); with more
than two levels the inner levels assume the whole cluster is downstream.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from conveyor.plan._cuts import Cuts
from conveyor.plan._memory import layer_stash_bytes, worker_bytes
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology

__all__ = ["MemoryModel", "Partition", "StageCost", "extras_grid", "solve", "stages"]

_TIE = 1e-9  # relative difference under which two pipelines' times count as equal


class MemoryModel:
    """Which stages fit in a worker's memory under a schedule."""

    def __init__(self, profile: Profile, cuts: Cuts, limit: float, schedule: str, microbatches: int) -> None:
        self.limit, self.schedule, self.microbatches = limit, schedule, microbatches
        self.weights = cuts.prefix([lay.param_bytes for lay in profile.layers])
        self.optimizer = cuts.prefix([lay.optimizer_bytes for lay in profile.layers])
        self.stash = cuts.prefix(layer_stash_bytes(profile))

    def fits(self, first: int, stops: np.ndarray, replicas: np.ndarray, downstream: np.ndarray) -> np.ndarray:
        """``[e, len(stops), len(replicas)]``: does a stage between boundaries ``first`` and ``stop`` fit?
        ``downstream`` broadcasts to that shape (the answer is meaningless where ``first`` is not inside ``stop``,
        a stage the search never takes)."""
        w = (self.weights[stops] - self.weights[first])[None, :, None]
        o = (self.optimizer[stops] - self.optimizer[first])[None, :, None]
        a = (self.stash[stops] - self.stash[first])[None, :, None]
        need = worker_bytes(
            self.schedule,
            replicas=replicas[None, None, :],
            downstream=downstream,
            microbatches=self.microbatches,
            weights=w,
            optimizer=o,
            stash=a,
        )
        return np.asarray(need <= self.limit)


@dataclass
class Partition:
    """One level's tables. ``e`` indexes the extra-downstream values of the innermost level (one value
    elsewhere); ``pick[m, m']`` is the ``e`` a first stage on ``m'`` of ``m`` units uses below it."""

    stage_s: np.ndarray  # [e_below, i, j, m]: one stage over [i, j) on m units
    best_s: np.ndarray  # [e, i, j, m]: the best pipeline
    choice: np.ndarray  # [e, i, j, m] -> (split s, units of the first stage), or (-1, -1) for one stage
    pick: np.ndarray


def extras_grid(topology: Topology, memory: MemoryModel | None) -> tuple[np.ndarray, np.ndarray]:
    """The innermost level's extra-downstream values and, for the level above, ``pick[m, m']``."""
    levels = topology.levels
    upper = levels[1].count if len(levels) > 1 else 1
    pick = np.zeros((upper + 1, upper + 1), dtype=np.int64)
    if memory is None or len(levels) == 1:
        return np.zeros(1), pick
    if len(levels) > 2:
        return np.array([float(topology.workers)]), pick
    ratios = np.array([0.0] + [2.0**k for k in range(-3, math.ceil(math.log2(upper)) + 1)])
    for m in range(2, upper + 1):
        for first in range(1, m):
            pick[m, first] = int(np.searchsorted(ratios, (m - first) / first))
    return ratios * levels[0].count, pick


def solve(
    stage_s: np.ndarray,
    count: int,
    *,
    top: bool,
    memory: MemoryModel | None,
    extras: np.ndarray,
    pick: np.ndarray | None,
) -> Partition:
    """Best pipelines over ``[i, j)`` on ``m`` units of one level.

    Args:
        stage_s: ``[e_below, i, j, m]`` time per minibatch of one stage, its links included (inf where not
            allowed).
        count: units at this level.
        top: only pipelines that end at the last layer are needed.
        memory: the memory model, at the innermost level only.
        extras: the innermost level's extra downstream workers per value of ``e`` (unused above it).
        pick: above the innermost level, the ``e`` below for a first stage on ``m'`` of ``m`` units.
    """
    n = stage_s.shape[1] - 1
    inner = pick is None
    out = len(extras) if inner else 1
    reps = np.arange(1, count + 1)
    best = np.full((out, n + 1, n + 1, count + 1), np.inf)
    depth = np.ones((out, n + 1, n + 1, count + 1), dtype=np.int64)  # stages: the fewer wins a tie
    choice = np.full((out, n + 1, n + 1, count + 1, 2), -1, dtype=np.int64)
    for j in [n] if top else range(1, n + 1):
        for i in range(j - 1, -1, -1):
            best[:, i, j, 1:] = stage_s[0, i, j, 1:]
            if memory is not None:
                alone = memory.fits(i, np.array([j]), reps, (reps[None, :] + extras[:, None])[:, None, :])
                best[:, i, j, 1:][~alone[:, 0, :]] = np.inf
            if j - i < 2:
                continue
            splits = np.arange(i + 1, j)
            for m in range(2, count + 1):
                # [e, split point s, units m' of the first stage [i, s) = 1..m-1]
                if pick is None:  # the innermost level
                    first = stage_s[0, i, splits, 1:m][None]
                else:
                    first = stage_s[pick[m, 1:m][None, :], i, splits[:, None], reps[None, : m - 1]][None]
                rest = best[:, splits, j, m - 1 : 0 : -1]
                candidates = np.maximum(first, rest)
                if memory is not None:
                    candidates[~memory.fits(i, splits, reps[: m - 1], (m + extras)[:, None, None])] = np.inf
                flat_candidates = candidates.reshape(out, -1)
                value = flat_candidates.min(axis=1)
                better = value < best[:, i, j, m] * (1 - _TIE)
                if not better.any():
                    continue
                # Among splits as fast as the best (bottlenecks often tie), the one with the fewest stages.
                ties = flat_candidates <= value[:, None] * (1 + _TIE)
                stages = np.where(ties, depth[:, splits, j, m - 1 : 0 : -1].reshape(out, -1), n + 1)
                flat = np.argmin(stages, axis=1)
                for e in np.flatnonzero(better):
                    best[e, i, j, m] = flat_candidates[e, flat[e]]
                    depth[e, i, j, m] = 1 + stages[e, flat[e]]
                    choice[e, i, j, m] = (i + 1 + flat[e] // (m - 1), 1 + flat[e] % (m - 1))
    return Partition(stage_s, best, choice, pick if pick is not None else np.zeros((1, 1), dtype=np.int64))


StageCost = Callable[[int, float, int, int, int, tuple[int, int]], np.ndarray]
"""``(level, a unit's seconds per minibatch, first boundary, last boundary, units, the boundaries of the level's
stage it lies in) -> the stage's seconds per minibatch``."""


def stages(
    levels: list[Partition], cost: StageCost, topology: Topology, k: int, i: int, j: int, m: int, e: int
) -> list[tuple[int, int, int, float]]:
    """``(first layer, last layer, replicas, seconds per minibatch)`` of the best pipeline over ``[i, j)``
    on ``m`` units of level ``k`` (for ``e`` of its own), flattened to single workers."""
    s, first = (int(v) for v in levels[k].choice[e, i, j, m])
    if s < 0:
        return _one_stage(levels, cost, topology, k, i, j, m, e if k == 0 else 0)
    below = e if k == 0 else int(levels[k].pick[m, first])
    head = _one_stage(levels, cost, topology, k, i, s, first, below)
    return head + stages(levels, cost, topology, k, s, j, m - first, e)


def _one_stage(
    levels: list[Partition], cost: StageCost, topology: Topology, k: int, i: int, j: int, m: int, e: int
) -> list[tuple[int, int, int, float]]:
    """One stage of level ``k`` over ``[i, j)`` on ``m`` units: ``m`` copies of the level below's best
    pipeline for ``e``, each of its stages all-reducing with its copies across this level's links."""
    if k == 0:
        return [(i, j - 1, m, float(levels[0].stage_s[0, i, j, m]))]
    below = stages(levels, cost, topology, k - 1, i, j, topology.levels[k - 1].count, e)
    # Only the ends of this level's stage cross its links; the cuts between the stages below stay inside.
    return [(a, b, r * m, float(cost(k, t, a, b + 1, m, (i, j)))) for a, b, r, t in below]
