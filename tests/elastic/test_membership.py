"""The coordinator turns stopped heartbeats into failures, notices and joins into planned generations, and the
loss of the reliable tier into a clear error."""

import json
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from conveyor.elastic import Coordinator, Generation, JobFailed
from conveyor.elastic._membership import (
    KEPT_GENERATIONS,
    Heartbeat,
    _group_keys,
    group_prefix,
    latest,
    record,
    stage_group,
)
from conveyor.elastic._tiers import Roles
from conveyor.elastic.parts import connect

pytestmark = pytest.mark.timeout(60)


def newest(store: dist.Store, after: int, limit_s: float = 10.0) -> Generation:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        gen = latest(store)
        if gen.gen > after:
            return gen
        time.sleep(0.05)
    raise AssertionError(f"no generation after {after} in {limit_s} s")


def newest_listing(store: dist.Store, after: int, *, member: int = -1, leaver: int = -1) -> Generation:
    """The first generation after ``after`` with ``member`` among its members or ``leaver`` among its leavers: the
    coordinator may write one between (a leaver's exit seen in a tick after the next join lists the leaver in the
    join's generation, and a generation that drops it follows: ``left [ID]``)."""
    gen = newest(store, after)
    while member not in gen.members and leaver not in gen.leaving:
        gen = newest(store, gen.gen)
    return gen


