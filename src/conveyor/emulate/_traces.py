"""Spot-availability traces (``../shared/spot-traces``) replayed as machines taking and leaving worker slots."""

from __future__ import annotations

import datetime
import heapq
from pathlib import Path

from conveyor.errors import InputError

__all__ = ["replay_trace"]


def replay_trace(file: Path) -> list[tuple[float, str, int]]:
    """A trace's events as ``(seconds, "add"|"remove", slot)``, seconds counted from the trace's first event.

    Two formats (see ``../shared/spot-traces/README.md``): ``MILLISECONDS,add|remove,NODE`` lines, where an
    added machine takes the lowest free slot and keeps it until removed; and Google Cloud's
    ``DATE, TIME, LIVE_COUNT`` samples, where a drop removes the highest live slots and a rise fills the lowest
    free ones. A count file repeats each sample on later lines, some stamped earlier than the line before, so a
    change takes the time of the first line with the new count, kept no earlier than the change before it.
    """
    rows = [[c.strip() for c in line.split(",")] for line in file.read_text().splitlines() if line.strip()]
    if not rows:
        raise InputError(f"trace {file.name} is empty")
    out: list[tuple[float, str, int]] = []
    live: set[int] = set()
    free: list[int] = []  # freed slots below the highest slot ever used, lowest first
    slots: dict[str, int] = {}
    t0: float | None = None
    count = 0
    for n, row in enumerate(rows, 1):
        try:
            if row[1] in ("add", "remove") and len(row) == 3:
                t, ops = float(row[0]) / 1000.0, [(row[1], row[2])]
            else:
                stamp = datetime.datetime.strptime(f"{row[0]} {row[1]} +0000", "%Y-%m-%d %H:%M:%S %z").timestamp()
                target, t = int(row[2]), stamp
                ops = [("add", "") for _ in range(target - count)] + [("remove", "") for _ in range(count - target)]
                count = target
        except (IndexError, ValueError):
            expected = "MILLISECONDS,add|remove,NODE or DATE, TIME, COUNT"
            raise InputError(f"trace {file.name} line {n} {','.join(row)!r}: expected {expected}") from None
        t0 = t if t0 is None else t0
        t = max(t - t0, out[-1][0] if out else 0.0)
        for op, name in ops:
            if op == "add":
                slot = heapq.heappop(free) if free else len(live) + len(free)
                live.add(slot)
                if name:
                    slots[name] = slot
            else:
                slot = slots.pop(name, -1) if name else max(live, default=-1)
                if slot < 0:
                    raise InputError(f"trace {file.name} line {n}: removes {name or 'a machine'} that is not live")
                live.discard(slot)
                heapq.heappush(free, slot)
            out.append((t, op, slot))
    return out
