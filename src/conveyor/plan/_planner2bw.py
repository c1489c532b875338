"""PipeDream-2BW's planner: width x depth, microbatch size and activation recomputation under a memory limit.

For a model of repeated blocks (a transformer) and a batch size fixed for convergence, PipeDream-2BW
(Narayanan et al., ICML 2021) picks how many pipeline copies to run (width ``w``), how many stages each has
(depth ``d``, ``w * d`` workers), the microbatch size ``b`` and whether to recompute activations. For every
candidate, with ``M = batch / b`` microbatches per optimizer step shared by the ``w`` copies:

- the layers are split into ``d`` contiguous stages, each on ``w`` replicas, minimising the slowest stage
  or link (a dynamic program over stages left and first layer), under the memory limit;
- a stage's time per microbatch is ``max((f + b + r f) / w + A / M, (C_i + C_j) / (w B'))``: forward,
  backward and, with recomputation (``r``), a second forward, plus its ring all-reduce
  ``A = 2 (w - 1) (L + W / (w B))`` once per step of ``M`` microbatches (summed: the runtime's ``REDUCE``
  blocks); its links, overlapped with compute, carry the activations entering and leaving it, shared by
  its ``w`` replicas (replica ``k`` of one stage talks to replica ``k`` of the next, at ``B'``), as in
  :mod:`conveyor.plan._cost_model`;
- a worker of a stage with ``k`` stages from it to the end holds two weight versions and a gradient,
  the optimizer state, and ``k`` microbatches in flight: their stashed activations, or with recomputation
  only their inputs plus one microbatch's activations while it recomputes.

The candidate with the most samples per second wins. Any chain profile works; a model of repeated blocks
simply gives the stages even splits. The profile needs measurements at each microbatch size to consider
(``conveyor profile --batch-sizes``).

Example:
    >>> p = Profile.chain("toy", [1.0] * 4, [2.0] * 4, [8] * 4, [0] * 4, batch_size=4)
    >>> plan, _ = plan_2bw(p, Topology.parse("4:1e9"), batch_size=16)
    >>> plan.config, plan.microbatches, plan.recompute
    ('1-1-1-1', 4, False)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from conveyor.plan._cost_model import allreduce_s
from conveyor.plan._memory import layer_stash_bytes, worker_bytes
from conveyor.plan._optimizer import Plan, PlanError, PlannedStage
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology
from conveyor.schedule import twobw_min_microbatches

__all__ = ["Candidate", "plan_2bw"]


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner weighed: ``samples_per_s`` is None where nothing fits or it is invalid."""

    width: int
    depth: int
    microbatch_size: int
    recompute: bool
    samples_per_s: float | None
    why_not: str = ""


def plan_2bw(
    profile: Profile, topology: Topology, batch_size: int, memory: float | None = None
) -> tuple[Plan, list[Candidate]]:
    """The fastest PipeDream-2BW configuration for ``batch_size`` samples per optimizer step.

    Args:
        profile: the model, measured at one or more microbatch sizes (its own and its variants).
        topology: the cluster; every worker is used.
        batch_size: samples per optimizer step, across all copies of the pipeline.
        memory: bytes per worker; ``None`` for no limit.

    Returns:
        The plan (for the chosen microbatch size; ``plan.microbatches`` per step) and every candidate.

    Raises:
        PlanError: no candidate is valid and fits.
    """
    workers, n = topology.workers, len(profile)
    candidates, best = [], None
    for b in sorted(size for size in profile.batch_sizes if size is not None):
        prof = profile.at(b)
        for w in [w for w in range(1, workers + 1) if workers % w == 0]:
            d = workers // w
            for recompute in (False, True):
                why = _invalid(batch_size, b, w, d, n)
                plan = (
                    None
                    if why
                    else _best_split(
                        prof, topology, w=w, d=d, microbatches=batch_size // b, recompute=recompute, memory=memory
                    )
                )
                if plan is None and not why:
                    why = "does not fit in memory"
                rate = None if plan is None else b / plan.seconds_per_minibatch
                candidates.append(Candidate(w, d, b, recompute, rate, why))
                if rate is not None and (best is None or rate > best[0] * (1 + 1e-9)):
                    best = (rate, plan, prof)
    if best is None:
        reasons = sorted({c.why_not for c in candidates})
        raise PlanError(
            f"no PipeDream-2BW configuration of {profile.model} for batch size {batch_size} on {workers} workers is "
            f"valid and fits ({'; '.join(reasons)}): profile other microbatch sizes (conveyor profile --batch-sizes), "
            "change the batch size, or give more memory"
        )
    rate, plan, prof = best
    assert plan is not None and prof.batch_size is not None
    m = batch_size // prof.batch_size

    def alone(width: int) -> float:
        """Seconds per microbatch of one stage on ``width`` workers, inf if invalid or too big."""
        other = (
            None
            if m % width
            else _best_split(prof, topology, w=width, d=1, microbatches=m, recompute=plan.recompute, memory=memory)
        )
        return math.inf if other is None else other.seconds_per_minibatch

    return replace(plan, data_parallel_seconds=alone(workers), single_worker_seconds=alone(1)), candidates


