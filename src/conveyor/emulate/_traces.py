"""Spot-availability traces (``../shared/spot-traces``) replayed as machines taking and leaving worker slots."""

from __future__ import annotations

import datetime
import heapq
import json
from collections.abc import Sequence
from pathlib import Path

from conveyor.errors import InputError

__all__ = ["count_events", "read_counts", "replay_trace"]


def replay_trace(file: Path) -> list[tuple[float, str, int]]:
    """A trace's events as ``(seconds, "add"|"remove", slot)``, seconds counted from the trace's first event.

    Three formats (see ``../shared/spot-traces/README.md``): ``MILLISECONDS,add|remove,NODE`` lines, where an
    added machine takes the lowest free slot and keeps it until removed; Google Cloud's
    ``DATE, TIME, LIVE_COUNT`` samples, where a drop removes the highest live slots and a rise fills the lowest
    free ones; and SkyPilot's ``{"metadata": {"gap_seconds": G}, "data": [COUNTS]}`` (``.json``), counts every
    ``G`` seconds (:func:`count_events`). A Google Cloud count file repeats each sample on later lines, some
    stamped earlier than the line before, so a change takes the time of the first line with the new count, kept
    no earlier than the change before it.
    """
    if file.suffix == ".json":
        return count_events(*read_counts(file))
    rows = _csv_rows(file)
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
            else:  # a count: a SkyPilot tick (already in seconds) or a Google Cloud sample
                t = float(row[1]) if row[0] == "count" else _stamp(row[0], row[1])
                target = int(row[2])
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


def _stamp(date: str, time: str) -> float:
    return datetime.datetime.strptime(f"{date} {time} +0000", "%Y-%m-%d %H:%M:%S %z").timestamp()


def _csv_rows(file: Path) -> list[list[str]]:
    return [[c.strip() for c in line.split(",")] for line in file.read_text().splitlines() if line.strip()]


def count_events(gap_s: float, counts: Sequence[int]) -> list[tuple[float, str, int]]:
    """Machine counts sampled every ``gap_s`` seconds as ``(seconds, "add"|"remove", slot)`` events: the live
    machines hold slots ``0 .. n-1``, so a rise fills the lowest free slots and a drop removes the highest.

    Example:
        >>> count_events(60.0, [2, 1, 3])
        [(0.0, 'add', 0), (0.0, 'add', 1), (60.0, 'remove', 1), (120.0, 'add', 1), (120.0, 'add', 2)]
    """
    events: list[tuple[float, str, int]] = []
    live = 0
    for k, n in enumerate(counts):
        t = k * gap_s
        events += [(t, "add", s) for s in range(live, n)] + [(t, "remove", s) for s in range(live - 1, n - 1, -1)]
        live = n
    return events


def read_counts(file: Path) -> tuple[float, list[int]]:
    """SkyPilot's ``{"metadata": {"gap_seconds": G}, "data": [N0, N1, ...]}``: ``G`` and the counts, checked.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = Path(d) / "us-east-1a_v100_1.json"
        ...     _ = p.write_text('{"metadata": {"gap_seconds": 60}, "data": [1, -1]}')
        ...     read_counts(p)
        Traceback (most recent call last):
        ...
        conveyor.errors.InputError: trace us-east-1a_v100_1.json: data must be whole numbers >= 0 (tick 1 is -1)
    """
    try:
        raw = json.loads(file.read_text())
        gap, data = float(raw["metadata"]["gap_seconds"]), raw["data"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        want = '{"metadata": {"gap_seconds": G}, "data": [counts]}'
        raise InputError(f"trace {file.name}: expected {want} ({type(exc).__name__}: {exc})") from None
    if not gap > 0:
        raise InputError(f"trace {file.name}: gap_seconds must be > 0, got {gap}")
    if not isinstance(data, list) or len(data) < 2:
        raise InputError(f"trace {file.name}: data must be a list of at least 2 counts")
    for i, n in enumerate(data):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InputError(f"trace {file.name}: data must be whole numbers >= 0 (tick {i} is {n!r})")
    return gap, data
