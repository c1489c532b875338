"""Shares weighted by measured speed: a replica that stays slow owns fewer of a step's chunks (Malleus's
re-planning around persistent stragglers; FlexRR's helpees).

Each step each replica times the chunks it ran (the seconds inside their runs, not the waits between), and
its rate ``r_w`` (chunks a second) rides in the step's all-reduce in a slot of its own, the others' slots
zero, so every replica reads every rate exactly (a sum with zeros is exact) and computes the same shares.
Each rate is smoothed, so a replica slowed for a few steps is re-planned and one slow step is not:

    v_w <- r_w                        (its first measurement)
    v_w <- (1 - a) v_w + a r_w        (a = 1/2; a step it ran no chunk in leaves v_w)

and the step's ``C`` chunks are dealt in proportion, each replica keeping at least one, so its speed stays
measured: ``n_w ~ C v_w / sum(v)``, rounded by largest remainders (:func:`weighted_shares`). Until every
replica has a measurement the shares stay equal. Reassignment still moves what a share's owner has not
started, so a share only sets who starts with which chunk, never what the step computes.

On a GPU the times are host times around launches, which run ahead of the device: unverified there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ShareWeights", "weighted_shares"]


def weighted_shares(speeds: Sequence[float], total: int) -> list[int]:
    """``total`` chunks (at least one a replica) dealt in proportion to ``speeds``, at least one each, by
    largest remainders (ties to the lower replica).

    Example (a replica at a third of the others' speed):
        >>> weighted_shares([1.0, 1.0, 1.0, 1 / 3], 8), weighted_shares([1.0, 1 / 3], 4)
        ([3, 2, 2, 1], [3, 1])
        >>> weighted_shares([1.0, 1e-9, 1e-9], 3), weighted_shares([1.0, 1e-9, 1e-9], 6)  # everyone keeps one
        ([1, 1, 1], [4, 1, 1])
    """
    ideal = [total * v / sum(speeds) for v in speeds]
    shares = [max(1, math.floor(x)) for x in ideal]
    order = sorted(range(len(ideal)), key=lambda w: (shares[w] - ideal[w], w))  # the most short of its part first
    for w in order[: max(0, total - sum(shares))]:
        shares[w] += 1
    while sum(shares) > total:  # the floors of one overshot: take back from the most over its part
        over = max((w for w in range(len(shares)) if shares[w] > 1), key=lambda w: (shares[w] - ideal[w], -w))
        shares[over] -= 1
    return shares


class ShareWeights:
    """Every replica's smoothed speed and the shares they give (the same on every replica).

    Args:
        replicas: how many share a step.
        chunks: chunks each replica owns while the shares are equal (``replicas x chunks`` a step).
        smoothing: ``a``, the weight of a step's rate.
    """

    def __init__(self, replicas: int, chunks: int, *, smoothing: float = 0.5) -> None:
        self.total, self.smoothing = replicas * chunks, smoothing
        self.shares = [chunks] * replicas
        self.speeds: list[float | None] = [None] * replicas

    def update(self, rates: Sequence[float]) -> list[int]:
        """Take a step's rates (chunks a second; 0 where a replica ran none) and return the new shares."""
        for w, rate in enumerate(rates):
            if rate > 0:
                old = self.speeds[w]
                self.speeds[w] = rate if old is None else (1 - self.smoothing) * old + self.smoothing * rate
        known = [v for v in self.speeds if v is not None]
        if len(known) == len(self.speeds):
            self.shares = weighted_shares(known, self.total)
        return self.shares
