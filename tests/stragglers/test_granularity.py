"""--chunks auto: the choice from a step's times, and timing that leaves the stage as it found it."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conveyor.config import TrainConfig
from conveyor.errors import InputError
from conveyor.runtime import WorkerError, launch
from conveyor.stragglers._granularity import CANDIDATES, agree_on_chunks, choose_chunks, time_chunks


@pytest.mark.parametrize(
    ("fixed_ms", "samples", "chosen"),
    [
        (7.4, 16, 1),  # the benchmark's resnet on one CPU thread (0.43 ms a sample): J = 28.6, 32.5, 45.6, 74.3 ms
        (7.4, 64, 2),  # the benchmark's batch of 256 over 4 replicas: J = 69.8, 63.5, 71.4, 97.6 ms
        (0.3, 16, 4),  # J = 14.4, 11.2, 10.1, 10.4 ms
        (0.05, 16, 8),
    ],
)
def test_the_count_weighs_fixed_costs_against_the_chunk_a_stall_holds(
    fixed_ms: float, samples: int, chosen: int
) -> None:
    times = {c: c * fixed_ms + 0.43 * samples for c in CANDIDATES}
    assert choose_chunks(times) == chosen


def test_one_timing_is_one_chunk_and_a_tie_takes_the_fewer() -> None:
    assert choose_chunks({1: 1.0}) == 1
    assert choose_chunks({1: 3.0, 2: 4.0}) == 1  # J ties at 6


def test_timing_leaves_gradients_buffers_and_random_state_as_they_were() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))
    module.train()
    module[0].weight.grad = torch.ones_like(module[0].weight)
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    share = torch.randn(10, 6)
    state = torch.random.get_rng_state()
    times = time_chunks(module, share, device=torch.device("cpu"), mixed=contextlib.nullcontext, repeats=2)
    assert sorted(times) == [1, 2, 4] and all(t > 0 for t in times.values())  # 8 would cut chunks of one sample
    torch.testing.assert_close(module[0].weight.grad, torch.ones_like(module[0].weight))
    assert module[3].weight.grad is None
    for k, v in module.named_buffers():
        torch.testing.assert_close(v, buffers[k])
    assert torch.equal(torch.random.get_rng_state(), state)
    assert list(time_chunks(module, torch.randn(3, 6), device=torch.device("cpu"), mixed=contextlib.nullcontext)) == [1]


@pytest.mark.parametrize("chunks", [0, -1, "some", True, 2.0])
def test_chunks_are_a_positive_count_or_auto(chunks: object) -> None:
    with pytest.raises(InputError, match="--chunks must be at least 1 or auto"):
        TrainConfig.from_options(stragglers="reassign", chunks=chunks)
    assert TrainConfig.from_options(stragglers="reassign", chunks="auto").stragglers.chunks == "auto"


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("no forward here")


def _agree_with_a_failing_timing() -> None:
    batches = [(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))]
    first = dist.get_rank() == 0
    agree_on_chunks(
        _Fails(),
        batches if first else None,
        first=first,
        replicas=2,
        device=torch.device("cpu"),
        mixed=contextlib.nullcontext,
    )


@pytest.mark.slow
def test_a_timing_that_fails_on_worker_0_fails_every_worker_at_once() -> None:
    # Worker 0 tells the others, which wait in the broadcast, instead of leaving them to time out.
    with pytest.raises(WorkerError, match="timing the first batch's chunks failed on worker 0: ValueError: no forward"):
        launch(_agree_with_a_failing_timing, nprocs=2, timeout_s=60)
