"""The emulated network: a namespace per worker, bridges per server (and rack...), ``tc``-shaped links.

Worker ``r`` lives in its own namespace with one interface, ``eth0`` (address ``10.77.x.y``), whose other
end (``wR``) sits on its server's bridge in a fabric namespace. Each group of a level joins the bridge of
the level above through a link ``uK.G`` (its end on the group's bridge) / ``dK.G`` (on the parent's). A
link's two ends shape their outgoing traffic: a token bucket (``tbf``) at the level's rate and, for
latency, ``netem`` delay, so a message between two workers crosses the links of every level up to the one
that joins them and takes that level's latency and (the slowest) rate. A level's bandwidth is what a
transfer carries (:mod:`conveyor.plan._topology`), so the bucket's rate is the line rate that carries it:
each full TCP segment is 1448 bytes of data in a 1514-byte frame (Ethernet 14, IP 20, TCP with timestamps
32 bytes; ``tc`` counts a segmentation-offloaded packet as its segments). Addresses exist only inside these
namespaces, with no route out.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from dataclasses import dataclass

from conveyor.emulate._netns import Namespace
from conveyor.errors import InputError
from conveyor.plan import Topology

__all__ = ["FABRIC_ENV", "EmulatedLink", "Network", "ServerTraffic", "address", "links_of", "sent_bytes"]

INTERFACE = "eth0"  # every worker's one interface, the one gloo is told to use
FABRIC_ENV = "CONVEYOR_FABRIC"  # a worker's way to its cluster's fabric namespace, for the link counters
LINE_PER_DATA = 1514 / 1448  # frame bytes per byte of TCP data in a full segment at an MTU of 1500


def address(rank: int) -> str:
    """Worker ``rank``'s address on the emulated network.

    Example:
        >>> address(0), address(300)
        ('10.77.0.1', '10.77.1.51')
    """
    return f"10.77.{rank // 250}.{rank % 250 + 1}"


@dataclass(frozen=True)
class EmulatedLink:
    """An emulated link: ``up`` is the end on the lower side, ``down`` the one on the upper side; each shapes
    what it sends at ``bandwidth`` bytes/s, after ``delay_s`` seconds."""

    level: int
    group: int  # the worker's rank (level 0) or the group's index at level - 1
    up: str
    down: str
    bandwidth: float
    delay_s: float


def links_of(topology: Topology) -> list[EmulatedLink]:
    """Every link of ``topology``: one per worker, then one per group of each level below the top.

    Latency is per level (a message joined at level ``k`` takes ``latency_k``), so each link of level ``k``
    adds half of what level ``k`` adds over level ``k - 1`` in each direction.

    Example:
        >>> [(l.up, l.down) for l in links_of(Topology.parse("2:1e9,2:1e8"))]
        [('eth0', 'w0'), ('eth0', 'w1'), ('eth0', 'w2'), ('eth0', 'w3'), ('u1.0', 'd1.0'), ('u1.1', 'd1.1')]
    """
    levels = topology.levels
    for inner, outer in itertools.pairwise(levels):
        if outer.latency < inner.latency:
            raise InputError(
                f"topology {topology}: an outer level's latency ({outer.latency:g} s) is below an inner one's "
                f"({inner.latency:g} s); a message across it crosses the inner links too"
            )
    links = [
        EmulatedLink(0, r, INTERFACE, f"w{r}", levels[0].bandwidth, levels[0].latency / 2)
        for r in range(topology.workers)
    ]
    groups = topology.workers
    for k in range(1, len(levels)):
        groups //= levels[k - 1].count
        delay = (levels[k].latency - levels[k - 1].latency) / 2
        links += [EmulatedLink(k, g, f"u{k}.{g}", f"d{k}.{g}", levels[k].bandwidth, delay) for g in range(groups)]
    return links


def sent_bytes(fabric: str | None = None) -> dict[str, int] | None:
    """Bytes each link end of the emulated network has sent so far (frames, headers included), by device:
    ``w{r}`` to worker ``r``, ``u{k}.{g}`` up out of group ``g`` of level ``k - 1``, ``d{k}.{g}`` down into
    it. ``fabric`` is the fabric namespace's path (default: that of the cluster this worker runs in);
    ``None`` off an emulated network."""
    path = fabric or os.environ.get(FABRIC_ENV)
    if not path:
        return None
    # nsenter, not a preexec_fn that enters it: a preexec_fn makes Python fork the whole worker (35 ms for a
    # process holding torch, on the worker's own emulated cores, twice an epoch), where this spawns (2.5 ms).
    done = subprocess.run(
        ["nsenter", f"--net={path}", "ip", "-s", "-j", "link", "show"], capture_output=True, text=True, check=True
    )
    return {
        dev["ifname"]: int(dev["stats64"]["tx"]["bytes"])
        for dev in json.loads(done.stdout)
        if dev["ifname"][0] in "wud"  # not the bridges or lo
    }


class ServerTraffic:
    """The bytes sent out of the groups of level ``level - 1`` (level 1: between the emulated servers) over the
    spans between :meth:`start` and :meth:`stop`: ``total``, and ``by_group``, each group's.

    ``total`` stays ``None`` off an emulated network, or with ``counting`` false (a worker that does not
    report); a worker's spans count every worker's traffic, as the links carry it.
    """

    def __init__(self, counting: bool = True, level: int = 1) -> None:
        self.total: int | None = 0 if counting and os.environ.get(FABRIC_ENV) else None
        self.level = level
        self.by_group: dict[int, int] = {}
        self._at: dict[int, int] = {}

    def _now(self) -> dict[int, int]:
        sent = sent_bytes()
        assert sent is not None
        prefix = f"u{self.level}."
        return {int(dev[len(prefix) :]): n for dev, n in sent.items() if dev.startswith(prefix)}

    def start(self) -> None:
        if self.total is not None:
            self._at = self._now()

    def stop(self) -> None:
        if self.total is not None:
            for group, n in self._now().items():
                self.by_group[group] = self.by_group.get(group, 0) + n - self._at.get(group, 0)
            self.total = sum(self.by_group.values())


def _bridge(level: int, group: int) -> str:
    """The bridge that joins group ``group`` of level ``level`` (its members are the groups of the level below)."""
    return f"b{level}.{group}"


def _shape(device: str, bandwidth: float, delay_s: float) -> list[str]:
    rate = f"{bandwidth * LINE_PER_DATA * 8:.0f}bit"
    burst = max(64 * 1024, int(bandwidth / 1000))  # a millisecond of traffic, at least a GSO segment
    limit = min(max(4 * burst, int(bandwidth * 0.05)), 1 << 28)  # 50 ms of queue before drops, at most 256 MiB
    lines = [f"qdisc add dev {device} root handle 1: tbf rate {rate} burst {burst} limit {limit}"]
    if delay_s > 0:
        lines.append(f"qdisc add dev {device} parent 1:1 handle 10: netem delay {delay_s * 1e6:.0f}us limit 100000")
    return lines


class Network:
    """The namespaces and links of ``topology``, built on construction, gone after :meth:`close`.

    Args:
        topology: the planner's topology string, parsed; its worker count is the job's.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.links = links_of(topology)
        self.fabric = Namespace()
        self.workers: list[Namespace] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        levels, fabric_ip, fabric_tc = self.topology.levels, ["link set lo up"], []
        groups = self.topology.workers
        for k, level in enumerate(levels):
            groups //= level.count
            for g in range(groups):
                fabric_ip += [
                    f"link add {_bridge(k, g)} type bridge",
                    f"link set {_bridge(k, g)} up",
                ]
        for link in self.links:
            above = _bridge(link.level, link.group // levels[link.level].count)  # the bridge it joins upwards
            if link.level == 0:
                ns = Namespace()
                self.workers.append(ns)
                ns.batch(
                    "ip",
                    [
                        f"link add {link.up} type veth peer name {link.down} netns {self.fabric.path}",
                        "link set lo up",
                        f"addr add {address(link.group)}/16 dev {link.up}",
                        f"link set {link.up} up",
                    ],
                )
                ns.batch("tc", _shape(link.up, link.bandwidth, link.delay_s))
                fabric_ip += [f"link set {link.down} master {above}", f"link set {link.down} up"]
            else:
                below = _bridge(link.level - 1, link.group)
                fabric_ip += [
                    f"link add {link.up} type veth peer name {link.down}",
                    f"link set {link.up} master {below}",
                    f"link set {link.down} master {above}",
                    f"link set {link.up} up",
                    f"link set {link.down} up",
                ]
                fabric_tc += _shape(link.up, link.bandwidth, link.delay_s)
            fabric_tc += _shape(link.down, link.bandwidth, link.delay_s)
        self.fabric.batch("ip", fabric_ip)
        self.fabric.batch("tc", fabric_tc)

    def set_link(self, link: EmulatedLink, up: bool) -> None:
        """Cut (``up=False``) or restore a link, both directions at once."""
        state = "up" if up else "down"
        if link.level == 0:
            self.fabric.run("ip", "link", "set", link.down, state)
        else:
            self.fabric.batch("ip", [f"link set {link.up} {state}", f"link set {link.down} {state}"])

    def close(self) -> None:
        """Let go of every namespace: each vanishes, with its links, once its worker has exited."""
        for ns in [self.fabric, *self.workers]:
            ns.close()
