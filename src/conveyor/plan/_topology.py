"""A hierarchical cluster: devices in a server, servers in a rack, ..., each level with its bandwidth.

Written innermost level first, ``COUNT:BYTES_PER_S`` per level: ``"4:12e9,4:1.25e9"`` is 4 devices per
server joined at 12 GB/s, and 4 such servers joined at 1.25 GB/s (10 Gbit/s): 16 workers.

Example:
    >>> t = Topology.parse("4:12e9,4:1.25e9")
    >>> t.workers, t.levels[1].bandwidth
    (16, 1250000000.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Level", "Topology", "TopologyError"]


class TopologyError(ValueError):
    """A topology string that does not parse or describes no workers."""


@dataclass(frozen=True)
class Level:
    """``count`` units of the level below, joined at ``bandwidth`` bytes per second."""

    count: int
    bandwidth: float


@dataclass(frozen=True)
class Topology:
    """Levels from the innermost (devices in a server) outwards."""

    levels: tuple[Level, ...]

    @property
    def workers(self) -> int:
        return math.prod(level.count for level in self.levels)

    def bandwidth_between(self, a: int, b: int) -> float:
        """Bandwidth of the innermost level that joins workers ``a`` and ``b`` (ranks handed out in order)."""
        span = 1
        for level in self.levels:
            span *= level.count
            if a // span == b // span:
                return level.bandwidth
        raise ValueError(f"workers {a} and {b} are not both below {self.workers}")

    def __str__(self) -> str:
        return ",".join(f"{lv.count}:{lv.bandwidth:g}" for lv in self.levels)

    @classmethod
    def parse(cls, text: str) -> Topology:
        """Parse ``"COUNT:BANDWIDTH,COUNT:BANDWIDTH,..."`` (innermost first, bandwidth in bytes/s)."""
        levels = []
        for part in text.split(","):
            count, sep, bandwidth = part.strip().partition(":")
            try:
                if not sep:
                    raise ValueError("no ':'")
                level = Level(int(count), float(bandwidth))
            except ValueError as exc:
                raise TopologyError(
                    f"cannot read topology level {part.strip()!r} of {text!r}: write COUNT:BYTES_PER_S per level, "
                    "innermost first, e.g. 4:12e9,4:1.25e9 for 4 servers of 4 devices"
                ) from exc
            if level.count < 1 or not level.bandwidth > 0 or math.isinf(level.bandwidth):
                raise TopologyError(f"topology level {part.strip()!r} needs a count >= 1 and a finite bandwidth > 0")
            levels.append(level)
        return cls(tuple(levels))
