"""Backups in one process, on a dict-backed store: who backs up what, when, and that each chunk counts once."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conveyor.stragglers._backup import Backups, ChunkBackedUp


def _timed(backups: Backups, seconds: float, times: int = 3) -> None:
    """Give ``backups`` a history of chunk times of ``seconds``."""
    backups.times.extend([seconds] * times)


def test_each_chunk_is_won_by_its_first_run_only() -> None:
    store = dist.HashStore()
    owner, backup = Backups(store), Backups(store)
    owner.prefix = backup.prefix = "step0"
    backup.start(3)
    assert backup.commit(3)  # the backup finished first: its result is used
    owner.start(3)
    assert not owner.commit(3)  # the owner's, later, is dropped
    owner.start(4)
    assert owner.commit(4)


def test_an_idle_replica_backs_up_only_what_is_unfinished_at_the_deadline() -> None:
    store = dist.HashStore()
    first, second, owner = Backups(store), Backups(store), Backups(store)
    for b in (first, second, owner):
        b.prefix = "step0"
        _timed(b, 0.01)
    assert first.deadline_s() == pytest.approx(0.02)
    owner.start(0)
    owner.commit(0)  # chunk 0 finished; chunks 1 and 2 are held by a stalled replica
    start = time.perf_counter()
    assert list(first.takeovers([0, 1, 2])) == [1, 2]
    assert time.perf_counter() - start >= 0.02  # it waited for the deadline first
    assert list(second.takeovers([0, 1, 2])) == []  # one backup per chunk: the first idle replica took them


def test_an_idle_replica_goes_on_at_once_when_every_chunk_is_finished() -> None:
    store = dist.HashStore()
    idle, owner = Backups(store), Backups(store)
    idle.prefix = owner.prefix = "step0"
    _timed(idle, 10.0)
    for j in (0, 1):
        owner.start(j)
        owner.commit(j)
    start = time.perf_counter()
    assert list(idle.takeovers([0, 1])) == []
    assert time.perf_counter() - start < 1.0  # not the 20 s deadline


def test_without_a_chunk_time_there_is_no_deadline_and_no_backup() -> None:
    backups = Backups(dist.HashStore())
    assert backups.deadline_s() == float("inf")
    assert list(backups.takeovers([0])) == []


def test_a_run_past_the_deadline_stops_before_its_next_block_once_a_peer_won_it() -> None:
    store = dist.HashStore()
    slow, peer = Backups(store), Backups(store)
    slow.prefix = peer.prefix = "step0"
    _timed(slow, 0.001)
    model = nn.Sequential(nn.Identity(), nn.Identity())
    slow.attach(model)
    slow.start(5)
    model(1)  # a peer has not won it: the run goes on, even past the deadline
    time.sleep(0.01)
    model(1)
    peer.start(5)
    assert peer.commit(5)
    with pytest.raises(ChunkBackedUp):
        model(1)
    slow.abandon()
    model(1)  # nothing watched: no check


def test_before_the_deadline_a_run_asks_the_store_nothing() -> None:
    class Counting(dist.HashStore):
        checks = 0

        def check(self, keys: list[str]) -> bool:
            Counting.checks += 1
            return bool(super().check(keys))

    slow = Backups(Counting())
    slow.prefix = "step0"
    _timed(slow, 0.005)
    slow.start(0)
    slow.check()
    assert Counting.checks == 0
    time.sleep(0.02)
    slow.check()  # past the deadline: one look (nobody won it, so the run goes on)
    assert Counting.checks == 1


def test_a_backup_looks_from_its_start() -> None:
    store = dist.HashStore()
    backup, owner = Backups(store), Backups(store)
    backup.prefix = owner.prefix = "step0"
    _timed(backup, 10.0)
    backup.start(2, backup=True)
    backup.check()  # nobody has won it yet
    owner.start(2)
    assert owner.commit(2)
    with pytest.raises(ChunkBackedUp):
        backup.check()  # long before its 20 s deadline


def test_a_runs_gradient_joins_the_sum_only_if_it_wins() -> None:
    store = dist.HashStore()
    first, second = Backups(store), Backups(store)
    first.prefix = second.prefix = "step0"
    w = torch.ones(2, requires_grad=True)
    w.grad = torch.tensor([10.0, 10.0])  # the step's sum so far

    def compute(check):
        check()
        (w * torch.tensor([1.0, 2.0])).sum().backward()
        return "out"

    assert first.run(0, [w], compute) == (True, "out")
    assert w.grad.tolist() == [11.0, 12.0]  # the winner's gradient added to the sum
    assert second.run(0, [w], compute, backup=True) == (False, None)
    assert w.grad.tolist() == [11.0, 12.0]  # the loser's dropped (a backup stops at its first look)
    assert second.run(1, [w], lambda check: None) == (True, None)
    assert w.grad.tolist() == [11.0, 12.0]  # a run that made no gradient leaves the sum as it was
