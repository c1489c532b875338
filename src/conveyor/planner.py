"""PipeDream's partitioning optimizer: split layers into stages and choose each stage's replica count.

The cost model is the PipeDream paper's (Narayanan et al., SOSP 2019, section 3.1). For level ``k`` of a
hierarchical topology (innermost first), with ``m`` units of the level below joined at bandwidth ``B_k``:

- one stage running layers ``[i, j)`` replicated over ``m`` units takes, per minibatch,
  ``T_k(i, j, m) = max(A_{k-1}(i, j), 2 (m - 1) W(i, j) / B_k) / m``: each unit runs the best plan of the
  level below for those layers, and the ring all-reduce of the stage's weights ``W`` overlaps compute;
- the best pipeline over ``[i, j)`` with ``m`` units is a single stage or a best pipeline over ``[i, s)``
  followed by one stage over ``[s, j)``, joined by the activation and gradient crossing the cut:
  ``A_k(i, j, m) = min(T_k(i, j, m), min_{s, m'} max(A_k(i, s, m - m'), 2 C(s) / B_k, T_k(s, j, m')))``.

At the innermost level a unit is one worker and ``A_{-1}(i, j)`` is the layers' forward plus backward
time. The pipeline's time per minibatch is that of its slowest stage or link; the plan is the arg-min.
Every candidate the recursion ranges over includes a single stage replicated over every worker (data
parallelism), so the plan is never slower than data parallelism under the model.

Example:
    >>> from conveyor.profiles import Profile
    >>> p = Profile.chain("toy", [1.0, 1.0], [2.0, 2.0], [10, 10], [8e9, 0])
    >>> plan = optimize(p, Topology.parse("2:1e9"))
    >>> [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages]
    [(0, 0, 1), (1, 1, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from conveyor.profiles import Profile
from conveyor.topology import Topology

__all__ = ["Plan", "PlanError", "PlannedStage", "optimize"]


class PlanError(ValueError):
    """No configuration satisfies the constraints."""


@dataclass(frozen=True)
class PlannedStage:
    """A stage of a plan: layers ``first_layer..last_layer`` (inclusive) on ``replicas`` workers."""

    first_layer: int
    last_layer: int
    replicas: int
    seconds_per_minibatch: float


@dataclass(frozen=True)
class Plan:
    """The optimizer's answer and what the cost model predicts for it.

    Attributes:
        stages: the stages in pipeline order.
        seconds_per_minibatch: predicted steady-state time per minibatch (slowest stage or link).
        data_parallel_seconds: the same for pure data parallelism on every worker.
        single_worker_seconds: the same for one worker running the whole model.
    """

    stages: tuple[PlannedStage, ...]
    seconds_per_minibatch: float
    data_parallel_seconds: float
    single_worker_seconds: float

    @property
    def workers(self) -> int:
        return sum(s.replicas for s in self.stages)

    @property
    def config(self) -> str:
        """Replicas per stage, PipeDream-style: ``"15-1"``."""
        return "-".join(str(s.replicas) for s in self.stages)

    @property
    def noam(self) -> int:
        """Minibatches the input stage admits before its first backward: ceil(workers / its replicas)."""
        return -(-self.workers // self.stages[0].replicas)

    @property
    def speedup_vs_dp(self) -> float:
        return self.data_parallel_seconds / self.seconds_per_minibatch

    @property
    def speedup_vs_single(self) -> float:
        return self.single_worker_seconds / self.seconds_per_minibatch

    def to_dict(self, profile: Profile, batch_size: int | None = None) -> dict[str, Any]:
        """The plan file: stages with layer ranges, names, replicas and ranks, and the predictions.

        Ranks are handed out stage by stage, so a stage's replicas sit on neighbouring workers.
        """
        batch = batch_size or profile.batch_size
        stages, rank = [], 0
        for st in self.stages:
            stages.append(
                {
                    "first_layer": st.first_layer,
                    "last_layer": st.last_layer,
                    "layer_names": [lay.name for lay in profile.layers[st.first_layer : st.last_layer + 1]],
                    "replicas": st.replicas,
                    "ranks": list(range(rank, rank + st.replicas)),
                    "seconds_per_minibatch": st.seconds_per_minibatch,
                }
            )
            rank += st.replicas
        minibatches_per_s = 1.0 / self.seconds_per_minibatch
        return {
            "model": profile.model,
            "config": self.config,
            "noam": self.noam,
            "stages": stages,
            "predicted": {
                "seconds_per_minibatch": self.seconds_per_minibatch,
                "minibatches_per_s": minibatches_per_s,
                "samples_per_s": None if batch is None else batch * minibatches_per_s,
                "speedup_vs_dp": self.speedup_vs_dp,
                "speedup_vs_single": self.speedup_vs_single,
            },
        }


class _Level:
    """The dynamic program's tables for one level of the topology."""

    def __init__(self, count: int, stage_s: np.ndarray, best_s: np.ndarray, choice: np.ndarray) -> None:
        self.count = count
        self.stage_s = stage_s  # T[i, j, m]
        self.best_s = best_s  # A[i, j, m]
        self.choice = choice  # [i, j, m] -> (split s, units of the last stage), or (-1, -1) for one stage


