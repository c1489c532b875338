"""BidBrain (Proteus, EuroSys'17) and its baselines, replayed over spot-availability traces (no torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conveyor.elastic._market import Billing, Market
from conveyor.elastic._objective import AT_END_S, Offer, paid_left, plan_holdings
from conveyor.elastic._throughput import Costs, Throughput
from conveyor.errors import InputError

__all__ = ["SPOT_POLICIES", "SpotOutcome", "simulate_spot"]

SPOT_POLICIES = ("on-demand", "checkpoint-restart", "elastic-fixed", "bidbrain")


@dataclass
class SpotOutcome:
    """One policy's run: what it cost, how long it took, and what it lost."""

    policy: str
    cost: float = 0.0
    seconds: float = 0.0
    work: float = 0.0
    revocations: int = 0
    additions: int = 0
    work_lost: float = 0.0
    finished: bool = True
    machine_hours: dict[str, float] = field(default_factory=dict)
    held: list[tuple[float, int]] = field(default_factory=list)  # (seconds, machines held) at each change
    spans: list[tuple[str, float, float, str]] = field(default_factory=list)  # (market, start, end, why it ended)

    def report(self) -> dict[str, Any]:
        """JSON-ready: cost in $, cost per work in $ per million samples."""
        per = self.cost / self.work * 1e6 if self.work else math.inf
        return {
            "policy": self.policy,
            "cost": self.cost,
            "seconds": self.seconds,
            "work": self.work,
            "cost_per_work": per,
            "cost_per_work_unit": "$ per 1M samples",
            "revocations": self.revocations,
            "additions": self.additions,
            "work_lost": self.work_lost,
            "finished": self.finished,
            "machine_hours": self.machine_hours,
        }


class _Sim:
    """The shared replay: capacity per market, the machines held, their bills, and the job's work."""

    def __init__(self, policy: str, *, markets: Sequence[Market], machines: int, billing: Billing) -> None:
        self.markets, self.billing, self.out, self.machines = list(markets), billing, SpotOutcome(policy), machines
        self.events = sorted((t, i, float(n)) for i, m in enumerate(self.markets) for t, n in m.counts())
        self.cap = [0.0] * len(self.markets)
        self.held: list[list[float]] = [[] for _ in self.markets]  # start times of held spot machines
        self.debt = [0.0] * len(self.markets)
        self.lost = [0.0] * len(self.markets)  # capacity lost so far (scaled machines), for the online estimate
        self.exposure = [0.0] * len(self.markets)  # capacity-hours seen so far
        self.seen = 0.0

    def advance_to(self, t: float) -> list[tuple[int, int]]:
        """Apply the trace up to ``t``; return ``(market, machines revoked)`` for each of the job's losses."""
        revoked = []
        while self.events and self.events[0][0] <= t:
            when, i, c1 = self.events.pop(0)
            for j, c in enumerate(self.cap):
                self.exposure[j] += c * (when - self.seen) / 3600.0
            self.seen, c0 = when, self.cap[i]
            self.cap[i] = c1
            h = len(self.held[i])
            if c1 < c0:
                self.lost[i] += c0 - c1
                self.debt[i] += h * (c0 - c1) / c0
            k = min(h, max(math.floor(self.debt[i] + 1e-9), h - math.floor(c1 + 1e-9)))
            if k > 0:
                self.debt[i] = max(0.0, self.debt[i] - k)
                for start in self.held[i][-k:]:
                    self.bill(i, start, when, "revoked")
                del self.held[i][-k:]
                self.out.revocations += k
                revoked.append((i, k))
        return revoked

    def free(self, i: int) -> int:
        return max(0, min(math.floor(self.cap[i] + 1e-9), self.machines) - len(self.held[i]))

    def rate(self, i: int) -> float:
        """Revocations per machine-hour in market ``i`` from the past alone (a Gamma prior's posterior mean)."""
        return (self.lost[i] + self.prior[0]) / (self.exposure[i] + self.prior[1])

    prior = (1.0, 10.0)

    def acquire(self, i: int, k: int, t: float) -> None:
        self.held[i].extend([t] * k)
        self.out.additions += k

    def bill(self, i: int, start: float, end: float, why: str, on_demand: bool = False) -> None:
        """Charge one machine held over ``[start, end]``; ``why``: "revoked", "released" or "finished"."""
        m = self.markets[i]
        price = m.price.on_demand if on_demand else m.price.spot
        self.out.cost += self.billing.charge(price, start, end, revoked=why == "revoked")
        key = m.name + (" on-demand" if on_demand else "")
        self.out.machine_hours[key] = self.out.machine_hours.get(key, 0.0) + (end - start) / 3600.0
        self.out.spans.append((key, start, end, why))

    def log(self, t: float, n: int) -> None:
        if not self.out.held or self.out.held[-1][1] != n:
            self.out.held.append((t, n))