def beat(store: dist.Store, workers: list[int], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for w in workers:
            store.add(f"hb/{w}", 1)
        time.sleep(0.1)


@pytest.mark.serial  # silences and gaps against the wall clock
def test_generations_from_heartbeats_notices_and_joins(tmp_path: Path) -> None:
    server = connect("127.0.0.1", 0, is_leader=True)
    store = connect("127.0.0.1", server.port, is_leader=False)
    log = tmp_path / "elastic.jsonl"
    coordinator = Coordinator(
        "127.0.0.1", server.port, initial=4, reliable=2, lost_s=0.5, sync_max=0.5, backup_only_min=8.0, log=log
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
        decided = [json.loads(line) for line in log.read_text().splitlines()]
        (loss,) = [d for d in decided if d["reason"] == "lost [2]"]  # logged with the silence that decided it
        assert 0.5 < loss["silent_s"]["2"] < 1.0 and loss["evidence"] is False
        assert all("silent_s" not in d for d in decided if d["planned"])
        beat(store, [0, 4], 1.0)  # now reliable worker 1 falls silent (the coordinator's own, 0, cannot)
        with pytest.raises(JobFailed, match="reliable worker 1 was lost"):
            newest(store, lost.gen)
    finally:
        coordinator.close()


@pytest.mark.slow
def test_the_store_keeps_the_keys_of_the_last_generations_only() -> None:
    """50 rounds of a worker joining and the previous one leaving (100 generations, each with a boundary and
    a group's rendezvous keys): once past the kept window, the store's key count stays flat. When worker 0's
    recoveries stop moving its state's generation on (the last 10 rounds), that generation's record is kept."""
    server = connect("127.0.0.1", 0, is_leader=True)
    store = connect("127.0.0.1", server.port, is_leader=False)
    coordinator = Coordinator("127.0.0.1", server.port, initial=2, reliable=1, lost_s=60.0)
    counts, gen, transient, held = [], latest(store), 1, -1
    try:
        for round_ in range(50):
            if round_ < 40:
                held = gen.gen
                store.set("state_gen", str(held))  # worker 0 recovered in the newest generation
            joiner = store.add("next_id", 1) - 1
            store.set(f"join/{store.add('joins', 1) - 1}", str(joiner))
            store.add(f"hb/{joiner}", 1)
            gen = newest_listing(store, gen.gen, member=joiner)
            store.set(f"leave/{transient}", "1")
            gen = newest_listing(store, gen.gen, leaver=transient)
            assert gen.members == (0, joiner) and gen.leaving == (transient,)
            store.set(f"left/{transient}", str(gen.gen))
            for g in (gen.gen - 1, gen.gen):  # what the workers write in a generation
                store.set(f"boundary/{g}", "0")
                for rank in range(2):
                    store.set(f"pg/{g}/train//0/{rank}", "address")
            transient = joiner
            counts.append(server.num_keys())
    finally:
        coordinator.close()
    kept = KEPT_GENERATIONS
    # Two generations a round (three in a round where a leaver's exit was seen late): 78 after round 39.
    assert gen.gen >= 100 and held >= 78 and int(store.get("state_gen")) == held
    assert record(store, held) is not None and record(store, held - 1) is None
    assert all(record(store, g) is not None for g in range(held, gen.gen + 1))
    # Flat: without the deletions each round adds 11 keys (two records, two boundaries, four group keys, hb, leave,
    # left), 220 from the first ten rounds past the window to the last ten before round 40. The coordinator deletes
    # a tick after it sees a worker go, so a round's count may include a few rounds not yet deleted on a busy
    # machine (seen: 12 to 30): the medians of the two stretches are compared, within a round's keys.
    early, late = statistics.median(counts[kept : kept + 10]), statistics.median(counts[30:40])
    assert late - early <= 11, counts


def test_the_keys_deleted_for_a_generations_groups_are_those_gloo_wrote() -> None:
    """Gloo's rendezvous names its keys itself: build a real group of 3 under a generation's prefix (as
    ``Watch.group`` does) and delete the keys the coordinator would; none is left."""
    server = connect("127.0.0.1", 0, is_leader=True)
    before = server.num_keys()
    groups: dict[int, dist.ProcessGroupGloo] = {}

    def build(rank: int) -> None:
        client = connect("127.0.0.1", server.port, is_leader=False)
        prefix = dist.PrefixStore(group_prefix(7, stage_group(1)), client)
        groups[rank] = dist.ProcessGroupGloo(prefix, rank, 3, timedelta(seconds=30))

    threads = [threading.Thread(target=build, args=(rank,)) for rank in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(groups) == 3 and server.num_keys() == before + 3
    gen = Generation(7, (0, 1, 2), (), (0,), Roles(2, (0, 1, 2), (1, 2)), True, "test")
    for key in _group_keys(gen):
        server.delete_key(key)
    assert server.num_keys() == before


class FakeLiveness:
    """Connections the test opens and closes (the real ones: ``tests/elastic/test_liveness.py``)."""

    def __init__(self) -> None:
        self.watched: list[int] = []
        self.connected: set[int] = set()
        self.died: dict[int, str] = {}

    def watch(self, worker: int) -> None:
        self.watched.append(worker)

    def paired(self, worker: int) -> bool:
        return worker in self.connected

    def closed(self, worker: int) -> str | None:
        return self.died.get(worker)

    def forget(self, worker: int) -> None:
        self.connected.discard(worker)


@pytest.mark.serial  # silences and gaps against the wall clock
def test_a_connected_worker_is_lost_when_its_connection_closes_not_for_a_short_silence(tmp_path: Path) -> None:
    """After a failed collective, a worker not yet connected is lost after a few silent beats; a connected one
    rides the same silence out (a live worker stalled beside a lost one), and is lost the moment its connection
    closes."""
    server = connect("127.0.0.1", 0, is_leader=True)
    store = connect("127.0.0.1", server.port, is_leader=False)
    log = tmp_path / "elastic.jsonl"
    liveness = FakeLiveness()
    liveness.connected = {1, 2}
    coordinator = Coordinator(
        "127.0.0.1",
        server.port,
        initial=4,
        reliable=1,
        lost_s=30.0,
        log=log,
        liveness=liveness,
    )
    try:
        start = latest(store)
        assert liveness.watched == [1, 2, 3]
        beat(store, [1, 2, 3], 0.3)
        store.add("suspects", 1)  # a collective failed: 2 and 3 fall silent
        beat(store, [1], 1.5)
        lost = newest(store, start.gen)
        assert lost.reason == "lost [3]" and lost.members == (0, 1, 2)
        liveness.died[2] = "Connection closed by peer [127.0.0.1]:1234"
        closed = newest(store, lost.gen, limit_s=1.0)
        assert closed.reason == "lost [2]" and closed.members == (0, 1)
        decided = {d["reason"]: d for d in map(json.loads, log.read_text().splitlines())}
        assert decided["lost [3]"]["evidence"] is True and decided["lost [3]"]["closed"] == {}
        assert 0.6 < decided["lost [3]"]["silent_s"]["3"] < 1.5
        assert decided["lost [2]"]["closed"] == {"2": liveness.died[2]}
        assert decided["lost [2]"]["silent_s"]["2"] > 1.5
    finally:
        coordinator.close()


@pytest.mark.serial  # silences and gaps against the wall clock
def test_a_heartbeat_records_its_gaps_and_why_it_stopped() -> None:
    """What a worker declared lost alive logs: its beats' longest gaps, and the error that stopped them."""
    server = connect("127.0.0.1", 0, is_leader=True)
    heartbeat = Heartbeat("127.0.0.1", server.port, worker=3, beat_s=0.05)
    time.sleep(0.5)
    beating = heartbeat.record()
    assert beating["beating"] and beating["error"] is None and server.add("hb/3", 0) >= 5
    assert len(beating["longest_gaps_s"]) == 3 and all(0.05 <= g < 0.4 for g in beating["longest_gaps_s"])
    del server  # the store goes: the next beat fails, and says how
    time.sleep(0.5)
    stopped = heartbeat.record()
    assert not stopped["beating"] and stopped["error"] and stopped["last_beat_ago_s"] > 0.2
