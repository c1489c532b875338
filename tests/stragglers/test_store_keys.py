"""A long run leaves the c10d store as it found it: every step's claims, backups and queues are deleted once
every worker is past them, so the store does not grow with the steps."""

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import batches, mlp

from conveyor.runtime import launch
from conveyor.stragglers import FlexiblePipeline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 300
EVERY = 20  # steps between two counts of the store's keys


def _long_run(balance: list[int] | None, replicas: list[int] | None, slack: int) -> dict[str, Any]:
    """A run of :data:`STEPS` small batches (reassignment on, and backups where synchronous): the store's key
    count before it, every :data:`EVERY` steps on worker 0, after it and after an evaluation."""
    torch.set_num_threads(1)
    store = dist.distributed_c10d._get_default_store()
    pipe = FlexiblePipeline(
        mlp(),
        loss_fn=F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=0.01),
        balance=balance,
        replicas=replicas,
        chunks=2,
        slack=slack,
        backup=slack == 0,  # backups need synchronous updates
    )
    dist.barrier()
    before = store.num_keys()
    # Nobody starts before worker 0 has counted: a peer out of the barrier first would add its first step's
    # claims to the count (a fresh-clone CI run counted 5 keys before and 4 after).
    dist.barrier()
    during: list[int] = []

    def on_step(step: int) -> None:
        if step % EVERY == 0 and dist.get_rank() == 0:
            during.append(store.num_keys())

    data = batches(n=STEPS, size=8) if pipe.is_first or pipe.is_last else None
    pipe.train(data, on_step)
    dist.barrier()
    after = store.num_keys()
    dist.barrier()  # (likewise before the evaluation's keys)
    pipe.evaluate(data[0][0] if data is not None else None)
    dist.barrier()
    return {"before": before, "during": during, "after": after, "evaluated": store.num_keys()}


@pytest.mark.parametrize(
    ("balance", "replicas", "slack"),
    [(None, None, 1), ([3, 2], [2, 1], 0)],
    ids=["dp-slack", "2-1-backups"],
)
def test_the_store_holds_no_keys_of_finished_steps(
    balance: list[int] | None, replicas: list[int] | None, slack: int
) -> None:
    counts = launch(_long_run, balance, replicas, slack, nprocs=3, timeout_s=280)[0]
    assert len(counts["during"]) == STEPS // EVERY
    # Mid-run, only the steps in flight hold keys: a few claims, backups and queue places per worker (without
    # the deletions, 11 a step: about 3,300 keys after 300 steps of the pipeline).
    assert max(counts["during"]) - counts["before"] <= 30, counts["during"]
    assert counts["after"] == counts["before"] == counts["evaluated"], counts