def _invalid(batch: int, b: int, w: int, d: int, layers: int) -> str:
    """Why a candidate cannot run, or ''."""
    if d > layers:
        return f"depth {d} exceeds the {layers} layers"
    if batch % b or (batch // b) % w:
        return f"batch {batch} is not a whole number of microbatches of {b} per pipeline copy"
    need = twobw_min_microbatches([w] * d)
    if batch // b < need:
        return f"{batch // b} microbatches per step are fewer than the {need} that 2BW needs"
    return ""


def _best_split(
    p: Profile, topology: Topology, *, w: int, d: int, microbatches: int, recompute: bool, memory: float | None
) -> Plan | None:
    """The best split into ``d`` stages of ``w`` replicas each, or None if none fits."""
    n = len(p)

    def span(values: list[float] | list[int]) -> np.ndarray:
        """``[i, j]``: the total of ``values`` over layers ``[i, j)``."""
        prefix = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
        spans: np.ndarray = prefix[None, :] - prefix[:, None]
        return spans

    fwd = span([lay.forward_s for lay in p.layers])
    params = span([lay.param_bytes for lay in p.layers])
    compute = fwd * (2 if recompute else 1) + span([lay.backward_s for lay in p.layers])
    # A stage's replicas are neighbouring ranks; replica k of one stage talks to replica k of the next.
    rings = [topology.level_between(s * w, s * w + w - 1) for s in range(d)]
    ring_bw = min(topology.bandwidth_between(s * w, s * w + w - 1) for s in range(d))
    link_bw = min((topology.bandwidth_between(r, r + w) for r in range(w * (d - 1))), default=math.inf)
    allreduce = allreduce_s(params, w, max(level.latency for level in rings), ring_bw)
    inputs = np.array([0.0] + [p.cut_bytes(i - 1) for i in range(1, n)] + [0.0])  # what a stage from layer i gets
    links = (inputs[:, None] + inputs[None, :]) / (w * link_bw)
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
    stage = np.where(upper, np.maximum(compute / w + allreduce / microbatches, links), np.inf)
    optimizer = span([lay.optimizer_bytes for lay in p.layers])
    stash = span(layer_stash_bytes(p))

    def need(k: int) -> np.ndarray:
        """Bytes on a worker of stage ``[i, j)`` with ``k`` stages from it to the end (``k`` in flight):
        recomputation keeps each microbatch's input, plus one microbatch's activations while it reruns."""
        held = inputs[:, None] if recompute else stash
        total = worker_bytes(
            "2bw",
            replicas=w,
            downstream=k * w,
            microbatches=microbatches,
            weights=params,
            optimizer=optimizer,
            stash=held,
        ) + (stash if recompute else 0)
        return np.asarray(total)

    # best[k, i]: layers [i, n) in k stages; end[k, i]: where the first of them ends.
    best = np.full((d + 1, n + 1), np.inf)
    end = np.full((d + 1, n + 1), n, dtype=np.int64)
    for k in range(1, d + 1):
        total = np.maximum(stage, best[k - 1][None, :]) if k > 1 else stage.copy()
        if k == 1:
            total[:, :n] = np.inf
        if memory is not None:
            total[need(k) > memory] = np.inf
        end[k] = np.argmin(total, axis=1)
        best[k] = total[np.arange(n + 1), end[k]]
    if not np.isfinite(best[d, 0]):
        return None
    stages, i = [], 0
    for k in range(d, 0, -1):
        j = int(end[k, i])
        stages.append(PlannedStage(i, j - 1, w, float(stage[i, j]), int(need(k)[i, j])))
        i = j
    return Plan(tuple(stages), float(best[d, 0]), math.inf, math.inf, "2bw", microbatches, memory, recompute)
