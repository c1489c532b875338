"""Tributary's portfolio (Harlap et al., ATC'18): machines across partly correlated spot markets, more than
needed but cheaper, such that the capacity the job needs survives the next interval with a chosen probability.

With ``n_i`` machines of speed ``v_i`` (in V100s) held in market ``i``, ``L_i`` the event that market ``i``
takes the share ``q_i`` of them within the interval (``P(L_i) = p_i``, from :mod:`._hazard`), and ``o`` the
on-demand speed held:

    ``C = o + sum_i v_i * (n_i - [L_i] * ceil(q_i * n_i))``          (the capacity left at the interval's end)
    ``minimize  sum_i n_i * price_i   subject to   P(C >= R) >= target``

The ``L_i`` are drawn jointly through a Gaussian copula with the losses' past correlation matrix (fixed draws,
so a decision is repeatable). The holding is built greedily: each step adds the machine with the largest gain
in ``P(C >= R) + E[min(C, R)] / R`` per dollar an hour, until the target is met, no machine adds anything, or
``R`` plus ``extra`` machines are held.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import norm  # type: ignore[import-untyped]

from conveyor.markets._hazard import Losses

__all__ = ["Holding", "choose", "survival"]

DRAWS = 2000


@dataclass(frozen=True)
class Holding:
    """A decision: machines per market, its survival probability and its spot price an hour."""

    machines: tuple[int, ...]
    survival: float
    price_per_h: float


def _losses(losses: Losses, seed: int = 0) -> np.ndarray:
    """``(DRAWS, markets)`` booleans: which markets lose machines in each draw."""
    rng = np.random.default_rng(seed)
    values, vectors = np.linalg.eigh(losses.correlation)  # a square root that takes singular matrices too
    root = vectors * np.sqrt(np.maximum(values, 0.0))
    z = rng.standard_normal((DRAWS, len(losses.p))) @ root.T
    lost: np.ndarray = norm.cdf(z) < losses.p
    return lost


def survival(
    machines: np.ndarray, speeds: np.ndarray, lost: np.ndarray, fraction: np.ndarray, required: float, base: float = 0.0
) -> tuple[float, float, float]:
    """``P(C >= R)``, ``E[min(C, R)] / R`` and ``E[C] / R`` over the draws ``lost`` for a holding ``machines``.

    Example:
        >>> lost = np.array([[True, False], [False, False]])  # market 0 lost in half the draws
        >>> survival(np.array([1, 1]), np.ones(2), lost, np.ones(2), 2.0)
        (0.5, 0.75, 0.75)
    """
    taken = np.ceil(fraction * machines)
    capacity = (lost * -taken + machines) @ speeds + base
    within = float(np.mean(np.minimum(capacity, required)) / required)
    return float(np.mean(capacity >= required - 1e-9)), within, float(np.mean(capacity) / required)


def choose(
    *,
    available: np.ndarray,
    speeds: np.ndarray,
    prices: np.ndarray,
    losses: Losses,
    required: float,
    target: float,
    extra: int,
    base: float = 0.0,
    most: int = 0,
    binding: bool = True,
    held_now: np.ndarray | None = None,
) -> Holding:
    """The greedy portfolio over markets with ``available`` machines each (see the module docstring), beside
    ``base``, the on-demand speed ``o`` held anyway, and no more than ``most`` machines (0: no limit). With
    ``binding`` false the survival target is not asked for: machines are added only until ``E[C] >= R``.
    ``held_now``, the machines held already, are kept while they are needed (a machine moved to another
    market pays its start again): the greedy steps start from them, and surplus ones are given back.

    Example:
        >>> from conveyor.markets._hazard import Losses
        >>> risky = Losses(np.array([0.5, 0.02, 0.02]), np.ones(3), np.eye(3))
        >>> h = choose(available=np.array([1, 1, 1]), speeds=np.ones(3), prices=np.ones(3), losses=risky,
        ...            required=1.0, target=0.99, extra=2)
        >>> h.machines, h.survival >= 0.99  # the two safe markets, not the risky one
        ((0, 1, 1), True)
    """
    lost = _losses(losses)
    held = np.zeros(len(available), dtype=np.int64) if held_now is None else np.minimum(held_now, available)
    limit = int(np.ceil(required / max(speeds.max(), 1e-9))) + extra
    limit = min(limit, most) if most else limit
    held = _give_back(held, speeds, lost, losses, required, base, target if binding else 0.0, limit)
    score = survival(held, speeds, lost, losses.fraction, required, base)
    while (score[2] < 1.0 or (binding and score[0] < target)) and held.sum() < limit:
        best, best_gain = -1, 0.0
        best_score = score
        for i in np.flatnonzero(held < available).tolist():
            held[i] += 1
            trial = survival(held, speeds, lost, losses.fraction, required, base)
            held[i] -= 1
            gain = (trial[0] + trial[1] - score[0] - score[1]) / max(prices[i], 1e-9)
            if gain > best_gain + 1e-12:
                best, best_gain, best_score = i, gain, trial
        if best < 0:
            break
        held[best] += 1
        score = best_score
    return Holding(tuple(int(n) for n in held), score[0], float(held @ prices))


def _give_back(
    held: np.ndarray,
    speeds: np.ndarray,
    lost: np.ndarray,
    losses: Losses,
    required: float,
    base: float,
    target: float,
    limit: int,
) -> np.ndarray:
    """Machines held already, less those not needed: one at a time, the riskiest first, while ``E[C] >= R``
    and ``P(C >= R) >= target`` still hold without it (and always down to ``limit``)."""
    held = held.copy()
    for i in np.argsort(-losses.p).tolist():
        while held[i] > 0:
            held[i] -= 1
            alive, _, expected = survival(held, speeds, lost, losses.fraction, required, base)
            if held.sum() >= limit or (expected >= 1.0 and alive >= target):
                continue
            held[i] += 1
            break
    return held
