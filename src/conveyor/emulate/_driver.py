"""Applies a job's faults at their times, and logs each one with its time to ``faults.jsonl``."""

from __future__ import annotations

import heapq
import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from conveyor.emulate._cgroups import CgroupError
from conveyor.emulate._cluster import Cluster
from conveyor.emulate._faults import Fault

__all__ = ["BUSY_LOOP", "FaultDriver"]

# What a competing load runs: a process that wants a whole core, as a co-located job would.
BUSY_LOOP = "while True: pass"


class FaultDriver:
    """Runs ``faults`` against ``cluster`` in a thread, from :meth:`start` until :meth:`stop`.

    Times are seconds after every worker has started (its set-up done, before its work). ``revoked`` maps
    each revoked rank to its notice and kill times, so a failed job can say that a worker was revoked rather
    than that it crashed. ``on_add(rank)``, when given, starts a worker in an added machine's slot and says
    what it did (an elastic job); without it an addition is only logged. With ``clock``, times count from
    when that file appears (an elastic job's training start) rather than from the workers' start.
    """

    def __init__(
        self,
        cluster: Cluster,
        faults: list[Fault],
        on_add: Callable[[int], str] | None = None,
        clock: Path | None = None,
    ) -> None:
        self.cluster, self.on_add, self.clock = cluster, on_add, clock
        self.log_path = cluster.log_dir / "faults.jsonl"
        self.revoked: dict[int, tuple[float, float]] = {}
        self._queue: list[tuple[float, int, Callable[[], dict[str, object]]]] = []
        self._order = itertools.count()
        self._loads: dict[int, list[subprocess.Popen[bytes]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-faults", daemon=True)
        for fault in faults:
            self._at(fault.at, partial(self._begin, fault))
            if fault.duration > 0 and fault.kind in ("slow", "pause", "load", "link-down"):
                self._at(fault.at + fault.duration, partial(self._end, fault))

    def _at(self, t: float, action: Callable[[], dict[str, object]]) -> None:
        heapq.heappush(self._queue, (t, next(self._order), action))

    def start(self) -> FaultDriver:
        self.log_path.write_text("")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop applying faults; end the competing loads still running."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for procs in self._loads.values():
            for proc in procs:
                proc.kill()
                proc.wait()

    def _run(self) -> None:
        started = [self.cluster.log_dir / f"started-{r}" for r in range(self.cluster.workers)]
        started += [self.clock] if self.clock is not None else []
        while not all(path.exists() for path in started):
            if self._stop.wait(0.02):
                return
        self._start = time.monotonic()
        while self._queue and not self._stop.is_set():
            t, _, action = self._queue[0]
            if self._stop.wait(max(0.0, t - (time.monotonic() - self._start))):
                return
            heapq.heappop(self._queue)
            try:
                entry = action()
            except (OSError, CgroupError) as exc:  # the worker may be gone already (revoked, or the job failed)
                entry = {"event": "failed", "error": str(exc)}
            entry = {"t": round(time.monotonic() - self._start, 4), "wall": round(time.time(), 4), **entry}
            with self.log_path.open("a") as log:
                log.write(json.dumps(entry) + "\n")

    def _begin(self, fault: Fault) -> dict[str, object]:
        groups = [self.cluster.cgroups[r] for r in fault.workers] if self.cluster.cgroups else []
        if fault.kind == "slow":
            for group in groups:
                group.set_cores(fault.cores)
        elif fault.kind == "pause":
            for group in groups:
                group.freeze(True)
        elif fault.kind == "load":
            for rank, group in zip(fault.workers, groups, strict=True):
                proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
                group.join(proc.pid)
                self._loads.setdefault(rank, []).append(proc)
        elif fault.kind == "revoke":
            now = time.monotonic() - self._start
            for rank, group in zip(fault.workers, groups, strict=True):
                (self.cluster.log_dir / f"revoke-{rank}").write_text(f"SIGKILL in {fault.grace:g} s")
                group.signal(signal.SIGTERM)
                self.revoked[rank] = (now, now + fault.grace)
                self._at(now + fault.grace, partial(self._kill, rank))
        elif fault.kind == "link-down":
            self._set_link(fault, up=False)
        elif fault.kind == "add":  # a new machine is available: an elastic job starts a worker on it
            note = "logged only: the job's worker count is fixed" if self.on_add is None else ""
            for rank in fault.workers:
                if self.on_add is not None:
                    note = self.on_add(rank)
            return {"event": "begin", **fault.to_dict(), "note": note}
        return {"event": "begin", **fault.to_dict()}

    def _end(self, fault: Fault) -> dict[str, object]:
        for rank in fault.workers:
            if fault.kind == "slow":
                self.cluster.cgroups[rank].set_cores(self.cluster.base_cores(rank))
            elif fault.kind == "pause":
                self.cluster.cgroups[rank].freeze(False)
            elif fault.kind == "load":
                for proc in self._loads.pop(rank, []):
                    proc.kill()
                    proc.wait()
        if fault.kind == "link-down":
            self._set_link(fault, up=True)
        return {"event": "end", **fault.to_dict()}

    def _kill(self, rank: int) -> dict[str, object]:
        self.cluster.cgroups[rank].signal(signal.SIGKILL)
        return {"event": "killed", "workers": [rank]}

    def _set_link(self, fault: Fault, up: bool) -> None:
        network = self.cluster.network
        assert network is not None  # Emulation.fault_list refuses link-down without a network
        (link,) = [link for link in network.links if link.level == 1 and link.group == fault.server]
        network.set_link(link, up)
