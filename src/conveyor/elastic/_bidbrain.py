"""BidBrain (Proteus, EuroSys'17) and its baselines, replayed over spot-availability traces (no torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conveyor.elastic._market import Billing, Market
from conveyor.plan import Profile, Topology
from conveyor.plan._cost_model import stage_seconds

__all__ = ["POLICIES", "Costs", "Offer", "Outcome", "Throughput", "hold_cost", "paid_left", "plan", "simulate",
           "throughput_from_plan"]  # fmt: skip

POLICIES = ("on-demand", "checkpoint-restart", "elastic-fixed", "bidbrain")


@dataclass(frozen=True)
class Throughput:
    """Synchronous data parallelism: ``m`` machines of summed speed ``s`` (V100 = 1) each take a share of a step
    of ``m * batch`` samples sized to their speed, then all-reduce:

    ``step_s(m, s) = max(m * compute_s / s + ring_s(m), min_step_s)`` and ``samples/s = m * batch / step_s``,

    where ``ring_s(m)`` is the planner's ring all-reduce of the weights among ``m`` machines (the last entry
    holds beyond the table) and ``min_step_s`` the reliable tier's limit (:func:`throughput_from_plan`).

    Example:
        >>> x = Throughput(batch=10, compute_s=1.0, ring_s=(0.0, 1.0))
        >>> x(1), x(2), x(4, speed=8.0)  # one, two (1 s of all-reduce), four machines twice as fast
        (10.0, 10.0, 26.666666666666668)
    """

    batch: int
    compute_s: float
    ring_s: tuple[float, ...] = (0.0,)
    min_step_s: float = 0.0

    def step_s(self, machines: int, speed: float | None = None) -> float:
        """Seconds per step of ``machines`` machines whose speeds sum to ``speed`` (default: one each)."""
        if machines <= 0:
            return math.inf
        speed = float(machines) if speed is None else speed
        ring = self.ring_s[min(machines, len(self.ring_s)) - 1]
        return max(machines * self.compute_s / speed + ring, self.min_step_s)

    def __call__(self, machines: int, speed: float | None = None) -> float:
        return 0.0 if machines <= 0 else machines * self.batch / self.step_s(machines, speed)


def throughput_from_plan(
    profile: Profile,
    batch: int,
    bandwidth: float = 1.17e9,
    latency: float = 0.0,
    max_machines: int = 256,
    reliable: int = 1,
    reliable_bandwidth: float | None = None,
    backup_bytes: float | None = None,
) -> Throughput:
    """Data parallelism on ``1..max_machines`` machines as the planner's cost model charges it (each machine its
    own server on a ``bandwidth`` link), with the reliable tier's limit.

    The reliable tier holds the state backups: every step it receives the updated weights (``backup_bytes``,
    default the profile's parameter bytes), spread over its ``reliable`` machines' links, so a step takes at least
    ``min_step_s = backup_bytes / (reliable * reliable_bandwidth)``. It binds when the transient tier is large and
    fast and the reliable tier's links are slow (for example in another region). ``reliable=0``: no limit.

    Example:
        >>> p = Profile.chain("toy", [0.1], [0.2], [0], [4e8], batch_size=32)
        >>> x = throughput_from_plan(p, 32, bandwidth=1e9, max_machines=4, reliable=1, reliable_bandwidth=1e8)
        >>> round(x.step_s(1), 3), round(x.step_s(4), 3)  # 0.3 s of compute; the 4 s backup binds
        (4.0, 4.0)
    """
    compute = profile.compute_s(0, len(profile.layers))
    weights = float(profile.param_bytes(0, len(profile.layers)))
    top = Topology.parse(f"{max_machines}:{bandwidth:g}" + (f"/{latency}s" if latency else ""))
    m = np.arange(1, max_machines + 1)
    per_minibatch = stage_seconds("physical", top, 0, compute, weights, 0.0, 0.0, m, per_update=m)
    ring = (m * per_minibatch - compute).tolist()
    backup = weights if backup_bytes is None else backup_bytes
    limit = backup / (reliable * (reliable_bandwidth or bandwidth)) if reliable else 0.0
    return Throughput(batch, compute, tuple(max(r, 0.0) for r in ring), limit)


@dataclass(frozen=True)
class Costs:
    """Measured overheads (seconds of the whole job) and the simulation's knobs.

    Attributes:
        revocation_s: the survivors' lost time per revocation (Conveyor elastic).
        addition_s: the job's pause per addition of machines (Conveyor elastic).
        restart_s: a restart with a reload from the last checkpoint (torchrun).
        steps_redone: steps recomputed after a revocation (Conveyor elastic).
        checkpoint_s: the pause to write a checkpoint (checkpoint-restart).
        checkpoint_every_s: running seconds between checkpoints.
        decide_every_s: BidBrain's decision period beside every trace event.
        prior_revocations: BidBrain's prior on a market's revocation rate: this many revocations ...
        prior_hours: ... in this many machine-hours.
    """

    revocation_s: float = 30.0
    addition_s: float = 20.0
    restart_s: float = 120.0
    steps_redone: float = 1.0
    checkpoint_s: float = 30.0
    checkpoint_every_s: float = 600.0
    decide_every_s: float = 300.0
    prior_revocations: float = 1.0
    prior_hours: float = 10.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"cost {name} must be a finite number >= 0, got {value}")
        if self.checkpoint_every_s <= 0 or self.decide_every_s <= 0 or self.prior_hours <= 0:
            raise ValueError("checkpoint_every_s, decide_every_s and prior_hours must be > 0")


@dataclass
class Outcome:
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
        return {"policy": self.policy, "cost": self.cost, "seconds": self.seconds, "work": self.work,
                "cost_per_work": per, "cost_per_work_unit": "$ per 1M samples", "revocations": self.revocations,
                "additions": self.additions, "work_lost": self.work_lost, "finished": self.finished,
                "machine_hours": self.machine_hours}  # fmt: skip


_AT_END_S = 1e-6  # a machine whose paid time ends within this many seconds is at its end (free to release)


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
    return sorted((x / 3600.0 if x > _AT_END_S else 0.0 for x in left), reverse=True)


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


def plan(x: Throughput, remaining: float, offers: Sequence[Offer], reliable: Offer, costs: Costs,
         billing: Billing) -> list[int]:  # fmt: skip
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
        >>> plan(one, 3 * 600.0, [busy], rel, free, hourly)  # 10 min of work on 3 paid machines: add no hour
        [2]
        >>> now, rel_now = Offer(0.36, 1.0, 0.0, paid=(0.0, 0.0), free=8), Offer(3.6, 1.0, 0.0, paid=(0.0,))
        >>> plan(one, 3 * 600.0, [now], rel_now, free, Billing("per-second"))  # per second, all 8 pay off
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
            trials = [(cost([*h[:i], v, *h[i + 1 :]]), i, v)
                      for i in range(len(offers)) for v in range(locked[i], top[i] + 1) if v != h[i]]  # fmt: skip
            if not trials or min(trials)[0] >= best * (1 - 1e-9):
                return best, h
            best, i, v = min(trials)
            h = [*h[:i], v, *h[i + 1 :]]

    return descend(list(locked))[1]


class _Sim:
    """The shared replay: capacity per market, the machines held, their bills, and the job's work."""

    def __init__(self, policy: str, markets: Sequence[Market], machines: int, billing: Billing) -> None:
        self.markets, self.billing, self.out, self.machines = list(markets), billing, Outcome(policy), machines
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


def _on_demand(markets: Sequence[Market], x: Throughput, work: float, fleet: int, billing: Billing) -> Outcome:
    i = _on_demand_home(markets)
    sim = _Sim("on-demand", markets, fleet, billing)
    seconds = work / x(fleet, fleet * markets[i].price.speed)
    for _ in range(fleet):
        sim.bill(i, 0.0, seconds, "finished", on_demand=True)
    sim.out.seconds, sim.out.work = seconds, work
    sim.out.held = [(0.0, fleet), (seconds, 0)]
    return sim.out


def simulate(
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
) -> Outcome:
    """Replay ``policy`` until ``work`` samples are done (see :mod:`conveyor.elastic` for the policies).

    A market's capacity is its trace's live count ``c(t)``, of which the job may hold up to ``machines``; when
    ``c`` falls from ``c0`` to ``c1`` the provider revokes machines at random, so the job loses
    ``held * (c0 - c1) / c0`` of its machines in expectation (fractions carried over to the next fall, and at
    least enough to fit in ``c1``), without notice. After a trace's last event its capacity stays as it ended.
    All traces start at 0 s together.

    Example:
        >>> from conveyor.elastic._market import MarketPrice
        >>> m = Market("toy", MarketPrice("toy", 3.6, 0.36), tuple((0.0, "add", s) for s in range(4)))
        >>> out = simulate("on-demand", [m], Throughput(1, 1.0), 7200.0, fleet=2, machines=4)
        >>> out.seconds, round(out.cost, 6)  # 2 machines x 3600 s at $3.6/h
        (3600.0, 7.2)
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
    if not markets:
        raise ValueError("simulate needs at least one market")
    if not (work > 0 and fleet >= 1 and machines >= 1 and reliable >= 0):
        raise ValueError(f"need work > 0, fleet >= 1, machines >= 1, reliable >= 0; got {work}, {fleet}, {machines}, "
                         f"{reliable}")  # fmt: skip
    if policy in ("elastic-fixed", "bidbrain") and reliable < 1:
        raise ValueError(f"{policy} keeps its state on a reliable tier: give reliable >= 1")
    billing = billing if isinstance(billing, Billing) else Billing(billing)
    if policy == "on-demand":
        return _on_demand(markets, throughput, work, fleet, billing)
    return _Replay(policy, markets, throughput, work, fleet, reliable, machines, billing, costs or Costs()).run()


class _Replay(_Sim):
    """The event loop for the three spot policies."""

    def __init__(self, policy: str, markets: Sequence[Market], x: Throughput, work: float, fleet: int,
                 reliable: int, machines: int, billing: Billing, costs: Costs) -> None:  # fmt: skip
        super().__init__(policy, markets, machines, billing)
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

    def run(self) -> Outcome:
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
            nxt = min(self.events[0][0] if self.events else math.inf, next_decision if p == "bidbrain" else math.inf,
                      self.stall_until if self.stall_until > t else math.inf, self.next_checkpoint,
                      self.wake(t))  # fmt: skip
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
            if end - t <= _AT_END_S:
                self.held[i].remove(start)
                self.bill(i, start, t, "released")

    def wake(self, t: float) -> float:
        """BidBrain's next look: the earliest end of a held machine's paid time after ``t`` (to renew or release
        it exactly then)."""
        if self.out.policy != "bidbrain":
            return math.inf
        ends = (self.billing.paid_until(s, t) for held in self.held for s in held)
        return min((u for u in ends if u - t > _AT_END_S), default=math.inf)

    def bidbrain(self, t: float) -> list[int]:
        """Machines to hold per market: :func:`plan` on what the job holds now and what it has seen so far."""
        ms, billing = self.markets, self.billing
        offers = [Offer(m.price.spot, m.price.speed, self.rate(i), tuple(paid_left(billing, held, t)), self.free(i))
                  for i, (m, held) in enumerate(zip(ms, self.held, strict=True))]  # fmt: skip
        home = ms[self.home].price
        reliable = Offer(home.on_demand, home.speed, 0.0, tuple(paid_left(billing, [0.0] * self.reliable, t)), 0)
        return plan(self.x, self.work - self.done, offers, reliable, self.costs, billing)

    def finish(self, t: float) -> None:
        for i, held in enumerate(self.held):
            for start in held:
                self.bill(i, start, t, "finished")
        for _ in range(self.reliable):
            self.bill(self.home, 0.0, t, "finished", on_demand=True)
        self.held = [[] for _ in self.markets]
        self.out.seconds, self.out.work = t, self.done
        self.log(t, 0)
