"""Streaming input: batches are read as the run goes, never held whole, and a generator's run equals a list's."""

from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from conveyor.runtime import Pipeline, launch
from conveyor.runtime._feed import BatchSource, read_ahead

pytestmark = pytest.mark.timeout(300)


def _batch(i: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _long_run(count: int, as_generator: bool) -> dict[str, Any]:
    """2 stages, PipeDream (an update per batch): each worker counts its stage's forwards, and its generator
    records how far it was pulled ahead of them at every pull."""
    pipe = Pipeline(
        _model(),
        [2, 1],
        microbatches=1,
        loss_fn=F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=0.01),
        schedule="pipedream",
    )
    forwards = [0]
    pipe.module[0].register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    ahead: list[int] = []
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    keys = [store.num_keys()]  # before the run, every 100 batches read, after it

    def stream() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(count):
            ahead.append(i - forwards[0])
            if i % 100 == 0:
                keys.append(store.num_keys())
            yield _batch(i)

    losses = pipe.train(stream() if as_generator else [_batch(i) for i in range(count)])
    dist.barrier()
    keys.append(store.num_keys())
    return {
        "keys": keys,
        "most_ahead": max(ahead, default=0),
        "weights": {k: v.clone() for k, v in pipe.module.state_dict().items()},
        "losses": None if losses is None else (len(losses), sum(losses)),
        "steps": pipe.steps,
    }


@pytest.mark.slow
def test_a_generator_of_2000_batches_is_read_lazily_and_trains_as_the_list_does() -> None:
    count = 2_000
    lazy = launch(_long_run, count, True, nprocs=2, timeout_s=280)
    bound = 2 * read_ahead(2, 1) + 2  # worker 0 reads two windows ahead, past the first stage's warm-up
    assert lazy[0]["most_ahead"] <= bound, lazy[0]["most_ahead"]
    assert lazy[1]["most_ahead"] <= 2  # the last stage reads a batch's targets when its forward comes
    # The windows' announcements are deleted once read (250 windows of 8 batches here; 2 keys each until
    # read): the store holds a few at most, and none after the run.
    keys = lazy[0]["keys"]
    assert len(keys) == 2 + count // 100 and max(keys) - keys[0] <= 6 and keys[-1] == keys[0], keys
    listed = launch(_long_run, count, False, nprocs=2, timeout_s=280)
    for rank in (0, 1):
        assert lazy[rank]["steps"] == listed[rank]["steps"] == count
        for name, w in listed[rank]["weights"].items():
            assert torch.equal(lazy[rank]["weights"][name], w), name
    assert lazy[1]["losses"][0] == count and lazy[1]["losses"] == listed[1]["losses"]


SCHEDULES = ("gpipe", "flush", "pipedream", "pipedream-vs", "2bw")


def _layouts(replicas: list[int]) -> dict[tuple[str, bool], dict[str, torch.Tensor]]:
    balance = [1, 2] if len(replicas) == 2 else [3]
    data = [_batch(i, size=5) for i in range(23)]
    out = {}
    sgd = partial(torch.optim.SGD, lr=0.05)
    for schedule in SCHEDULES:
        for as_generator in (True, False):
            pipe = Pipeline(
                _model(),
                balance,
                microbatches=3,
                loss_fn=F.cross_entropy,
                optimizer=sgd,
                schedule=schedule,
                replicas=replicas,
            )
            pipe.train(iter(data) if as_generator else data)
            out[(schedule, as_generator)] = {k: v.clone() for k, v in pipe.module.state_dict().items()}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [[3, 1], [2, 2]])  # a replicated first stage; replicated first and last
def test_generators_run_every_schedule_on_any_layout(replicas: list[int]) -> None:
    """An unsized run's length is announced window by window: no layout waits on it forever, and the weights
    are those of the same batches given as a list."""
    for rank, result in launch(_layouts, replicas, nprocs=4, timeout_s=120).items():
        for schedule in SCHEDULES:
            for name, w in result[(schedule, False)].items():
                assert torch.equal(result[(schedule, True)][name], w), (schedule, rank, name)


def test_a_source_reads_only_what_it_needs_and_drops_what_it_used() -> None:
    pulled = []

    def stream() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(5):
            pulled.append(i)
            yield _batch(i, size=3)

    source = BatchSource(stream(), microbatches=2, inputs=False, targets=True, worker=3)
    assert pulled == [0]  # the first batch is read at once, so a malformed one fails before any message
    inputs, targets, samples = source.microbatch(3)  # batch 1, part 1 (sizes 2 and 1)
    assert inputs is None and samples == 1 and torch.equal(targets, _batch(1, size=3)[1][2:])
    assert pulled == [0, 1]
    with pytest.raises(ValueError, match="worker 3's batches end after 5, but the run has at least 11"):
        source.microbatch(20)


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="batch 0 has no samples: leave empty batches out"):
        BatchSource([_batch(0, size=0)], microbatches=2, inputs=True, targets=True, worker=0)


def _three_replicas_ahead() -> int:
    """PipeDream on 3-1 with 4 microbatches per batch: replica 2 of stage 0 asks about batch 5 (window 1) while
    worker 0, one round behind at its all-reduce, still works in window 0."""
    pipe = Pipeline(
        _model(),
        [2, 1],
        microbatches=4,
        loss_fn=F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=0.05),
        schedule="pipedream",
        replicas=[3, 1],
    )
    pipe.train(iter([_batch(i, size=10) for i in range(7)]))
    return pipe.steps


@pytest.mark.slow
def test_the_next_window_is_announced_before_a_replica_needs_it() -> None:
    assert launch(_three_replicas_ahead, nprocs=4, timeout_s=60) == {r: 7 for r in range(4)}
