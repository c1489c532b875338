"""Claims through the c10d store: every chunk runs exactly once however the replicas race, and a replica
killed mid-claim fails the job instead of hanging it."""

import os
import threading
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from models import batches, mlp

from conveyor.errors import InputError
from conveyor.runtime import WorkerError, launch
from conveyor.stragglers import FlexiblePipeline, StepClaims

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=25, deadline=None)
@given(shares=st.lists(st.integers(0, 5), min_size=1, max_size=6).filter(sum), reassign=st.booleans())
def test_threads_racing_claim_every_chunk_once(shares: list[int], reassign: bool) -> None:
    # Shares of any sizes, empty ones too, as weighted shares deal them.
    replicas = len(shares)
    store, claimed = dist.HashStore(), list[list[tuple[int, bool]]]([[] for _ in range(replicas)])
    barrier = threading.Barrier(replicas)

    def claim(w: int) -> None:
        barrier.wait()  # all at once
        claimed[w] = list(StepClaims(store, "step0", replica=w, shares=shares, reassign=reassign))

    threads = [threading.Thread(target=claim, args=(w,)) for w in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ran = sorted(j for mine in claimed for j, _ in mine)
    owner = [w for w, n in enumerate(shares) for _ in range(n)]  # each chunk's share
    assert ran == list(range(sum(shares)))
    for w, mine in enumerate(claimed):
        assert all(taken == (owner[j] != w) for j, taken in mine)  # taken means from another's share
        assert reassign or all(owner[j] == w for j, _ in mine)


def test_shares_must_hold_a_chunk() -> None:
    with pytest.raises(InputError, match="some one"):
        StepClaims(dist.HashStore(), "s", replica=0, shares=[0, 0])


def _claim_many(steps: int, chunks: int) -> list[list[int]]:
    store, w, n = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    out = []
    for step in range(steps):
        dist.barrier()
        out.append([j for j, _ in StepClaims(store, f"race/{step}", replica=w, shares=[chunks] * n)])
    return out


@pytest.mark.slow
def test_processes_racing_through_the_store_claim_every_chunk_once() -> None:
    per_rank = launch(_claim_many, 20, 3, nprocs=4, timeout_s=100)
    for step in range(20):
        assert sorted(j for r in per_rank for j in per_rank[r][step]) == list(range(12))


def _killed_mid_claim() -> None:
    torch.set_num_threads(1)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            os._exit(3)  # dies holding a claimed chunk
        time.sleep(0.05)  # the others are slower, so replica 1 claims its own head chunk before they could
        return F.cross_entropy(out, y)

    ddp = FlexiblePipeline(mlp(), loss_fn=loss, optimizer=partial(torch.optim.SGD, lr=0.1), chunks=2, slack=0)
    ddp.train(batches(n=4, size=12))


@pytest.mark.slow
def test_a_replica_killed_mid_claim_fails_the_job() -> None:
    with pytest.raises(WorkerError, match="worker 1"):
        launch(_killed_mid_claim, nprocs=3, timeout_s=60, collective_timeout_s=30)
