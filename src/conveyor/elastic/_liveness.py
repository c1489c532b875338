"""Whether a worker's process is alive, from a connection the kernel closes when it dies.

Each worker keeps a two-rank gloo group with worker 0, and worker 0's coordinator posts a receive on it that
nothing ever sends to. The receive ends only when the connection closes: the kernel closes it the moment the
worker's process dies (killed, crashed), and never while a live process only stalls (starved on a busy machine,
paused). So a death is known within milliseconds, and the heartbeat's limit can be long enough to ride out a
stall. A host that vanishes without closing its connections (a cut link, a machine switched off) is still
found by its heartbeat's silence.

The pair's two keys in the store (:func:`~conveyor.elastic._membership.liveness_prefix`) are deleted with the
worker's other keys once it is gone. Not sooner: one end's build can be done (its connection accepted) while the
other still reads the first one's address, and a key deleted then fails that build, which closes the connection
of a live worker (seen: a worker declared lost 0.05 s into its job).
"""

from __future__ import annotations

import contextlib
import re
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from conveyor.elastic._comm import destroy_groups
from conveyor.elastic._membership import connect, liveness_prefix

__all__ = ["Liveness", "keep_alive"]

# The receive waits for the connection to close, not for a message: gloo would fail it at its timeout.
_FOREVER = timedelta(days=30)


def _pair(store: dist.Store, worker: int, rank: int, device: Any) -> Any:
    # (gloo's options are private, but the public constructor gives each group a device, and so a network
    # thread, of its own: the coordinator shares one among all its pairs, and each pair needs 1 work thread)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout, options._threads, options._devices = _FOREVER, 1, [device]
    return dist.ProcessGroupGloo(dist.PrefixStore(liveness_prefix(worker), store), rank, 2, options)


def keep_alive(host: str, port: int, worker: int) -> None:
    """This worker's end of its pair with the coordinator, built on a thread and kept until the process ends.

    If the pair cannot be built (the coordinator is gone), the worker is watched by its heartbeat alone."""

    def build() -> None:
        store = connect(host, port, is_leader=False)
        with contextlib.suppress(RuntimeError):  # (then the coordinator's end never connects: see above)
            _KEPT.append(_pair(store, worker, 1, dist.ProcessGroupGloo.create_default_device()))

    threading.Thread(target=build, name="conveyor-liveness", daemon=True).start()


_KEPT: list[Any] = []  # this process's end of its pair: dropping it would close the connection


class Liveness:
    """The coordinator's ends of the pairs: one per worker, each built and then waited on by a thread of its own.

    Args:
        host, port: the job's store (each pair's rendezvous gets a client of its own: building blocks it).
    """

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._device: Any = None  # made on the first pair's thread (it looks the host up)
        self._lock = threading.Lock()
        self._watched: set[int] = set()  # not yet lost or left: a pair built for one that is not is dropped
        self._groups: dict[int, Any] = {}  # the pairs connected
        self._closed: dict[int, str] = {}  # worker -> the error its receive ended with

    def watch(self, worker: int) -> None:
        """Start building ``worker``'s pair (it builds its end with :func:`keep_alive`)."""
        with self._lock:
            self._watched.add(worker)
        name = f"conveyor-liveness-{worker}"
        threading.Thread(target=self._serve, args=(worker,), name=name, daemon=True).start()

    def paired(self, worker: int) -> bool:
        """Whether ``worker``'s pair is connected (its death would be seen at once)."""
        return worker in self._groups

    def closed(self, worker: int) -> str | None:
        """Why ``worker``'s connection closed (its process died), or ``None`` while it is open or not built."""
        return self._closed.get(worker)

    def forget(self, worker: int) -> None:
        """Drop ``worker``'s pair: it was lost or has left (its group is destroyed on a thread of its own)."""
        with self._lock:
            self._watched.discard(worker)
            self._closed.pop(worker, None)
            group = self._groups.pop(worker, None)
        if group is not None:
            destroy_groups([group])

    def _serve(self, worker: int) -> None:
        store = connect(self._host, self._port, is_leader=False)
        with self._lock:
            if self._device is None:
                self._device = dist.ProcessGroupGloo.create_default_device()
        try:
            group = _pair(store, worker, 0, self._device)
        except RuntimeError:
            return  # it died before its end was up: its heartbeat's silence will tell
        work = group.recv([torch.zeros(1)], 1, 0)
        with self._lock:
            if worker not in self._watched:
                destroy_groups([group])
                return
            self._groups[worker] = group
        try:
            work.wait()
        except RuntimeError as exc:  # gloo's "[pair.cc:LINE] Connection closed by peer ADDRESS. <a guess why>"
            with self._lock:
                if worker in self._groups:
                    self._closed[worker] = re.sub(r"^\[[^]]*\] *", "", str(exc)).split(". ")[0]
