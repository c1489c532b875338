"""Backups in one process, on a dict-backed store: who backs up what, when, and that each chunk counts once."""

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conveyor.stragglers._backup import Backups, ChunkBackedUp
from conveyor.stragglers._buffer import BufferLayout
from conveyor.stragglers._chunks import ChunkRun, FirstStage, StepWork
from conveyor.stragglers._records import StepRecord


def _timed(backups: Backups, seconds: float, times: int = 3) -> None:
    """Give ``backups`` a history of chunk times of ``seconds``."""
    backups.times.extend([seconds] * times)


def test_each_chunk_is_won_by_its_first_run_only_and_every_replica_reads_who() -> None:
    store = dist.HashStore()
    owner, backup = Backups(store, replica=0), Backups(store, replica=1)
    owner.prefix = backup.prefix = "step0"
    assert backup.commit(backup.begin(3), "1,0")  # the backup finished first: its result is used
    assert not owner.commit(owner.begin(3), "0,0")  # the owner's, later, is dropped
    assert owner.commit(owner.begin(4), "0,0")
    assert owner.runner(3) == backup.runner(3) == "1,0" and backup.runner(4) == "0,0"


def test_an_idle_replica_backs_up_only_what_is_unfinished_at_the_deadline() -> None:
    store = dist.HashStore()
    first, second, owner = Backups(store, replica=2), Backups(store, replica=0), Backups(store, replica=1)
    for b in (first, second, owner):
        b.prefix = "step0"
        _timed(b, 0.01)
    assert first.deadline_s() == pytest.approx(0.02)
    owner.commit(owner.begin(0), "2")  # chunk 0 finished; chunks 1 and 2 are held by a stalled replica
    start = time.perf_counter()
    assert list(first.takeovers([0, 1, 2])) == [1, 2]
    assert time.perf_counter() - start >= 0.02  # it waited for the deadline first
    assert list(second.takeovers([0, 1, 2])) == []  # one backup per chunk: the first idle replica took them


def test_an_idle_replica_goes_on_at_once_when_every_chunk_is_finished() -> None:
    store = dist.HashStore()
    idle, owner = Backups(store, replica=2), Backups(store, replica=0)
    idle.prefix = owner.prefix = "step0"
    _timed(idle, 10.0)
    for j in (0, 1):
        owner.commit(owner.begin(j), "1")
    start = time.perf_counter()
    assert list(idle.takeovers([0, 1])) == []
    assert time.perf_counter() - start < 1.0  # not the 20 s deadline


def test_without_a_chunk_time_there_is_no_deadline_and_no_backup() -> None:
    backups = Backups(dist.HashStore(), replica=1)
    assert backups.deadline_s() == float("inf")
    assert list(backups.takeovers([0])) == []


def test_a_run_past_the_deadline_stops_before_its_next_block_once_a_peer_won_it() -> None:
    store = dist.HashStore()
    slow, peer = Backups(store, replica=2), Backups(store, replica=0)
    slow.prefix = peer.prefix = "step0"
    _timed(slow, 0.001)
    model = nn.Sequential(nn.Identity(), nn.Identity())
    slow.attach(model)
    slow.begin(5)
    model(1)  # a peer has not won it: the run goes on, even past the deadline
    time.sleep(0.01)
    model(1)
    assert peer.commit(peer.begin(5), "1")
    with pytest.raises(ChunkBackedUp):
        model(1)
    slow.watching = None
    model(1)  # nothing watched: no check


def test_before_the_deadline_a_run_asks_the_store_nothing() -> None:
    class Counting(dist.HashStore):
        checks = 0

        def check(self, keys: list[str]) -> bool:
            Counting.checks += 1
            return bool(super().check(keys))

    slow = Backups(Counting(), replica=1)
    slow.prefix = "step0"
    _timed(slow, 0.005)
    slow.begin(0)
    slow.check()
    assert Counting.checks == 0
    time.sleep(0.02)
    slow.check()  # past the deadline: one look (nobody won it, so the run goes on)
    assert Counting.checks == 1


def test_a_backup_looks_from_its_start() -> None:
    store = dist.HashStore()
    backup, owner = Backups(store, replica=2), Backups(store, replica=0)
    backup.prefix = owner.prefix = "step0"
    _timed(backup, 10.0)
    backup.begin(2, backup=True)
    backup.check()  # nobody has won it yet
    assert owner.commit(owner.begin(2), "0")
    with pytest.raises(ChunkBackedUp):
        backup.check()  # long before its 20 s deadline


def test_a_later_round_backs_up_a_chunk_whose_backup_stalled_too() -> None:
    store = dist.HashStore()
    first, second = Backups(store, replica=0, rounds=2), Backups(store, replica=1, rounds=2)
    for b in (first, second):
        b.prefix = "step0"
        _timed(b, 0.005)
    assert next(first.takeovers([0])) == 0  # round 1: the first idle replica backs chunk 0 up, and stalls
    started = time.perf_counter()
    taken = second.takeovers([0])
    assert next(taken) == 0  # round 2, a deadline later: the second backs it up again
    assert time.perf_counter() - started >= 0.02  # its round 1 found the backup taken, then waited once more
    second.commit(second.begin(0, backup=True), "1")
    assert list(taken) == []


def _stage(store: dist.Store, w: torch.Tensor, replica: int) -> tuple[FirstStage, StepWork]:
    backups = Backups(store, replica=replica)
    backups.prefix = "step0"
    step = StepWork.begin(
        0,
        "step0",
        chunks=[0, 1],
        samples=4,
        record=StepRecord(0, 0, 0, 0, 0, 0, 0.0, 0.0),
        layout=BufferLayout(terms=0, grads=w.numel()),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    runs = FirstStage(
        step=step,
        module=nn.Sequential(nn.Identity()),
        params=[w],
        loss_fn=lambda out, y: (out * y).sum(),
        mixed=contextlib.nullcontext,
        statistics=None,
        backups=backups,
        live=None,
        router=None,
        queue="",
        next_rank=0,
        depth=1,
        replica=replica,
    )
    return runs, step


def test_a_runs_gradient_joins_the_sum_only_if_it_wins() -> None:
    store = dist.HashStore()
    w = torch.ones(2, requires_grad=True)
    w.grad = torch.tensor([10.0, 10.0])  # the step's sum so far
    first, step = _stage(store, w, 0)
    second, _ = _stage(store, w, 1)
    x, y = torch.ones(1, 2), torch.tensor([[1.0, 2.0]])
    first.run(ChunkRun(0, 2, 0, 1, "own", x * w, y))  # the loss of sample-count 1: sum(w * y)
    assert w.grad.tolist() == [11.0, 12.0]  # the winner's gradient added to the sum
    assert step.record.samples == 1 and step.loss.item() == 3.0
    second.run(ChunkRun(0, 2, 0, 1, "backup", x * w, y))
    assert w.grad.tolist() == [11.0, 12.0]  # the loser's dropped (a backup stops at its first look)
    assert second.step.record.dropped == 1 and second.step.record.samples == 0
