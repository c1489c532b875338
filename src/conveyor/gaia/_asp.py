"""Gaia's Approximate Synchronous Parallel between sites: only significant updates cross the WAN.

Sites ``d = 1..D`` hold replicas of a stage; inside a site they all-reduce as usual. At update ``t`` site ``d``
holds its share of the batch's mean gradient, ``g_d(t) = (1/N) sum over its samples i of grad l_i`` (so that
``sum_d g_d(t)`` is the whole batch's mean gradient ``g(t)``), and its leader keeps what it has not sent yet:

    a_d <- a_d + g_d(t)

An entry is **significant** when the step it would make is a large enough part of the weight it moves:

    S_d(t) = { i : eta |a_d,i| > tau |w_d,i| }

with ``eta`` the optimizer's learning rate and ``w_d`` the site's weights. The leader posts the significant
entries ``u_d(t) = sum over i in S_d(t) of round(a_d,i) e_i`` to every other site and takes them out of ``a_d``,
``a_d <- a_d - u_d(t)`` (``round``: to bfloat16 by default, ``wire_dtype``; what it leaves out stays pending); the
insignificant ones wait, accumulating, until they matter. The exchange (a notice of the entry count and size, then
the payloads, sent only by the sites that announced some: :mod:`conveyor.gaia._exchange`) runs beside the training,
and every replica of site ``d`` steps its optimizer with

    G_d(t) = g_d(t) + sum over e != d, over the exchanges t' the site takes at t, of u_e(t')

its own share at once (a site always sees its own updates) and the others' significant ones as they arrive.
The **mirror clock** bounds how late: at update ``t`` a site takes every exchange already finished and waits for
those posted at ``t - s + 1`` or before (``s``, ``staleness``, at least 1), so no significant update is read
more than ``s - 1`` updates after it was posted. With ``s = 1`` and ``tau = 0`` every non-zero entry is
significant and taken at once, so with float32 on the wire ``G_d(t) = g(t)`` on every site: synchronous data
parallelism, whatever the optimizer. The sites' weights otherwise differ by what is pending and in flight.

The sites **exchange every** ``p`` **updates** (``period``, 1 by default): ``a_d`` takes every update's share,
but only at updates ``t = p, 2p, ...`` is it tested and posted and are exchanges taken, so in between
``G_d(t) = g_d(t)`` and the filter's passes over every weight, the notice and the site's broadcast are not paid;
the mirror clock then counts exchanges, ``s - 1`` of them being ``(s - 1) p`` updates.

With ``estimate``, a site steps with ``D g_d(t)`` and replaces its stand-in for another site's share by what
that site sent, as it arrives (:mod:`conveyor.gaia._estimate`).

Where Conveyor departs from Gaia (NSDI'17), stated: the mirror clock counts updates between a post and its
reading (Gaia's parameter servers bound the clocks' distance between data centres); the threshold is fixed for
the run (Gaia lowers it over time); the significance is the SGD step ``eta a`` for every optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conveyor.gaia._estimate import OwnShares
from conveyor.gaia._exchange import Courier, Payload, share_in_site
from conveyor.gaia._filter import SignificanceFilter
from conveyor.gaia._sparse import WIRE_DTYPES
from conveyor.runtime.parts import SiteLinks, pack_grads, set_mean_grads

__all__ = ["Gaia"]


class Gaia:
    """The significance filter, selective barrier and mirror clock between sites (see the module docstring).

    Args:
        sites: how many sites the workers sit in (ranks handed out site by site).
        threshold: ``tau``, the relative change that makes an update significant (Gaia evaluated 1%, which sent
            three times 5%'s bytes in ``conveyor bench wan``'s sweep); 0 sends every update at once.
        staleness: ``s``, the mirror clock's bound: an update is read at most ``s - 1`` exchanges after it was
            posted (1: each exchange is waited for at once, no overlap; more cost accuracy in the sweep).
        period: ``p``, updates between exchanges (1: every update; ``conveyor train --wan-period`` defaults to 2).
        estimate: stand the site's own share in for what the other sites hold back until they send it
            (:mod:`conveyor.gaia._estimate`).
        wire_dtype: the significant values cross the WAN as bfloat16 (what rounding leaves out stays pending) or
            float32 (exactly; with ``threshold`` 0 and ``staleness`` 1, synchronous data parallelism bit for bit).
    """

    site_mean = False

    def __init__(
        self,
        sites: int,
        *,
        threshold: float = 0.05,
        staleness: int = 1,
        period: int = 1,
        estimate: bool = False,
        wire_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if not 0 <= threshold < 1 or staleness < 1 or period < 1:
            raise ValueError(
                f"threshold must be in [0, 1), staleness and period at least 1, got {threshold}, {staleness}, {period}"
            )
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype is torch.bfloat16 or torch.float32, got {wire_dtype}")
        self.wire_dtype = wire_dtype
        self.sites, self.threshold, self.staleness, self.period = sites, threshold, staleness, period
        self.update = 0  # updates so far, on every replica (each knows which updates exchange)
        self.estimate = estimate
        self.own: OwnShares | None = None  # S_d and B_d,e, every replica's, with the estimate
        self.links: SiteLinks | None = None
        self.n = 0  # the stage's entries, all its parameters flattened (known at attach)
        self.filter: SignificanceFilter | None = None  # a_d and the test on it, the leader's
        self.courier: Courier | None = None
        self._counts = _Counts()

    def attach(self, params: Sequence[torch.Tensor], links: SiteLinks) -> None:
        self.links, self.n = links, sum(p.numel() for p in params)
        if self.estimate:
            others = [e for e in range(links.sites) if e != links.index]
            self.own = OwnShares(self.n, others, device=links.device)
        if links.is_leader:
            self.filter = SignificanceFilter(
                self.n, threshold=self.threshold, device=links.device, wire_dtype=self.wire_dtype
            )
            self.courier = Courier(links, self.n)

    def after_reduce(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> bool:
        assert self.links is not None
        now, self.update = self.update, self.update + 1
        self._counts.updates += 1
        if self.filter is not None:
            self.filter.add(params)
        if self.own is not None:
            self.own.add(params)  # S_d, before .grad becomes D g_d
            if shares := [p.grad for p in params if p.grad is not None]:
                torch._foreach_mul_(shares, float(self.links.sites))
        if self.update % self.period:
            return False  # not an exchange: the site steps with its own share (D times it), already on .grad
        payloads: list[Payload] = []
        if self.courier is not None:
            lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else 1.0
            self.courier.post(*self._significant(params, lr, now))
            for delivery in self.courier.take(behind=self.staleness - 1):
                self._counts.delivered(self.period * (self.courier.posted - 1 - delivery.update), delivery.sent)
                payloads += delivery.payloads
        received = share_in_site(self.links, payloads, self.n)
        if not received:
            return False  # the site steps with its own share (D times it), already on .grad
        grads = pack_grads(params, torch.float32, self.links.device)
        for site, where, what in received:
            grads.index_add_(0, where, what if self.own is None else what - self.own.estimated(site, where))
        set_mean_grads(params, grads, 1)
        return True

    def _significant(self, params: Sequence[torch.Tensor], lr: float, now: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Take out and return the significant entries of what is pending at update ``now``
        (:class:`~conveyor.gaia._filter.SignificanceFilter`). An entry's age is counted from the update it was
        last sent at (updates where its gradient was exactly 0, a dead ReLU's, count too)."""
        assert self.filter is not None
        indices, values, ages = self.filter.select(params, lr, now)
        self._counts.posted(ages, int(self.filter.pending.numel()))
        return indices, values

    def after_step(self, params: Sequence[torch.Tensor]) -> None:
        """Gaia replaces no weights: each site's own steps move them."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The updates counted (so a resumed run exchanges at the same updates), the estimate's sums if any, and,
        on the leader, its unsent updates ``a_d``."""
        state = {"update": torch.tensor(self.update), **(self.own.state_dict() if self.own is not None else {})}
        return state if self.filter is None else {**state, "pending": self.filter.pending.cpu()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.update = int(state["update"]) if "update" in state else self.update
        if self.own is not None and "own_total" in state:
            self.own.load_state_dict(state)
        if self.filter is not None and "pending" in state:
            self.filter.pending.copy_(state["pending"])

    def records(self) -> dict[str, Any]:
        assert self.links is not None
        out = self._counts.summary(self.links.site)
        self._counts = _Counts()
        return out


class _Counts:
    """What one site's leader posted and took since the last :meth:`Gaia.records`."""

    def __init__(self) -> None:
        self.updates = self.entries = self.wan_bytes = self.size = self.waited_max = self.late_max = 0
        self.waited_sum = self.late_sum = 0.0
        self.deliveries = 0

    def posted(self, ages: torch.Tensor, size: int) -> None:
        """Entries posted, each after ``ages`` updates pending (1: posted at the update that made it)."""
        self.size = size
        if ages.numel():
            self.entries += int(ages.numel())
            self.waited_sum += float((ages - 1).sum())
            self.waited_max = max(self.waited_max, int(ages.max()) - 1)

    def delivered(self, late: int, sent: int) -> None:
        """An exchange taken ``late`` updates after it was posted; the bytes this leader sent in it."""
        self.deliveries += 1
        self.late_sum += late
        self.late_max = max(self.late_max, late)
        self.wan_bytes += sent

    def summary(self, site: int) -> dict[str, Any]:
        """``staleness``: updates between a change and its reading by the other sites, its time pending (an
        insignificant change waits) plus its exchange's lateness (the mirror clock's bound)."""
        waited = self.waited_sum / self.entries if self.entries else 0.0
        late = self.late_sum / self.deliveries if self.deliveries else 0.0
        return {
            "site": site,
            "updates": self.updates,
            "entries_sent": self.entries,
            "sent_fraction": self.entries / (self.updates * self.size) if self.updates and self.size else 0.0,
            "payload_bytes": self.wan_bytes,
            "pending_mean": waited,
            "pending_max": self.waited_max,
            "late_mean": late,
            "late_max": self.late_max,
            "staleness_mean": waited + late,
            "staleness_max": self.waited_max + self.late_max,
        }
