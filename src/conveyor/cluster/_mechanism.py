"""Gavel's round-based mechanism: which jobs run on which devices each round, so time shares follow X."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from conveyor.cluster._problem import Allocation, Problem
from conveyor.errors import InputError

__all__ = ["ClusterDevice", "Devices", "Rounds"]

Combo = tuple[int, ...]  # job ids running together on the same devices: (7,) alone, (7, 9) sharing them


@dataclass(frozen=True, order=True)
class ClusterDevice:
    """One accelerator: its type, the server holding it, and its slot there."""

    type: str
    server: int
    slot: int

    def __str__(self) -> str:
        return f"{self.type}/{self.server}.{self.slot}"


@dataclass(frozen=True)
class Devices:
    """The cluster's devices: ``counts[type]`` of each type, ``per_server`` to a server.

    Example:
        >>> cluster = Devices({"v100": 6, "k80": 2}, per_server=4)
        >>> [str(d) for d in cluster.of("v100")]
        ['v100/0.0', 'v100/0.1', 'v100/0.2', 'v100/0.3', 'v100/1.0', 'v100/1.1']
    """

    counts: dict[str, int]
    per_server: int = 4

    def __post_init__(self) -> None:
        if not self.counts or any(n < 0 for n in self.counts.values()):
            raise InputError(f"a cluster needs device counts >= 0 per type, e.g. v100=36,p100=36; got {self.counts}")
        if self.per_server < 1:
            raise InputError(f"devices per server must be at least 1, got {self.per_server}")

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(self.counts)

    def of(self, device_type: str) -> list[ClusterDevice]:
        return [
            ClusterDevice(device_type, i // self.per_server, i % self.per_server)
            for i in range(self.counts[device_type])
        ]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class Rounds:
    """Realises an allocation round by round (Gavel §5).

    Every round each (combination, device type) pair gets a priority

        priority[c, k] = X[c, k] / (time c ran on k / time all combinations ran on k),

    counted since the allocation last changed (a pair that has not run yet has priority ``X[c, k] * 1e9``,
    so it goes first in proportion to its share). Pairs are taken greedily in decreasing priority (then
    share, then age) while devices of the type remain; a job runs at most once per round. So a
    combination that has received less than its share of a type catches up, and the realised time shares
    converge to X over rounds. Devices still free then go to any job that can use them, oldest first (as
    Gavel's mechanism does: a policy's X may leave devices idle; ``fill_idle=False`` keeps them idle, for
    FIFO, where a later job must not overtake). A combination that keeps its type keeps its devices (its
    lease is extended: no needless preemption); the others are placed largest first, each on the servers
    that fit it most tightly, so multi-device jobs are not scattered.

    Example:
        >>> cluster = Devices({"fast": 1, "slow": 1})
        >>> problem = Problem((10, 11), ("fast", "slow"), [[2.0, 1.0], [2.0, 1.0]], [1, 1], [1, 1])
        >>> rounds = Rounds(cluster)
        >>> rounds.set_allocation(problem, Allocation.singles(np.array([[0.5, 0.5], [0.5, 0.5]])))
        >>> sorted(rounds.next_round(problem).items())  # doctest: +NORMALIZE_WHITESPACE
        [((10,), (ClusterDevice(type='fast', server=0, slot=0),)),
         ((11,), (ClusterDevice(type='slow', server=0, slot=0),))]
    """

    devices: Devices
    fill_idle: bool = True
    allocation: dict[Combo, np.ndarray] = field(default_factory=dict)  # combo -> share of time per type
    received: dict[Combo, np.ndarray] = field(init=False)  # time run per type since the allocation changed
    placement: dict[Combo, tuple[ClusterDevice, ...]] = field(default_factory=dict)  # the current round's
    previous: dict[Combo, tuple[ClusterDevice, ...]] = field(default_factory=dict)  # the round before's

    def __post_init__(self) -> None:
        self.received = defaultdict(lambda: np.zeros(len(self.devices.types)))

    def set_allocation(self, problem: Problem, allocation: Allocation) -> None:
        """Adopt a new allocation (jobs arrived or left): time counts restart from here."""
        if problem.device_types != self.devices.types:
            raise InputError(
                f"the problem's device types {problem.device_types} are not the cluster's {self.devices.types}"
            )
        self.allocation = {
            tuple(problem.job_ids[i] for i in combo): allocation.fractions[c]
            for c, combo in enumerate(allocation.combos)
        }
        self.received = defaultdict(lambda: np.zeros(len(self.devices.types)))

    def next_round(self, problem: Problem, again: bool = False) -> dict[Combo, tuple[ClusterDevice, ...]]:
        """Choose the combinations that run this round and their devices; keeps them as ``placement``.
        ``again``: choose the same round once more (jobs came or went since), still against the round before."""
        row = {job: i for i, job in enumerate(problem.job_ids)}
        arrival = problem.arrival_s
        received_by_type = sum(self.received.values(), np.zeros(len(self.devices.types)))
        entries = []
        for combo, share in self.allocation.items():
            if any(job not in row for job in combo):
                continue  # a job that finished since the allocation was computed
            for k in np.flatnonzero(share > 1e-9):
                if not self._runs(problem, combo, row, int(k)):
                    continue
                got = self.received[combo][k] / received_by_type[k] if received_by_type[k] > 0 else 0.0
                priority = share[k] / got if got > 0 else share[k] * 1e9
                entries.append((-priority, -share[k], float(min(arrival[row[j]] for j in combo)), combo, int(k)))
        if self.fill_idle:  # then any job on any type it can use, oldest first, so no device idles needlessly
            for i, job in enumerate(problem.job_ids):
                for k in np.flatnonzero(problem.throughputs[i] > 0):
                    entries.append((0.0, 0.0, float(arrival[i]), (job,), int(k)))
        entries.sort(key=lambda e: e[:3])
        left = dict(self.devices.counts)
        chosen: dict[Combo, int] = {}
        busy: set[int] = set()
        for *_, combo, column in entries:
            scale = int(problem.scale_factors[row[combo[0]]])
            device_type = self.devices.types[column]
            if scale > left[device_type] or busy.intersection(combo):
                continue
            left[device_type] -= scale
            busy.update(combo)
            chosen[combo] = column
        if not again:
            self.previous = self.placement
        self.placement = self._place(chosen, problem, row, self.previous)
        return self.placement

    def kept(self, combo: Combo) -> bool:
        """Whether ``combo`` runs this round on exactly the devices it held the round before (lease extended)."""
        return combo in self.previous and self.previous[combo] == self.placement.get(combo)

    def record(self, seconds: float, ran: dict[Combo, float] | None = None) -> None:
        """Credit each combination of the current placement with the time it ran on its type: ``seconds``,
        or ``ran[combo]`` where given (a job that finished early). Wall-clock time, not device-time, as X."""
        for combo, devices in self.placement.items():
            k = self.devices.types.index(devices[0].type)
            self.received[combo][k] += seconds if ran is None else ran.get(combo, seconds)

    def _runs(self, problem: Problem, combo: Combo, row: dict[int, int], k: int) -> bool:
        if len(combo) == 1:
            return bool(problem.throughputs[row[combo[0]], k] > 0)
        pair = problem.pair_throughputs.get((row[combo[0]], row[combo[1]]))
        return pair is not None and bool((pair[k] > 0).all())

    def _place(
        self,
        chosen: dict[Combo, int],
        problem: Problem,
        row: dict[int, int],
        before: dict[Combo, tuple[ClusterDevice, ...]],
    ) -> dict[Combo, tuple[ClusterDevice, ...]]:
        """Devices for each chosen combination: its previous ones when it keeps its type and they are free,
        else the servers that fit it most tightly, largest combinations first."""
        free = {t: set(self.devices.of(t)) for t in self.devices.types}
        placed: dict[Combo, tuple[ClusterDevice, ...]] = {}
        for combo, k in chosen.items():
            held = before.get(combo, ())
            if held and held[0].type == self.devices.types[k] and free[held[0].type].issuperset(held):
                placed[combo] = held
                free[held[0].type].difference_update(held)
        rest = sorted((c for c in chosen if c not in placed), key=lambda c: -problem.scale_factors[row[c[0]]])
        for combo in rest:
            device_type = self.devices.types[chosen[combo]]
            placed[combo] = _tightest(free[device_type], int(problem.scale_factors[row[combo[0]]]))
            free[device_type].difference_update(placed[combo])
        return placed


def _tightest(free: set[ClusterDevice], count: int) -> tuple[ClusterDevice, ...]:
    """``count`` free devices: all on one server if one has room (the one with the fewest free devices that
    suffice), else from the servers with the most free devices first."""
    by_server: dict[int, list[ClusterDevice]] = defaultdict(list)
    for device in sorted(free):
        by_server[device.server].append(device)
    fitting = [s for s, devices in by_server.items() if len(devices) >= count]
    if fitting:
        server = min(fitting, key=lambda s: (len(by_server[s]), s))
        return tuple(by_server[server][:count])
    taken: list[ClusterDevice] = []
    for server in sorted(by_server, key=lambda s: (-len(by_server[s]), s)):
        taken += by_server[server][: count - len(taken)]
        if len(taken) == count:
            break
    return tuple(taken)