def optimize(profile: Profile, topology: Topology, straight: bool = False) -> Plan:
    """The plan with the least predicted time per minibatch.

    Args:
        profile: the model's layers.
        topology: the cluster; every worker is used.
        straight: give every stage exactly one worker (no replication).

    Raises:
        PlanError: no plan satisfies the constraints (a straight pipeline with more workers than layers).
    """
    n = len(profile)
    prefix = np.array(profile._compute_prefix)
    params = np.array(profile._param_prefix, dtype=np.float64)
    compute = prefix[None, :] - prefix[:, None]  # compute[i, j] = time of layers [i, j) on one worker
    weights = params[None, :] - params[:, None]
    cut = np.array([0.0] + [profile.cut_bytes(s - 1) for s in range(1, n + 1)])  # cut[s]: between s-1 and s
    levels: list[_Level] = []
    inner = compute
    for k, level in enumerate(topology.levels):
        top = k == len(topology.levels) - 1
        lv = _solve_level(inner, weights, cut, level.count, level.bandwidth, straight, only_from_zero=top)
        levels.append(lv)
        inner = lv.best_s[:, :, level.count]
    best = float(levels[-1].best_s[0, n, topology.levels[-1].count])
    if not np.isfinite(best):
        raise PlanError(
            f"no straight pipeline of {profile.model} ({n} layers) uses exactly {topology.workers} workers: "
            f"use at most {n} workers, or allow replicated stages"
        )
    stages = _reconstruct(levels, weights, topology, len(levels) - 1, 0, n, topology.levels[-1].count)
    dp = compute[0, n]
    for level in topology.levels:
        dp = max(dp, 2 * (level.count - 1) * weights[0, n] / level.bandwidth) / level.count
    return Plan(
        tuple(stages), float(levels[-1].best_s[0, n, topology.levels[-1].count]), float(dp), float(compute[0, n])
    )


def _solve_level(
    inner: np.ndarray,
    weights: np.ndarray,
    cut: np.ndarray,
    count: int,
    bandwidth: float,
    straight: bool,
    only_from_zero: bool,
) -> _Level:
    n = inner.shape[0] - 1
    units = np.arange(count + 1, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        allreduce = 2 * (units - 1)[None, None, :] * weights[:, :, None] / bandwidth
        stage_s = np.maximum(inner[:, :, None], allreduce) / units[None, None, :]
    stage_s[:, :, 0] = np.inf
    if straight:
        stage_s[:, :, 2:] = np.inf
    link_s = 2 * cut / bandwidth
    best = np.full((n + 1, n + 1, count + 1), np.inf)
    choice = np.full((n + 1, n + 1, count + 1, 2), -1, dtype=np.int64)
    for i in [0] if only_from_zero else range(n):
        for j in range(i + 1, n + 1):
            best[i, j, 1:] = stage_s[i, j, 1:]
            if j - i < 2:
                continue
            splits = slice(i + 1, j)
            for m in range(2, count + 1):
                # Rows: split point s; columns: units m' of the last stage [s, j), 1..m-1.
                head = best[i, splits, m - 1 : 0 : -1]
                tail = stage_s[splits, j, 1:m]
                candidates = np.maximum(np.maximum(head, tail), link_s[splits, None])
                flat = int(np.argmin(candidates))
                value = candidates.flat[flat]
                if value < best[i, j, m]:
                    best[i, j, m] = value
                    choice[i, j, m] = (i + 1 + flat // (m - 1), 1 + flat % (m - 1))
    return _Level(count, stage_s, best, choice)


def _reconstruct(
    levels: list[_Level], weights: np.ndarray, topology: Topology, k: int, i: int, j: int, m: int
) -> list[PlannedStage]:
    """The flattened stages of the best pipeline for layers ``[i, j)`` on ``m`` units of level ``k``."""
    s, last_units = (int(v) for v in levels[k].choice[i, j, m])
    if s >= 0:
        head = _reconstruct(levels, weights, topology, k, i, s, m - last_units)
        return head + _reconstruct(levels, weights, topology, k, s, j, last_units)
    if k == 0:
        return [PlannedStage(i, j - 1, m, float(levels[0].stage_s[i, j, m]))]
    # One stage at this level: m copies of the level below's best pipeline for these layers, each of its
    # stages all-reducing with its m - 1 copies across this level's links.
    bandwidth = topology.levels[k].bandwidth
    below = _reconstruct(levels, weights, topology, k - 1, i, j, topology.levels[k - 1].count)
    return [
        PlannedStage(
            st.first_layer,
            st.last_layer,
            st.replicas * m,
            max(st.seconds_per_minibatch, 2 * (m - 1) * weights[st.first_layer, st.last_layer + 1] / bandwidth) / m,
        )
        for st in below
    ]
