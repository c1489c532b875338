"""A hierarchical cluster: devices in a server, servers in a rack, ..., each level with its link.

Written innermost level first, ``COUNT:BYTES_PER_S`` per level, optionally ``/LATENCY`` (a time per
message, ``s``, ``ms`` or ``us``): ``"4:12e9,4:1.25e9/50us"`` is 4 devices per server joined at 12 GB/s,
and 4 such servers joined at 1.25 GB/s (10 Gbit/s) with 50 microseconds per message: 16 workers.

What a bandwidth is: at the innermost level, each worker's own link to its server's switch; at an outer
level, each group's uplink to that level's switch (a server's link to the rack), shared by the group's
workers. Every link is full duplex, carrying its bandwidth each way at once. The bandwidth counts the data
a transfer delivers (goodput), not the line rate: a 10 Gbit/s Ethernet link carries about 1.17e9 bytes/s of
TCP data (1448 of every 1514 bytes on the wire, and less with its preamble and gaps). A message between two workers
crosses each level up to the one that joins them, so it goes at the slowest of their bandwidths and takes
``latency + b / bandwidth`` for ``b`` bytes, with the joining level's latency (the whole way, not a step).
The emulated cluster (``conveyor train --network``) builds exactly this.

Example:
    >>> t = Topology.parse("4:12e9,4:1.25e9/50us")
    >>> t.workers, t.levels[1].bandwidth, t.levels[1].latency
    (16, 1250000000.0, 5e-05)
    >>> t.level_between(0, 15).latency  # the first and the last worker meet at the outer level
    5e-05
    >>> Topology.parse("2:1e8,2:1e9").bandwidth_between(0, 3)  # the slowest link on the way
    100000000.0
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from conveyor.errors import InputError

__all__ = ["Level", "Topology", "TopologyError"]

_UNITS = {"s": Decimal(1), "ms": Decimal("1e-3"), "us": Decimal("1e-6")}


class TopologyError(InputError):
    """A topology string that does not parse or describes no workers."""


@dataclass(frozen=True)
class Level:
    """``count`` units of the level below, joined at ``bandwidth`` bytes per second and ``latency`` seconds
    per message."""

    count: int
    bandwidth: float
    latency: float = 0.0


@dataclass(frozen=True)
class Topology:
    """Levels from the innermost (devices in a server) outwards."""

    levels: tuple[Level, ...]

    @property
    def workers(self) -> int:
        return math.prod(level.count for level in self.levels)

    def level_between(self, a: int, b: int) -> Level:
        """The innermost level that joins workers ``a`` and ``b`` (ranks handed out in order)."""
        span = 1
        for level in self.levels:
            span *= level.count
            if a // span == b // span:
                return level
        raise InputError(f"workers {a} and {b} are not both below {self.workers}")

    def groups_of(self, worker: int) -> tuple[int, ...]:
        """The groups ``worker`` is in, one per level below the outermost (its server, then its rack, ...): each
        group's link to the level above is shared by its workers.

        Example:
            >>> Topology.parse("2:1e9,3:1e8,2:1e7").groups_of(7)  # the fourth server, in the second rack
            (3, 1)
        """
        spans = itertools.accumulate((level.count for level in self.levels[:-1]), operator.mul)
        return tuple(worker // span for span in spans)

    def bandwidth_between(self, a: int, b: int) -> float:
        """The rate of a message between workers ``a`` and ``b``: the slowest level it crosses."""
        return self.slowest(self.levels.index(self.level_between(a, b)))

    def slowest(self, k: int) -> float:
        """The slowest bandwidth of levels ``0..k``: what a message across level ``k`` goes at."""
        return min(level.bandwidth for level in self.levels[: k + 1])

    def __str__(self) -> str:
        return ",".join(
            f"{lv.count}:{lv.bandwidth:g}" + (f"/{lv.latency * 1e6:g}us" if lv.latency else "") for lv in self.levels
        )

    @classmethod
    def parse(cls, text: str) -> Topology:
        """Parse ``"COUNT:BANDWIDTH[/LATENCY],..."`` (innermost first, bandwidth in bytes/s)."""
        levels = []
        for part in text.split(","):
            count, sep, link = part.strip().partition(":")
            bandwidth, _, latency = link.partition("/")
            try:
                if not sep:
                    raise InputError("no ':'")
                level = Level(int(count), float(bandwidth), _seconds(latency) if latency else 0.0)
            except ValueError as exc:
                raise TopologyError(
                    f"cannot read topology level {part.strip()!r} of {text!r}: write COUNT:BYTES_PER_S[/LATENCY] per "
                    "level, innermost first, e.g. 4:12e9,4:1.25e9/50us for 4 servers of 4 devices"
                ) from exc
            if level.count < 1 or not level.bandwidth > 0 or math.isinf(level.bandwidth) or level.latency < 0:
                raise TopologyError(
                    f"topology level {part.strip()!r} needs a count >= 1, a finite bandwidth > 0 and a latency >= 0"
                )
            levels.append(level)
        return cls(tuple(levels))


def _seconds(text: str) -> float:
    """``"50us"``, ``"0.1ms"``, ``"2e-4"`` (seconds) or ``"1s"`` in seconds."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us)?\s*", text)
    try:
        value = Decimal(match.group(1)) if match else None
    except InvalidOperation:
        value = None
    if match is None or value is None:
        raise InputError(f"latency {text!r} is not a time like 50us, 0.1ms or 2e-4")
    return float(value * _UNITS[match.group(2) or "s"])  # in decimal, so 50us is exactly 5e-05