def _spot_home(markets: Sequence[Market]) -> int:
    return min(range(len(markets)), key=lambda i: markets[i].price.spot / markets[i].price.speed)


def _on_demand_home(markets: Sequence[Market]) -> int:
    return min(range(len(markets)), key=lambda i: markets[i].price.on_demand / markets[i].price.speed)


def _on_demand(markets: Sequence[Market], x: Throughput, work: float, fleet: int, billing: Billing) -> SpotOutcome:
    i = _on_demand_home(markets)
    sim = _Sim("on-demand", markets=markets, machines=fleet, billing=billing)
    seconds = work / x(fleet, fleet * markets[i].price.speed)
    for _ in range(fleet):
        sim.bill(i, 0.0, seconds, "finished", on_demand=True)
    sim.out.seconds, sim.out.work = seconds, work
    sim.out.held = [(0.0, fleet), (seconds, 0)]
    return sim.out


def simulate_spot(
    policy: str,
    markets: Sequence[Market],
    throughput: Throughput,
    work: float,
    *,
    fleet: int = 8,
    reliable: int = 1,
    machines: int = 16,
    billing: Billing | str = "per-second",
    costs: Costs | None = None,
) -> SpotOutcome:
    """Replay ``policy`` until ``work`` samples are done (see :mod:`conveyor.elastic` for the policies).

    A market's capacity is its trace's live count ``c(t)``, of which the job may hold up to ``machines``; when
    ``c`` falls from ``c0`` to ``c1`` the provider revokes machines at random, so the job loses
    ``held * (c0 - c1) / c0`` of its machines in expectation (fractions carried over to the next fall, and at
    least enough to fit in ``c1``), without notice. After a trace's last event its capacity stays as it ended.
    All traces start at 0 s together.

    Example:
        >>> from conveyor.elastic._market import MarketPrice
        >>> m = Market("toy", MarketPrice("toy", 3.6, 0.36), tuple((0.0, "add", s) for s in range(4)))
        >>> out = simulate_spot("on-demand", [m], Throughput(1, 1.0), 7200.0, fleet=2, machines=4)
        >>> out.seconds, round(out.cost, 6)  # 2 machines x 3600 s at $3.6/h
        (3600.0, 7.2)
    """
    if policy not in SPOT_POLICIES:
        raise InputError(f"unknown policy {policy!r}: choose from {', '.join(SPOT_POLICIES)}")
    if not markets:
        raise InputError("simulate needs at least one market")
    if not (work > 0 and fleet >= 1 and machines >= 1 and reliable >= 0):
        raise InputError(
            f"need work > 0, fleet >= 1, machines >= 1, reliable >= 0; got {work}, {fleet}, {machines}, {reliable}"
        )
    if policy in ("elastic-fixed", "bidbrain") and reliable < 1:
        raise InputError(f"{policy} keeps its state on a reliable tier: give reliable >= 1")
    billing = billing if isinstance(billing, Billing) else Billing(billing)
    if policy == "on-demand":
        return _on_demand(markets, throughput, work, fleet, billing)
    return _Replay(
        policy,
        markets=markets,
        x=throughput,
        work=work,
        fleet=fleet,
        reliable=reliable,
        machines=machines,
        billing=billing,
        costs=costs or Costs(),
    ).run()


