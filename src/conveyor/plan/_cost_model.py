"""The planner's cost model: what one stage, its all-reduce and its links cost per minibatch.

What a topology's bandwidth is (:mod:`conveyor.plan._topology`): at the innermost level, each worker's own
link to its server's switch; at an outer level ``k``, each group's uplink to level ``k``'s switch, shared by
the group's workers. Links are full duplex: ``B`` bytes per second of data each way at once (what a
transfer delivers, not the line rate). The emulated cluster (:mod:`conveyor.emulate`) builds exactly this.

Two models, chosen with ``cost_model``:

``"physical"`` (the default) charges what the runtime does on that network. A stage over layers ``[i, j)`` on
``m`` units of level ``k`` (workers at level 0; at level ``k > 0`` groups, each running the level below's best
pipeline for the layers, taking ``A`` seconds per minibatch), with weights ``W`` and ``U`` minibatches per
update (``m`` for PipeDream's per-round updates, the step's microbatches ``M`` for the schedules that update
once per batch):

- compute and all-reduce, summed because the runtime's ``REDUCE`` blocks: ``A / m + R(W, m) / U``, where a
  ring all-reduce among ``m`` units takes ``R(W, m) = 2 (m - 1) (L_k + W / (m B))``: ``2 (m - 1)`` steps, each
  a message of ``W / m`` bytes over every unit's link, one ring edge each way, at ``B``, the slowest
  bandwidth of levels ``0..k`` (each edge crosses them all), with level ``k``'s latency ``L_k`` per step;
- its links, overlapped with compute because sends are asynchronous: per minibatch one of its units
  receives the activation at ``i`` and sends the one at ``j`` and gets both gradients back, so each of its
  ``m`` links carries ``(C_i + C_j) / m`` each way: ``(C_i + C_j) / (m B_k)`` (``C_0 = C_n = 0``: the
  loader feeds the first stage, the loss ends the last);
- the stage: ``max(A / m + R(W, m) / U, (C_i + C_j) / (m B_k))``.

With several levels the search charges each level's ring among its units (a hierarchical reduction's
bytes) for the outer stage's whole weights, added to its inner pipeline's slowest stage (an upper bound:
each stage's own figure in the plan charges it only its own weights). The runtime runs one ring over all of
a stage's replicas, which is what :func:`allreduce_s` and the simulator (:func:`~conveyor.plan.predict`)
charge, so there the plan's steady state and the prediction differ by that.

``"pipedream"`` is the PipeDream optimizer's own (``optimizer/optimizer_graph_hierarchical.py`` of
msr-fiddle/pipedream), to reproduce the paper's plans: compute and a ``4 (m - 1) W / (m B_k)`` all-reduce
summed and divided by ``m``; a stage's input and output activations ``2 C / (m B_k)`` each, none for the
first stage (the next one's input term covers the cut); the stage the largest of these. The optimizer
charges the activations only when given ``--activation_compression_ratio`` (1 here); without it, none. On
several levels it also divides the all-reduce of the first stage of each pipeline by the count of the
level below and subtracts compute between boundaries that are not nested; this model keeps its one-level
terms there.

Example:
    >>> round(allreduce_s(100e6, 4, 0.0, 1.25e8), 6)  # 6 steps of 25 MB at 125 MB/s
    1.2
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conveyor.errors import InputError
from conveyor.plan._topology import Topology

__all__ = ["COST_MODELS", "allreduce_s", "check_cost_model", "stage_seconds"]

COST_MODELS = ("physical", "pipedream")


def check_cost_model(name: str) -> None:
    """Raise ``ValueError`` with the choices for an unknown model name."""
    if name not in COST_MODELS:
        raise InputError(f"unknown cost model {name!r}: use one of {', '.join(COST_MODELS)}")


def allreduce_s(nbytes: Any, replicas: int, latency: float, bandwidth: float) -> Any:
    """A ring all-reduce of ``nbytes`` (a number or an array) among ``replicas`` workers: ``2 (r - 1)`` steps,
    each a message of ``nbytes / r`` (no time for one worker)."""
    return 2 * (replicas - 1) * (latency + nbytes / replicas / bandwidth)


def stage_seconds(
    cost_model: str,
    topology: Topology,
    *,
    k: int,
    inner: np.ndarray | float,
    weights: np.ndarray | float,
    cut_in: np.ndarray | float,
    cut_out: np.ndarray | float,
    units: np.ndarray | int,
    per_update: np.ndarray | int | None = None,
    first: np.ndarray | bool = False,
) -> np.ndarray:
    """Seconds per minibatch of one stage on ``units`` units of level ``k`` (see the module docstring).

    Args:
        cost_model: ``"physical"`` or ``"pipedream"``.
        topology: the cluster.
        k: the level whose units the stage is replicated over.
        inner: a unit's seconds per minibatch for the stage's layers (compute at level 0).
        weights: bytes of the stage's parameters.
        cut_in: bytes of the activation entering the stage (0 for the first).
        cut_out: bytes of the activation leaving it (0 for the last).
        units: ``m``; all arguments broadcast together.
        per_update: minibatches per update across the stage (``None``: one per unit, PipeDream's rounds).
        first: the stage is the pipeline's first (the PipeDream model charges it no transfers).

    Example:
        >>> t = Topology.parse("4:1e9")
        >>> # 8 / 4 + 2 * 3 * (1e9 / 4) / 1e9 / 4
        >>> float(stage_seconds("physical", t, k=0, inner=8.0, weights=1e9, cut_in=0.0, cut_out=0.0, units=4))
        2.375
    """
    level = topology.levels[k]
    m = np.asarray(units, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        if cost_model == "pipedream":
            allreduce = 4 * (m - 1) * np.asarray(weights) / (m * level.bandwidth)
            compute = (np.asarray(inner) + allreduce) / m
            links = np.where(first, 0.0, 2 * np.maximum(cut_in, cut_out) / (m * level.bandwidth))
        else:
            check_cost_model(cost_model)
            ring = 2 * (m - 1) * (level.latency + np.asarray(weights) / (m * topology.slowest(k)))
            compute = np.asarray(inner) / m + ring / (m if per_update is None else np.asarray(per_update))
            links = (np.asarray(cut_in) + np.asarray(cut_out)) / (m * level.bandwidth)
        return np.asarray(np.maximum(compute, links))
