"""What a worker holds as a run goes on (``--resources-every SECONDS``): memory, descriptors, threads and the
store's keys, sampled by a thread of the worker into the run folder's ``resources.jsonl``.

A long run must hold steady: a leak shows as a series that keeps growing. Each line is one sample of one
worker, read from Linux's ``/proc/self`` (the resident set, the open descriptors, the threads, the kernel's
own counts) and from the job's c10d store (``num_keys``: every key, the job's own and torch.distributed's).
Each line is one ``write`` to a file opened for appending, so the workers' lines never interleave.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

import torch.distributed as dist

__all__ = ["ResourceLog", "ResourceSample", "sample_resources"]

_PROC = Path("/proc/self")


@dataclass(frozen=True)
class ResourceSample:
    """One worker's holdings at one moment (a line of ``resources.jsonl``)."""

    worker: int
    pid: int  # the process (an elastic job's re-added worker is a new one)
    t_s: float  # seconds since the log started
    wall: float  # UNIX time
    rss_bytes: int  # resident memory
    fds: int  # open file descriptors (sockets included)
    threads: int  # the process's threads, Python's and native
    store_keys: int | None  # keys in the job's c10d store (None without one)


def sample_resources(worker: int, store: dist.Store | None, *, started: float) -> ResourceSample:
    """What this process holds now (``started``: the ``time.monotonic()`` that ``t_s`` counts from)."""
    status = dict(line.split(":", 1) for line in (_PROC / "status").read_text().splitlines() if ":" in line)
    return ResourceSample(
        worker=worker,
        pid=os.getpid(),
        t_s=round(time.monotonic() - started, 3),
        wall=round(time.time(), 3),
        rss_bytes=int(status["VmRSS"].split()[0]) * 1024,  # the kernel reports kB
        fds=len(os.listdir(_PROC / "fd")),
        threads=int(status["Threads"]),
        store_keys=_store_keys(store),
    )


def _store_keys(store: dist.Store | None) -> int | None:
    """The store's keys; ``None`` without a store, or where its host has gone: an elastic job's last samples may
    come after the worker that held it left (a sample must not fail the worker it describes)."""
    if store is None:
        return None
    try:
        return store.num_keys()
    except dist.DistError:
        return None


class ResourceLog:
    """Samples this worker every ``every_s`` seconds into ``path`` from a thread, while in its ``with`` block
    (a sample at the start and one at the end too); nothing at all when ``every_s`` is ``None``."""

    def __init__(self, path: Path, *, worker: int, every_s: float | None, store: dist.Store | None) -> None:
        self.path, self.worker, self.every_s, self.store = path, worker, every_s, store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()

    def __enter__(self) -> ResourceLog:
        if self.every_s is not None:
            self._started = time.monotonic()
            self._write()
            self._thread = threading.Thread(target=self._run, name="conveyor-resources", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._write()

    def _run(self) -> None:
        assert self.every_s is not None
        while not self._stop.wait(self.every_s):
            self._write()

    def _write(self) -> None:
        line = json.dumps(asdict(sample_resources(self.worker, self.store, started=self._started))) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
