"""One record per schedule: how its workers order the work, what an update covers, which weights a forward uses.

Everything that behaves differently per schedule reads it here: the generators, the planner's memory
model, the runtime's gradient clipping, the command line. ``m`` is the microbatches per batch, ``r`` a
stage's replicas and ``d`` the workers from that stage to the end of the pipeline (its own included); a
replica admits ``ceil(d / r)`` microbatches before its first backward (PipeDream's NOAM on the input stage).

==============  ============  ===============  =================  ===============  ===================
name            order         update covers    forward uses       weight versions  microbatches held
==============  ============  ===============  =================  ===============  ===================
``pipedream``   1F1B, no      a round: one     the newest         ``ceil(d/r)``    ``ceil(d/r)``
                flush         per replica
``pipedream-``  1F1B, no      a round          the input stage's  (not modelled)   ``ceil(d/r)``
``vs``          flush                          at entry
``2bw``         1F1B, no      a batch          one update old     2                ``ceil(d/r)``
                flush
``flush``       1F1B per      a batch          the newest         1                ``min(ceil(d/r),
                batch                                                                ceil(m/r))``
``gpipe``       all forwards  a batch          the newest         1                ``ceil(m/r)``
                first
==============  ============  ===============  =================  ===============  ===================

Example:
    >>> KINDS["2bw"].version(stage=1, microbatch=9, replicas=[1, 1], microbatches=4)
    1
    >>> int(KINDS["pipedream"].weight_versions(replicas=1, downstream=3)), KINDS["flush"].synchronous
    (3, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from conveyor.errors import InputError

__all__ = ["KINDS", "PLANNER_SCHEDULES", "Kind", "kind", "warmup"]

Count = int | np.ndarray


def warmup(replicas: Count, downstream: Count) -> Count:
    """Forwards a replica admits before its first backward: the workers from its stage on, shared among the
    stage's replicas (arrays broadcast)."""
    return -(-downstream // replicas)


@dataclass(frozen=True)
class Kind:
    """What a schedule is.

    Attributes:
        name: as given to :func:`~conveyor.schedule.make_schedule` and ``--schedule``.
        summary: one line for help texts.
        all_forwards_first: every forward of a batch runs before its backwards (GPipe); otherwise one
            forward one backward (1F1B) after a warm-up.
        synchronous: the pipeline drains at every update, so the update equals gradient accumulation over
            the batch on the newest weights; otherwise it stays full across batches.
        update: what one optimizer step covers: a ``"batch"``, or a ``"round"`` of one minibatch per replica
            (PipeDream, where every microbatch is a minibatch of its own).
        weights: which version a forward uses: the ``"newest"``; the newest with the version ``"stashed"``
            for the backward (PipeDream); the input stage's at ``"entry"`` (vertical sync); the
            ``"previous"`` update's (2BW).
        plan_as: the schedule whose memory counts the planner uses for this one (``None``: its own).
    """

    name: str
    summary: str
    all_forwards_first: bool
    synchronous: bool
    update: Literal["batch", "round"]
    weights: Literal["newest", "stashed", "entry", "previous"]
    plan_as: str | None = None

    def update_of(self, microbatch: int, microbatches: int, replicas: int) -> int:
        """The update (optimizer step) of a stage with ``replicas`` replicas that ``microbatch`` belongs to."""
        return microbatch // (replicas if self.update == "round" else microbatches)

    def updates(self, batches: int, microbatches: int, replicas: int) -> int:
        """The updates a stage with ``replicas`` replicas makes in a run of ``batches`` batches."""
        return -(-batches * microbatches // replicas) if self.update == "round" else batches

    def version(self, stage: int, microbatch: int, replicas: Sequence[int], microbatches: int) -> int | None:
        """The weight version the forward of ``microbatch`` on ``stage`` uses; ``None`` for the newest.

        2BW: ``max(k // m - 1, 0)``, so ``W(t+1) = W(t) - lr grad f(W(t-1))``. Vertical sync: the version ``u``
        the input stage used, ``max(0, k // r0 - w0 + 1)``, which on a stage with ``r`` replicas is the newest
        whose minibatches the input stage's had all seen, ``floor(u r0 / r)``.
        """
        if self.weights == "previous":
            return max(microbatch // microbatches - 1, 0)
        if self.weights == "entry":
            r0 = replicas[0]
            entered = max(0, microbatch // r0 - int(warmup(r0, sum(replicas))) + 1)
            return entered * r0 // replicas[stage]
        return None

    def staleness(self, stage: int, replicas: Sequence[int]) -> int:
        """The most updates of ``stage`` between the weight version a gradient is computed on and the update
        it is applied in: ``W(t+1)`` uses the gradient at ``W(t - d)``.

        PipeDream: ``d = ceil(sum(r[s:]) / r_s) - 1`` (``p - 1 - s`` unreplicated). 2BW: 1. Vertical sync:
        the most of ``k // r_s - version(k)`` over the microbatches ``k`` of a steady period (``p - 1``
        unreplicated). Synchronous: 0.

        Example:
            >>> [KINDS["pipedream"].staleness(s, [1, 1, 1]) for s in range(3)], KINDS["2bw"].staleness(0, [1, 1])
            ([2, 1, 0], 1)
        """
        if self.synchronous:
            return 0
        if self.weights == "previous":
            return 1
        if self.weights == "entry":  # k // r_s - version(k) repeats every r_0 r_s microbatches after the fill
            r0, rs = replicas[0], replicas[stage]
            start = r0 * int(warmup(r0, sum(replicas)))
            return max(k // rs - (self.version(stage, k, replicas, 1) or 0) for k in range(start, start + r0 * rs))
        return int(warmup(replicas[stage], sum(replicas[stage:]))) - 1

    def lr_scale(self, stage: int, replicas: Sequence[int], microbatches: int, damped: bool = False) -> float:
        """What the stale-gradient correction multiplies ``stage``'s learning rate by.

        ``r_s / m`` for an update per round of minibatches (PipeDream), 1 for an update per batch: the fraction of
        a batch one update covers, so that every schedule applies the same rate per sample. ``damped`` divides
        that by ``1 + d_s`` for the stage's staleness ``d_s`` (:meth:`staleness`), the staleness-aware rate of
        Zhang et al. (IJCAI 2016): ``lr_s = lr r_s / (m (1 + d_s))`` for PipeDream, ``lr / (1 + d_s)`` for 2BW.

        Example:
            >>> pd, four = KINDS["pipedream"], [1, 1, 1, 1]
            >>> [pd.lr_scale(s, four, 4) for s in (0, 3)], [pd.lr_scale(s, four, 4, damped=True) for s in (0, 3)]
            ([0.25, 0.25], [0.0625, 0.25])
            >>> KINDS["2bw"].lr_scale(0, [1, 1], 4, damped=True)
            0.5
        """
        scale = replicas[stage] / microbatches if self.update == "round" else 1.0
        return scale / (1 + self.staleness(stage, replicas)) if damped else scale

    def stashes(self, replicas: Sequence[int], stage: int) -> bool:
        """Whether a worker of ``stage`` keeps more than one weight version, so its forwards must run on
        copies that an optimizer step leaves alone."""
        if self.weights == "entry":
            return len(replicas) > 1
        return bool(self.weight_versions(replicas[stage], sum(replicas[stage:])) > 1)

    def weight_versions(self, replicas: Count, downstream: Count) -> Count:
        """Copies of a stage's weights a worker holds at its peak (arrays broadcast)."""
        if self.weights == "entry":
            raise InputError(f"the planner has no memory model for {self.name}: plan it as {self.plan_as}")
        if self.weights == "stashed":
            return warmup(replicas, downstream)
        shape = np.broadcast_shapes(np.shape(replicas), np.shape(downstream))
        return np.broadcast_to(2 if self.weights == "previous" else 1, shape)

    def in_flight(self, replicas: Count, downstream: Count, microbatches: int) -> Count:
        """Microbatches a worker of a stage holds activations for at its peak (arrays broadcast)."""
        own = -(-microbatches // replicas)  # the most microbatches of one batch a replica runs
        if self.all_forwards_first:
            return np.broadcast_to(own, np.broadcast_shapes(np.shape(own), np.shape(downstream)))
        if self.synchronous:
            return np.minimum(warmup(replicas, downstream), own)
        return warmup(replicas, downstream)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "pipedream",
            "PipeDream: asynchronous 1F1B, an update per minibatch, weight stashing",
            False,
            False,
            "round",
            "stashed",
        ),
        Kind(
            "pipedream-vs",
            "PipeDream with vertical sync: every stage uses the input stage's version",
            False,
            False,
            "round",
            "entry",
            plan_as="pipedream",
        ),
        Kind(
            "2bw",
            "PipeDream-2BW: asynchronous 1F1B, an update per batch on weights one update old",
            False,
            False,
            "batch",
            "previous",
        ),
        Kind(
            "flush",
            "PipeDream-Flush: 1F1B, drained at every batch (gradient accumulation)",
            False,
            True,
            "batch",
            "newest",
        ),
        Kind("gpipe", "GPipe: all forwards, then all backwards, drained at every batch", True, True, "batch", "newest"),
    )
}
PLANNER_SCHEDULES = tuple(name for name, k in KINDS.items() if k.plan_as is None)


def kind(name: str) -> Kind:
    """The record of schedule ``name``.

    Raises:
        ValueError: an unknown name.
    """
    if name not in KINDS:
        raise InputError(f"unknown schedule {name!r}; choose one of {', '.join(sorted(KINDS))}")
    return KINDS[name]
