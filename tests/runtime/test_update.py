"""Replicas all-reduce their gradients in buckets that start during the backward, and still take the update
of gradient accumulation over the batch."""

from functools import partial
from typing import Any

import pytest
import reference
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import batches, mlp

from conveyor.runtime import Pipeline, launch
from conveyor.runtime._update import Updater

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SGD = partial(torch.optim.SGD, lr=0.05, momentum=0.9)
SIZES = (12, 12, 7, 2)  # the last batch leaves replicas without a sample


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[:n], y[:n]) for (x, y), n in zip(batches(n=len(SIZES), size=12), SIZES, strict=True)]


def _run(replicas: int, bucket_bytes: int) -> dict[str, Any]:
    pipe = Pipeline(
        mlp(),
        [5],
        microbatches=4,
        loss_fn=F.cross_entropy,
        optimizer=SGD,
        schedule="flush",
        replicas=[replicas],
        bucket_bytes=bucket_bytes,
    )
    pipe.train(_data())
    updater = pipe.executor.updater
    return {
        "params": {k: v.detach().clone() for k, v in pipe.module.named_parameters()},
        "buckets": len(updater.buckets),
        "started_in_backward": updater.started_in_backward,
        "updates": pipe.updates,
    }


@pytest.mark.parametrize("replicas", [2, 3])
def test_bucketed_overlapped_allreduce_equals_gradient_accumulation(replicas: int) -> None:
    per_rank = launch(_run, replicas, 256, nprocs=replicas, timeout_s=150)  # 256 bytes: a bucket per parameter
    model = mlp()
    reference.train([model], _data(), 4, "flush", [replicas], SGD, F.cross_entropy)
    for rank, out in per_rank.items():
        for name, p in model.named_parameters():
            torch.testing.assert_close(out["params"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")
        assert out["buckets"] == len(list(model.parameters()))
        # Every bucket started during the update's last backward where that backward had samples: microbatch k
        # of 4 runs on replica k % r, and a batch of n < 4 samples leaves microbatches n.. empty.
        last = max(k for k in range(4) if k % replicas == rank)
        assert out["started_in_backward"] == out["buckets"] * sum(1 for n in SIZES if last < n), rank
        assert out["updates"] == len(SIZES)


def _reduce_with_counts(count_on_host: bool) -> tuple[int, list[torch.Tensor]]:
    """Two replicas, 3 and 0 samples: each gradient sum all-reduced, divided by the summed count."""
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    rank = dist.get_rank()
    for p in module.parameters():
        p.grad = torch.full_like(p, 6.0 * (1 - rank))  # replica 1 ran nothing
    group = dist.new_group([0, 1])
    count_group = group if count_on_host else None
    updater = Updater(
        module,
        None,
        group=group,
        max_grad_norm=None,
        clip_whole_model=False,
        replicas=2,
        device=torch.device("cpu"),
        count_group=count_group,
    )
    updater.reduce(3 if rank == 0 else 0)
    return updater.samples, [p.grad.clone() for p in module.parameters()]


def test_the_sample_count_summed_on_a_host_group_gives_the_same_mean() -> None:
    """CUDA replicas sum their sample counts on a gloo group in host memory (no wait for the GPU); the mean is the
    one the count riding in the last bucket gives: 6 / 3 = 2 everywhere."""
    for count_on_host in (False, True):
        for samples, grads in launch(_reduce_with_counts, count_on_host, nprocs=2, timeout_s=60).values():
            assert samples == 3 and all(torch.equal(g, torch.full_like(g, 2.0)) for g in grads)
