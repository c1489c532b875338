"""Waits on gloo works run on threads kept for the next wait: thousands of waits hold a few threads, and a work
that never ends holds its own thread, not the waits after it."""

import threading
import time
from datetime import timedelta
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from conveyor.elastic import _comm as comm
from conveyor.elastic._comm import Waiting, _Waiters
from conveyor.elastic.parts import connect


class _Never:
    """A work whose peer never comes: its wait blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def wait(self) -> None:
        self.release.wait()
        raise RuntimeError("the peer was lost")


class _Done:
    """A work already ended."""

    def wait(self) -> None:
        pass


class _Seen:
    """A gloo work that notes the thread waiting on it."""

    threads: ClassVar[set[threading.Thread]] = set()  # the threads themselves, so none is collected and its id reused

    def __init__(self, work: object) -> None:
        self.work = work

    def wait(self) -> None:
        _Seen.threads.add(threading.current_thread())
        self.work.wait()  # type: ignore[attr-defined]


def test_waits_reuse_their_threads_and_a_stuck_one_holds_only_its_own() -> None:
    store = connect("127.0.0.1", 0, is_leader=True)
    group = dist.ProcessGroupGloo(dist.PrefixStore("pg/waits/", store), 0, 1, timedelta(seconds=10))
    tensor = torch.ones(8)
    before = threading.active_count()
    stuck = _Never()
    blocked = Waiting(stuck)
    for _ in range(2000):
        assert Waiting(_Seen(group.allreduce([tensor]))).ready(5.0)  # not queued behind the stuck one
    assert len(_Seen.threads) <= 2 and threading.active_count() <= before + 3  # not a thread per wait
    assert not blocked.ready() and blocked.error is None
    stuck.release.set()
    assert blocked.ready(5.0) and isinstance(blocked.error, RuntimeError)
    assert Waiting(group.allreduce([tensor])).ready(5.0) and threading.active_count() <= before + 3


def test_threads_idle_past_their_limit_end_but_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three waits at once start three threads; once they have ended, two end after the idle limit."""
    pool = _Waiters()
    pool.idle_s = 0.2
    monkeypatch.setattr(comm, "_WAITERS", pool)
    before = threading.active_count()
    stuck = [_Never() for _ in range(3)]
    waits = [Waiting(work) for work in stuck]
    assert threading.active_count() == before + 3
    for work in stuck:
        work.release.set()
    assert all(w.ready(5.0) for w in waits)
    time.sleep(0.6)
    assert threading.active_count() == before + 1
    assert Waiting(_Done()).ready(5.0) and threading.active_count() == before + 1  # the one left serves the next
