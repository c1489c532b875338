"""The coordinator turns stopped heartbeats into failures, notices and joins into planned generations, and the
loss of the reliable tier into a clear error."""

import time

import pytest
import torch.distributed as dist

from conveyor.elastic import Coordinator, Generation, JobFailed, connect
from conveyor.elastic._membership import latest

pytestmark = pytest.mark.timeout(60)


def newest(store: dist.Store, after: int, limit_s: float = 10.0) -> Generation:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        gen = latest(store)
        if gen.gen > after:
            return gen
        time.sleep(0.05)
    raise AssertionError(f"no generation after {after} in {limit_s} s")


def beat(store: dist.Store, workers: list[int], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for w in workers:
            store.add(f"hb/{w}", 1)
        time.sleep(0.1)


def test_generations_from_heartbeats_notices_and_joins() -> None:
    server = connect("127.0.0.1", 0, is_leader=True)
    store = connect("127.0.0.1", server.port, is_leader=False)
    coordinator = Coordinator(
        "127.0.0.1", server.port, initial=4, reliable=2, lost_s=0.5, sync_max=0.5, backup_only_min=8.0
    )
    try:
        start = latest(store)
        assert start.members == (0, 1, 2, 3) and start.roles.stage == 2 and start.planned
        assert start.roles.owners == (2, 3) and start.reliable == (0, 1)
        beat(store, [0, 1, 2, 3], 0.3)
        store.set("leave/3", "1")  # a notice: planned, the leaver hands over
        noticed = newest(store, start.gen)
        assert noticed.planned and noticed.members == (0, 1, 2) and noticed.leaving == (3,)
        store.set("left/3", "1")
        beat(store, [0, 1, 2], 0.3)
        store.set("join/0", str(store.add("next_id", 1) - 1))
        store.add("joins", 1)
        joined = newest(store, noticed.gen)
        assert joined.planned and joined.members == (0, 1, 2, 4) and joined.leaving == ()
        beat(store, [0, 1, 4], 1.0)  # worker 2 falls silent: a failure
        lost = newest(store, joined.gen)
        assert not lost.planned and lost.members == (0, 1, 4) and lost.reason == "lost [2]"
        assert Generation.from_json(lost.to_json()) == lost
        beat(store, [0, 4], 1.0)  # now reliable worker 1 falls silent (the coordinator's own, 0, cannot)
        with pytest.raises(JobFailed, match="reliable worker 1 was lost"):
            newest(store, lost.gen)
    finally:
        coordinator.close()
