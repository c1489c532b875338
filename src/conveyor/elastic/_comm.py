"""Communication that notices a membership change: process groups per generation, and waits that poll the store.

Gloo cannot take a process group back from a lost peer: the lost worker's ring neighbours see their
connections close, the others wait until the group's timeout. So every generation gets fresh groups
(``ProcessGroupGloo`` over a prefix of the job's store, no default group), and nothing here blocks on a
collective or on building a group without looking at the store every ``POLL_S``: a newer generation
(:mod:`conveyor.elastic._membership`) raises :class:`~conveyor.elastic._membership.MembershipChanged`, and
the abandoned group is left to time out on its own.

While a worker is *stepping*, a newer generation that is only planned (notices and joins) does not stop it:
the computing workers agree on the step boundary to switch at (the first to see the generation between two
steps proposes its last completed step, ``boundary/G``), finish the steps up to it, and drop only a step
begun past it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from conveyor.elastic._membership import Generation, JobFailed, MembershipChanged, connect, group_prefix, record

__all__ = ["POLL_S", "Posting", "Waiting", "Watch", "destroy_groups"]

POLL_S = 0.05  # how often a waiting worker looks at the store
_NAP_S = 0.005  # the longest a waiting worker sleeps between looks at its work


class _Waiters:
    """Threads that block on gloo works, each kept for the next work once its own has ended.

    A thread started per wait cost about 0.6 ms, and waiting on a gloo work in a new thread each time left
    137 bytes of native memory behind per wait (measured, 30,000 waits: glibc's arenas, not Python objects):
    megabytes an hour at hundreds of steps a second. A work that never ends (a lost peer) holds its thread
    until the group's timeout; meanwhile a new one is started, so waits never queue behind it. A thread idle for
    ``idle_s`` ends unless it is the last idle one, so the pool shrinks back after such a wait (in a soak it had
    grown by a thread at a lost peer and kept it).
    """

    idle_s = 60.0

    def __init__(self) -> None:
        self._works: queue.SimpleQueue[Waiting] = queue.SimpleQueue()
        self._idle = 0  # threads free for a work, or about to be
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def submit(self, waiting: Waiting) -> None:
        if os.getpid() != self._pid:  # a forked child has none of its parent's threads
            self.__init__()  # type: ignore[misc]
        with self._lock:
            start = self._idle == 0
            self._idle -= not start
        if start:
            threading.Thread(target=self._serve, name="conveyor-wait", daemon=True).start()
        self._works.put(waiting)

    def _serve(self) -> None:
        while True:
            try:
                waiting = self._works.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:  # (a work submitted meanwhile has taken its place from _idle: it finds a thread)
                    if self._idle > 1:
                        self._idle -= 1
                        return
                continue
            waiting.block()
            with self._lock:
                self._idle += 1


_WAITERS = _Waiters()


class Waiting:
    """A gloo ``Work`` waited on by a thread of its own (a gloo send or receive never reports itself completed,
    and a timed-out wait fails it for good). If a peer is lost the thread stays blocked until the group's own
    timeout."""

    def __init__(self, work: Any) -> None:
        self.error: BaseException | None = None
        self._work, self._done = work, threading.Event()
        _WAITERS.submit(self)

    def block(self) -> None:
        """Wait for the work (on a waiter thread)."""
        try:
            self._work.wait()
        except RuntimeError as exc:
            self.error = exc
        finally:
            self._work = None  # the work's buffers go once it has ended
            self._done.set()

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether the work has ended (well or not), after waiting up to ``wait_s`` for it."""
        return self._done.wait(wait_s)


class Watch:
    """One worker's view of the job's generations, and its waits.

    Args:
        store: the job's store (a client of its own).
        host, port: where it is (new groups get their own clients).
        worker: this worker's id.
        timeout_s: how long a collective may take before gloo gives up on it (a lost peer is noticed sooner,
            through the store).
        lost_s: the coordinator's heartbeat limit (a failed collective waits for its verdict a while longer).
    """

    def __init__(
        self, store: dist.Store, *, host: str, port: int, worker: int, timeout_s: float, lost_s: float
    ) -> None:
        self.store, self.host, self.port, self.worker = store, host, port, worker
        self.timeout_s, self.lost_s = timeout_s, lost_s
        self.gen: Generation | None = None
        self.done = -1  # the last step this worker completed
        self._planned: dict[int, bool] = {}
        self._builder: dist.TCPStore | None = None

    def newest(self) -> int:
        try:
            if self.store.check(["fatal"]):
                raise JobFailed(self.store.get("fatal").decode())
            return self.store.add("gen", 0)
        except (RuntimeError, OSError) as exc:
            if isinstance(exc, JobFailed):
                raise
            raise JobFailed(
                f"the job's store on reliable worker 0 is unreachable ({exc}): the reliable tier was lost"
            ) from None

    def record(self, g: int) -> Generation:
        """Generation ``g``'s record (the newest, or one kept: see ``KEPT_GENERATIONS``); one deleted means a newer
        generation has replaced this worker's (``MembershipChanged``)."""
        gen = record(self.store, g)
        if gen is None:
            raise MembershipChanged
        return gen

    def check(self, stepping: bool) -> None:
        """Raise ``MembershipChanged`` when this worker must drop what it is doing (see the module docstring)."""
        g = self.newest()
        assert self.gen is not None
        if not stepping and g == self.gen.gen and self.store.check(["finished"]):
            raise MembershipChanged  # the run ended: nothing is coming to what this worker waits for
        if g == self.gen.gen:
            return
        if not stepping or not all(self._is_planned(h) for h in range(self.gen.gen + 1, g + 1)):
            raise MembershipChanged
        key = f"boundary/{self.gen.gen}"
        if self.store.check([key]) and int(self.store.get(key)) <= self.done:
            raise MembershipChanged

    def at_boundary(self) -> None:
        """Between two steps: switch now if a planned generation is pending and its boundary is reached
        (proposing this step as the boundary when nobody has)."""
        g = self.newest()
        assert self.gen is not None
        if g == self.gen.gen:
            return
        if not all(self._is_planned(h) for h in range(self.gen.gen + 1, g + 1)):
            raise MembershipChanged
        agreed = int(self.store.compare_set(f"boundary/{self.gen.gen}", "", str(self.done)))
        if agreed <= self.done:
            raise MembershipChanged

    def _is_planned(self, g: int) -> bool:
        if g not in self._planned:  # a record deleted (this worker is far behind) counts as unplanned: switch now
            gen = record(self.store, g)
            self._planned[g] = gen is not None and gen.planned
        return self._planned[g]

    def wait(self, work: Any, stepping: bool = False, between_steps: bool = False) -> None:
        """Wait for ``work`` (a gloo ``Work`` or a :class:`Waiting`), looking at the store meanwhile; a failed
        collective waits for the coordinator to say who was lost (then ``MembershipChanged``). A wait
        ``between_steps`` (after this worker's last step) may also propose a planned generation's boundary: the
        peer it waits for may have switched already."""
        waiting = work if isinstance(work, Waiting) else Waiting(work)
        nap, checked = 1e-4, time.monotonic()
        while not waiting.ready(nap):
            nap = min(2 * nap, _NAP_S)
            if time.monotonic() - checked > POLL_S:
                self.at_boundary() if between_steps else self.check(stepping)
                checked = time.monotonic()
        if waiting.error is not None:  # it failed: a peer is gone
            self._await_verdict(waiting.error)

    def _await_verdict(self, error: BaseException) -> None:
        self.store.add("suspects", 1)  # evidence for the coordinator: look at the heartbeats closely now
        deadline = time.monotonic() + 3 * self.lost_s + 5
        while time.monotonic() < deadline:
            self.check(stepping=False)
            time.sleep(POLL_S)
        raise RuntimeError(f"a collective failed and the coordinator declared no worker lost: {error}")

    def poll_until(self, ready: Any, stepping: bool = False) -> None:
        """Sleep until ``ready()`` is true, looking at the store meanwhile."""
        while not ready():
            self.check(stepping)
            time.sleep(POLL_S)

    def group(self, name: str, workers: tuple[int, ...]) -> Any:
        """A gloo group of ``workers`` (this worker among them) for this generation, built in a thread so that a
        peer lost meanwhile cannot hang it (a :class:`Posting` of it)."""
        assert self.gen is not None
        box: dict[str, Any] = {}
        if self._builder is None:  # a client of its own: building blocks it, and the polls must go on
            self._builder = connect(self.host, self.port, False)
        prefix = dist.PrefixStore(group_prefix(self.gen.gen, name), self._builder)

        def build() -> None:
            try:
                box["pg"] = dist.ProcessGroupGloo(
                    prefix, workers.index(self.worker), len(workers), timedelta(seconds=self.timeout_s)
                )
            except Exception as exc:
                box["error"] = exc

        thread = threading.Thread(target=build, name=f"conveyor-group-{name}", daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(POLL_S)
                self.check(stepping=False)
        except BaseException:
            self._builder = None  # the abandoned build may still hold its client
            raise
        if "error" in box:  # a peer failed while the group formed: the coordinator says who
            self._await_verdict(box["error"])
        return Posting(box["pg"], watch=self)


def destroy_groups(groups: list[Any]) -> None:
    """Destroy ``groups`` (emptied here), each on a thread of its own; nothing else may refer to them.

    A gloo group's destructor waits for the work still in flight on it: until the group's timeout where a peer
    stopped. On the worker's thread it would hold the worker up that long, so groups used to be kept instead,
    and an elastic run's threads and sockets grew with every generation (about 6 threads and 10 descriptors
    each, measured). On threads of their own (the destructor releases the GIL) they wait in parallel, and what
    a run holds is bounded by the groups retired within one timeout.
    """
    while groups:
        holder = [groups.pop()]  # the group's one reference, dropped on the thread
        threading.Thread(target=holder.clear, name="conveyor-destroy-group", daemon=True).start()


class Posting:
    """A process group whose calls raise no gloo error: posting a send, a receive or a collective to a peer
    already gone fails at once (its connection was reset), and that is a failed wait like any other (the
    coordinator says who was lost, then ``MembershipChanged``)."""

    def __init__(self, group: dist.ProcessGroupGloo, *, watch: Watch) -> None:
        self._group, self._watch = group, watch

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._group, name)

        def post(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except RuntimeError as exc:
                self._watch._await_verdict(exc)

        return post
