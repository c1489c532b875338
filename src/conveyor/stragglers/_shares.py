"""Shares weighted by measured speed: a slow replica's chunks hold fewer samples, so the chunk it runs at the end
of a step, which no peer can take from it, is no longer than a fast one's (FlexRR's reassignment moves small
pieces of a slow worker's work; Malleus re-plans around persistent stragglers).

Each step each replica times the chunks it ran (the seconds inside their runs, not the waits between) and its
speed ``v_w``, samples a second, reaches every replica exactly (a slot of its own in the all-reduce, or its
chunks' own buffers with live reduction), so all compute the same shares. The next batch's ``B`` samples are
dealt in proportion, ``n_w ~ B v_w / sum(v)`` (largest remainders), and each replica's share is cut into its
``chunks`` chunks, as equal as possible. A chunk keeps a quarter of an equal cut's samples at least, and two
(BatchNorm refuses one in training; its statistics over a handful of samples are noise, which each chunk's
statistics weigh into the running ones as much as any other chunk's), where the batch allows. A
chunk costs a fixed part and a part per sample, ``t = a + b n``, and a speed measured in samples a second
includes the fixed part, so a replica dealt fewer samples measures slower: dealing in proportion is a
fixed-point iteration whose fixed point is equal finishing times, ``(a c + b n_w) / s_w`` the same for every
replica of relative speed ``s_w`` (reached in a few steps; the last step's speed is used as it is, so a
replica slowed for a few steps is re-planned at once). Until every replica has a measurement the shares are
equal. Reassignment still moves what a share's owner has not started, and backups what a stalled one holds.

With BatchNorm the chunks' sizes change its batch statistics (as the split into microbatches does), so the
model computed depends on the measured speeds; the run's records say each step's cut (``stragglers.jsonl``'s
``cut``). On a GPU the times are host times around launches, which run ahead of the device: unverified there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ShareWeights", "deal", "equal_cut"]


def deal(speeds: Sequence[float], total: int, least: int) -> list[int]:
    """``total`` samples dealt in proportion to ``speeds``, at least ``least`` each where ``total`` allows (else
    equally), by largest remainders (ties to the lower replica).

    Example (a replica at a third of the others' speed):
        >>> deal([1.0, 1.0, 1.0, 1 / 3], 256, 4), deal([1.0, 1e-9], 64, 4), deal([1.0, 1.0], 5, 4)
        ([77, 77, 77, 25], [60, 4], [3, 2])
    """
    if total < least * len(speeds):
        return equal_cut(total, len(speeds))
    ideal = [total * v / sum(speeds) for v in speeds]
    shares = [max(least, math.floor(x)) for x in ideal]
    order = sorted(range(len(ideal)), key=lambda w: (shares[w] - ideal[w], w))  # the most short of its part first
    for w in order[: max(0, total - sum(shares))]:
        shares[w] += 1
    while sum(shares) > total:  # the floor of one overshot: take back from the most over its part
        over = max((w for w in range(len(shares)) if shares[w] > least), key=lambda w: (shares[w] - ideal[w], -w))
        shares[over] -= 1
    return shares


class ShareWeights:
    """Every replica's last measured speed and the cut of a batch it gives (the same on every replica).

    Args:
        replicas: how many share a step.
        chunks: chunks each replica owns.
    """

    def __init__(self, replicas: int, chunks: int) -> None:
        self.replicas, self.chunks = replicas, chunks
        self.speeds: list[float | None] = [None] * replicas

    def update(self, rates: Sequence[float]) -> None:
        """Take a step's speeds (samples a second; 0 where a replica ran nothing, which keeps its last)."""
        for w, rate in enumerate(rates):
            if rate > 0:
                self.speeds[w] = rate

    def cut(self, samples: int) -> list[int]:
        """The sizes of a batch's ``replicas x chunks`` chunks, each replica's in turn.

        Example:
            >>> weights = ShareWeights(2, 2)
            >>> weights.cut(10)  # no speeds yet: equal
            [3, 3, 2, 2]
            >>> weights.update([30.0, 10.0]); weights.cut(40)
            [15, 15, 5, 5]
            >>> weights.update([90.0, 10.0]); weights.cut(40)  # 2 samples a chunk at least (a quarter of 10)
            [18, 18, 2, 2]
        """
        known = [v for v in self.speeds if v is not None]
        if len(known) < self.replicas:
            return equal_cut(samples, self.replicas * self.chunks)
        least = max(2, samples // (4 * self.replicas * self.chunks))  # a chunk: a quarter of an equal one at least
        shares = deal(known, samples, least=least * self.chunks)
        return [size for n in shares for size in equal_cut(n, self.chunks)]


def equal_cut(samples: int, parts: int) -> list[int]:
    """Sizes of ``parts`` parts of ``samples`` as equal as possible, the larger first (as ``tensor_split`` cuts).

    Example:
        >>> equal_cut(10, 4), equal_cut(2, 3)
        ([3, 3, 2, 2], [1, 1, 0])
    """
    return [samples // parts + (k < samples % parts) for k in range(parts)]
