"""Shares weighted by measured speed: a slow replica owns fewer chunks of a step, and smaller ones, so the chunk
it runs at the end of a step, which no peer can take from it, is no longer than a fast one's (FlexRR's
reassignment moves small pieces of a slow worker's work; Malleus re-plans around persistent stragglers).

Each step each replica times the chunks it ran (the seconds inside their runs, not the waits between) and its
speed ``v_w``, samples a second, reaches every replica exactly (a slot of its own in the all-reduce, or its
chunks' own buffers with live reduction), so all compute the same shares. The step's ``C`` chunks are dealt in
proportion to the speeds, one a replica at least, and so are the batch's ``B`` samples, ``n_w ~ B v_w /
sum(v)`` (largest remainders), each replica's cut into its chunks as equally as possible; a chunk keeps a
quarter of an equal cut's samples at least, and two (BatchNorm refuses one in training, and its statistics
over a handful of samples are noise that weighs into the running ones as much as any chunk's). A chunk costs a
fixed part and a part per sample, ``t = a + b n``, and a speed in samples a second includes the fixed part, so
a replica dealt less measures slower: dealing in proportion is a fixed-point iteration whose fixed point is
equal finishing times. The last step's speeds are used as they are, so a replica slowed for a few steps is
re-planned at once; speeds within ``band`` (20%) of the median count as the median's, so the noise of
measuring keeps equal replicas' shares equal. Until every replica has a measurement the shares are equal.
Reassignment still moves what a share's owner has not started, and backups what a stalled one holds.

With BatchNorm the chunks' sizes change its batch statistics (as the split into microbatches does), so the
model computed depends on the measured speeds; the run's records say each step's cut (``stragglers.jsonl``'s
``cut``). On a GPU the times are host times around launches, which run ahead of the device: unverified there.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["ShareWeights", "deal", "equal_cut"]


def deal(speeds: Sequence[float], total: int, least: int | Sequence[int]) -> list[int]:
    """``total`` items dealt in proportion to ``speeds``, at least ``least`` each (a count, or one per replica)
    where ``total`` allows (else equally), by largest remainders (ties to the lower replica).

    Example (a replica at a third of the others' speed: its chunks, then its samples):
        >>> deal([1.0, 1.0, 1.0, 1 / 3], 8, 1), deal([1.0, 1.0, 1.0, 1 / 3], 256, [16, 16, 16, 8])
        ([3, 2, 2, 1], [77, 77, 77, 25])
        >>> deal([1.0, 1e-9], 64, 4), deal([1.0, 1.0], 5, 4)
        ([60, 4], [3, 2])
    """
    floor = [least] * len(speeds) if isinstance(least, int) else list(least)
    if total < sum(floor):
        return equal_cut(total, len(speeds))
    ideal = [total * v / sum(speeds) for v in speeds]
    shares = [max(f, math.floor(x)) for f, x in zip(floor, ideal, strict=True)]
    order = sorted(range(len(ideal)), key=lambda w: (shares[w] - ideal[w], w))  # the most short of its part first
    for w in order[: max(0, total - sum(shares))]:
        shares[w] += 1
    while sum(shares) > total:  # the floor of one overshot: take back from the most over its part
        over = max((w for w in range(len(shares)) if shares[w] > floor[w]), key=lambda w: (shares[w] - ideal[w], -w))
        shares[over] -= 1
    return shares


class ShareWeights:
    """Every replica's last measured speed and the cut of a batch it gives (the same on every replica).

    Args:
        replicas: how many share a step.
        chunks: chunks each replica owns while the speeds are equal (``replicas x chunks`` a step).
        band: speeds within this fraction of the median count as the median's (measurement noise).
    """

    def __init__(self, replicas: int, chunks: int, *, band: float = 0.2) -> None:
        self.replicas, self.chunks, self.band = replicas, chunks, band
        self.speeds: list[float | None] = [None] * replicas

    def update(self, rates: Sequence[float]) -> None:
        """Take a step's speeds (samples a second; 0 where a replica ran nothing, which keeps its last)."""
        for w, rate in enumerate(rates):
            if rate > 0:
                self.speeds[w] = rate

    def _relative(self) -> list[float] | None:
        """The speeds to deal by: ``None`` until every replica is measured; one within the band of the median
        counts as the median."""
        known = [v for v in self.speeds if v is not None]
        if len(known) < self.replicas:
            return None
        median = statistics.median(known)
        return [median if abs(v - median) <= self.band * median else v for v in known]

    def shares(self) -> list[int]:
        """Each replica's chunks this step (one at least)."""
        speeds = self._relative()
        total = self.replicas * self.chunks
        return [self.chunks] * self.replicas if speeds is None else deal(speeds, total, 1)

    def cut(self, samples: int) -> list[int]:
        """The sizes of a batch's chunks, each replica's (:meth:`shares` of them) in turn.

        Example:
            >>> weights = ShareWeights(2, 2)
            >>> weights.cut(10)  # no speeds yet: equal
            [3, 3, 2, 2]
            >>> weights.update([30.0, 10.0]); weights.shares(), weights.cut(40)
            ([3, 1], [10, 10, 10, 10])
            >>> weights.update([31.0, 29.0]); weights.shares(), weights.cut(40)  # within 20%: noise
            ([2, 2], [10, 10, 10, 10])
        """
        speeds, counts = self._relative(), self.shares()
        if speeds is None:
            return equal_cut(samples, self.replicas * self.chunks)
        least = max(2, samples // (4 * self.replicas * self.chunks))  # a chunk: a quarter of an equal one at least
        shares = deal(speeds, samples, [least * c for c in counts])
        return [size for n, c in zip(shares, counts, strict=True) for size in equal_cut(n, c)]


def equal_cut(samples: int, parts: int) -> list[int]:
    """Sizes of ``parts`` parts of ``samples`` as equal as possible, the larger first (as ``tensor_split`` cuts).

    Example:
        >>> equal_cut(10, 4), equal_cut(2, 3)
        ([3, 3, 2, 2], [1, 1, 0])
    """
    return [samples // parts + (k < samples % parts) for k in range(parts)]
