"""BidBrain's objective: the expected cost per unit of work of holding machines in each market (no torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.elastic._market import Billing
from conveyor.elastic._throughput import Costs, Throughput

__all__ = ["AT_END_S", "Offer", "hold_cost", "paid_left", "plan_holdings"]

AT_END_S = 1e-6  # a machine whose paid time ends within this many seconds is at its end (free to release)


def hold_cost(price: float, rate: float, hours: float, billing: Billing) -> float:
    """Expected dollars to hold one machine ``hours`` past the end of its paid time, then release it.

    Per second: ``C(x) = p x``. Hourly-2016: each started hour costs ``p`` unless the provider revokes the machine
    during the part of the hour that is used (then it is free); with ``r`` revocations per machine-hour (Poisson),
    the ``k``-th hour of ``x`` is used for ``f_k = min(1, x - k + 1)`` hours and charged with probability
    ``exp(-r f_k)``:

    ``C(x) = p * sum_{k=1}^{ceil(x)} exp(-r * min(1, x - k + 1))``,  and ``C(x) = 0`` for ``x <= 0``.

    A revoked machine's later hours are those of its replacement (same market, same price).

    Example:
        >>> hourly = Billing("hourly-2016")
        >>> hold_cost(1.0, 0.0, 10 / 60, hourly), hold_cost(1.0, 0.0, 1.5, hourly), hold_cost(1.0, 0.0, -0.5, hourly)
        (1.0, 2.0, 0.0)
        >>> round(hold_cost(1.0, 0.2, 1.5, hourly), 4)  # exp(-0.2) + exp(-0.1)
        1.7236
        >>> hold_cost(1.0, 0.2, 1.5, Billing("per-second"))
        1.5
    """
    if hours <= 1e-9:  # Billing's tolerance: paid time that ends when the job does costs nothing more
        return 0.0
    if not billing.hourly:
        return price * hours
    n = max(1, math.ceil(hours - 1e-9))
    return price * ((n - 1) * math.exp(-rate) + math.exp(-rate * min(1.0, hours - n + 1)))


def paid_left(billing: Billing, starts: Sequence[float], now: float) -> list[float]:
    """Hours of paid time left at ``now`` on machines started at ``starts``, longest first (0 at its end).

    Example:
        >>> paid_left(Billing("hourly-2016"), [0.0, 3000.0, 600.0], 3600.0)  # 0 at an hour's end: renew or release
        [0.8333333333333334, 0.16666666666666666, 0.0]
    """
    left = [billing.paid_until(s, now) - now for s in starts]
    return sorted((x / 3600.0 if x > AT_END_S else 0.0 for x in left), reverse=True)


@dataclass(frozen=True)
class Offer:
    """What one market offers BidBrain at a decision.

    Attributes:
        price: dollars per machine-hour.
        speed: each machine's speed (V100 = 1).
        rate: revocations per machine-hour, estimated from the past.
        paid: hours of paid time left on each machine held, longest first (:func:`paid_left`).
        free: machines one may add now.
    """

    price: float
    speed: float
    rate: float
    paid: tuple[float, ...] = ()
    free: int = 0


def plan_holdings(
    x: Throughput, remaining: float, *, offers: Sequence[Offer], reliable: Offer, costs: Costs, billing: Billing
) -> list[int]:
    """BidBrain's choice: how many machines ``h_m`` to hold in each market to finish ``remaining`` samples at the
    least expected cost, that is the least expected cost per unit of the remaining work ``W``:

    ``J(h) = ( sum_{j in R} C_R(T(h) - tau_j) + sum_m sum_{j=1}^{h_m} C_m(T(h) - tau_{m,j}) ) / W``,

    ``T(h) = W / X_u(h)`` (hours),  ``X_u(h) = X(n, s) * (1 - sum_m h_m r_m (T_rev + T_add + T_redo(h)) / 3600)``,

    with ``C_m`` the expected charge of holding a machine of market ``m`` past its paid time (:func:`hold_cost`:
    per second ``p_m x``; hourly-2016 every started hour, free when a revocation ends it, the last one only
    partly used), ``tau_{m,j}`` the paid hours left on the ``j``-th machine held in ``m`` (longest first, 0 for a
    machine at the end of its paid time or a new one), ``R`` the reliable tier (on-demand, ``r = 0``, always
    held), ``X(n, s)`` the throughput of ``n`` machines of summed speed ``s`` (reliable tier included), ``r_m``
    the market's revocations per machine-hour and ``T_redo`` the steps redone after one.

    Hence (a) a machine with paid time left costs nothing until it ends: it is always kept (``h_m`` is at least
    the number of them) and used, and released, if at all, only at the end of its paid time; (b) an hour that a
    revocation may end costs ``p_m exp(-r_m f)``; (c) a new hour is charged in full however little of it the
    remaining work uses, so near the end BidBrain starts no hour whose work does not pay for it. Per second this
    is ``(K p_R + sum_m h_m p_m) / X_u(h)``, the cost per sample at a steady rate. Search: from the machines whose
    paid time is not over, repeatedly set one market's count to the value that lowers ``J`` most (a jump of
    several machines, as one more can cost more than it brings where several pay off), each market between its
    machines with paid time left and its held and free machines.

    Example:
        >>> one, hourly = Throughput(batch=1, compute_s=1.0), Billing("hourly-2016")
        >>> busy = Offer(price=0.36, speed=1.0, rate=0.0, paid=(40 / 60, 40 / 60), free=8)
        >>> rel = Offer(price=3.6, speed=1.0, rate=0.0, paid=(40 / 60,))
        >>> free = Costs(revocation_s=0, addition_s=0, steps_redone=0)
        >>> # 10 min of work on 3 paid machines: add no hour
        >>> plan_holdings(one, 3 * 600.0, offers=[busy], reliable=rel, costs=free, billing=hourly)
        [2]
        >>> now, rel_now = Offer(0.36, 1.0, 0.0, paid=(0.0, 0.0), free=8), Offer(3.6, 1.0, 0.0, paid=(0.0,))
        >>> # per second, all 8 pay off
        >>> plan_holdings(one, 3 * 600.0, offers=[now], reliable=rel_now, costs=free, billing=Billing("per-second"))
        [10]
    """
    c, k_r = costs, len(reliable.paid)
    locked = [sum(1 for p in o.paid if p > 0) for o in offers]
    top = [len(o.paid) + o.free for o in offers]

    def useful(h: list[int]) -> float:
        n = k_r + sum(h)
        s = k_r * reliable.speed + sum(k * o.speed for k, o in zip(h, offers, strict=True))
        overhead = c.revocation_s + c.addition_s + c.steps_redone * x.step_s(n, s)
        churn = sum(k * o.rate for k, o in zip(h, offers, strict=True)) * overhead / 3600.0
        return x(n, s) * (1.0 - churn)

    def cost(h: list[int]) -> float:
        rate = useful(h)
        if rate <= 0:
            return math.inf
        hours = remaining / rate / 3600.0
        total = sum(hold_cost(reliable.price, 0.0, hours - tau, billing) for tau in reliable.paid)
        for k, o in zip(h, offers, strict=True):
            kept = o.paid[:k] + (0.0,) * max(0, k - len(o.paid))
            total += sum(hold_cost(o.price, o.rate, hours - tau, billing) for tau in kept)
        return total

    def descend(h: list[int]) -> tuple[float, list[int]]:
        """Set one market's count to its best value (up or down, within bounds) while that lowers ``J``."""
        best = cost(h)
        while True:
            trials = [
                (cost([*h[:i], v, *h[i + 1 :]]), i, v)
                for i in range(len(offers))
                for v in range(locked[i], top[i] + 1)
                if v != h[i]
            ]
            if not trials or min(trials)[0] >= best * (1 - 1e-9):
                return best, h
            best, i, v = min(trials)
            h = [*h[:i], v, *h[i + 1 :]]

    return descend(list(locked))[1]