class _Replay(_Sim):
    """The event loop for the three spot policies."""

    def __init__(
        self,
        policy: str,
        *,
        markets: Sequence[Market],
        x: Throughput,
        work: float,
        fleet: int,
        reliable: int,
        machines: int,
        billing: Billing,
        costs: Costs,
    ) -> None:
        super().__init__(policy, markets=markets, machines=machines, billing=billing)
        self.x, self.work, self.fleet, self.costs = x, work, fleet, costs
        self.prior = (costs.prior_revocations, costs.prior_hours)
        self.home = _spot_home(markets)
        self.reliable = 0 if policy == "checkpoint-restart" else reliable
        self.done = self.saved = 0.0
        self.stall_until = 0.0
        self.waiting = policy == "checkpoint-restart"  # torchrun waits for all its nodes
        self.next_checkpoint = math.inf

    def speeds(self) -> tuple[int, float]:
        n = self.reliable + sum(len(h) for h in self.held)
        s = self.reliable * self.markets[self.home].price.speed
        return n, s + sum(len(h) * m.price.speed for h, m in zip(self.held, self.markets, strict=True))

    def run(self) -> SpotOutcome:
        t, p, c = 0.0, self.out.policy, self.costs
        next_decision = 0.0
        while True:
            self.on_revoked(self.advance_to(t), t)
            if p == "bidbrain" and t >= next_decision - 1e-9:
                next_decision = t + c.decide_every_s
            self.decide(t)
            self.log(t, self.speeds()[0])
            n, s = self.speeds()
            rate = 0.0 if self.waiting else self.x(n, s)
            nxt = min(
                self.events[0][0] if self.events else math.inf,
                next_decision if p == "bidbrain" else math.inf,
                self.stall_until if self.stall_until > t else math.inf,
                self.next_checkpoint,
                self.wake(t),
            )
            begin = max(t, self.stall_until)
            if rate > 0 and begin + (self.work - self.done) / rate <= nxt:
                t = begin + (self.work - self.done) / rate
                self.done = self.work
                break
            if math.isinf(nxt):
                self.out.finished = False
                break
            self.done += rate * max(0.0, nxt - begin)
            t = nxt
            if t >= self.next_checkpoint - 1e-9 and not self.waiting:  # write one: a pause, and the work is safe
                self.saved, self.stall_until = self.done, t + c.checkpoint_s
                self.next_checkpoint = self.stall_until + c.checkpoint_every_s
        self.finish(t)
        return self.out

    def on_revoked(self, revoked: list[tuple[int, int]], t: float) -> None:
        if not revoked:
            return
        c = self.costs
        if self.out.policy == "checkpoint-restart":  # everyone stops; the work since the checkpoint is gone
            self.out.work_lost += self.done - self.saved
            self.done, self.waiting, self.next_checkpoint = self.saved, True, math.inf
            return
        n, _ = self.speeds()
        before = sum(k for _, k in revoked) + n
        redo = min(self.done, c.steps_redone * before * self.x.batch)
        self.done -= redo
        self.out.work_lost += redo
        self.stall_until = max(self.stall_until, t) + c.revocation_s

    def decide(self, t: float) -> None:
        p, c, h = self.out.policy, self.costs, self.home
        if p == "checkpoint-restart":
            if k := min(self.free(h), self.fleet - len(self.held[h])):
                self.acquire(h, k, t)
            if self.waiting and len(self.held[h]) == self.fleet:
                self.waiting, self.stall_until = False, t + c.restart_s
                self.next_checkpoint = self.stall_until + c.checkpoint_every_s
            return
        want = [0] * len(self.markets)
        if p == "elastic-fixed":
            want[h] = self.fleet
        else:
            want = self.bidbrain(t)
        added = False
        for i, w in enumerate(want):
            if (k := min(self.free(i), w - len(self.held[i]))) > 0:
                self.acquire(i, k, t)
                added = True
            elif w < len(self.held[i]):
                self.release(i, len(self.held[i]) - w, t)
        if added:
            self.stall_until = max(self.stall_until, t) + c.addition_s

    def release(self, i: int, k: int, t: float) -> None:
        """Give back up to ``k`` machines of market ``i``, only those at the end of their paid time (hourly: of a
        billed hour; per second: past the 60 s minimum): the others are paid for anyway, so they keep working
        until then, when :meth:`wake` brings the next decision."""
        ends = sorted((self.billing.paid_until(s, t), s) for s in self.held[i])
        for end, start in ends[:k]:
            if end - t <= AT_END_S:
                self.held[i].remove(start)
                self.bill(i, start, t, "released")

    def wake(self, t: float) -> float:
        """BidBrain's next look: the earliest end of a held machine's paid time after ``t`` (to renew or release
        it exactly then)."""
        if self.out.policy != "bidbrain":
            return math.inf
        ends = (self.billing.paid_until(s, t) for held in self.held for s in held)
        return min((u for u in ends if u - t > AT_END_S), default=math.inf)

    def bidbrain(self, t: float) -> list[int]:
        """Machines to hold per market: :func:`plan_holdings` on what the job holds now and what it has seen so far."""
        ms, billing = self.markets, self.billing
        offers = [
            Offer(m.price.spot, m.price.speed, self.rate(i), tuple(paid_left(billing, held, t)), self.free(i))
            for i, (m, held) in enumerate(zip(ms, self.held, strict=True))
        ]
        home = ms[self.home].price
        reliable = Offer(home.on_demand, home.speed, 0.0, tuple(paid_left(billing, [0.0] * self.reliable, t)), 0)
        return plan_holdings(
            self.x, self.work - self.done, offers=offers, reliable=reliable, costs=self.costs, billing=billing
        )

    def finish(self, t: float) -> None:
        for i, held in enumerate(self.held):
            for start in held:
                self.bill(i, start, t, "finished")
        for _ in range(self.reliable):
            self.bill(self.home, 0.0, t, "finished", on_demand=True)
        self.held = [[] for _ in self.markets]
        self.out.seconds, self.out.work = t, self.done
        self.log(t, 0)
