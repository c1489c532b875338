"""Start-up measurements of what the runtime costs: messages, all-reduces, the executor's time per action."""

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import batches, mlp

from conveyor.runtime import (
    UpdateTimes,
    WeightVersions,
    launch,
    measure_allreduce,
    measure_link,
    measure_overhead,
    measure_updates,
)
from conveyor.runtime.parts import P2P

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _measure() -> dict[str, Any]:
    rank = dist.get_rank()
    link = measure_link(P2P(torch.device("cpu")), 1 - rank, leader=rank == 0, nbytes=1 << 20, repeats=8)
    busy = measure_link(P2P(torch.device("cpu")), 1 - rank, leader=rank == 0, repeats=8, busy=lambda: None)
    allreduce = measure_allreduce(nbytes=1 << 20, repeats=4)
    loaded = measure_allreduce(nbytes=1 << 20, repeats=4, busy=lambda: torch.randn(64, 64) @ torch.randn(64, 64))
    return {"link": link, "busy": busy, "allreduce": allreduce, "loaded": loaded}


def test_links_and_allreduces_are_measured_on_both_workers() -> None:
    out = launch(_measure, nprocs=2, timeout_s=100)
    link = out[0]["link"]
    assert 0 < link.send_s < 0.1 and 0 < link.recv_s < 0.1 and link.latency < 0.1
    # Loopback: above a megabyte per second. A noisy host can make the big message no slower than the idle
    # one; the measurement then reports its floor (a megabyte in a microsecond), which it may not exceed.
    assert 1e6 < link.bandwidth <= 1.1e12
    assert out[0]["busy"].latency < 0.1  # the work's own time is taken out of the round trips
    for key in ("allreduce", "loaded"):
        for rank in (0, 1):  # a collective: both workers measure it
            latency, bandwidth = out[rank][key]  # the same floor: half a megabyte per worker in a microsecond
            assert 0 < latency < 0.1 and 1e6 < bandwidth <= 1.1e12


def _overhead(compute_s: float) -> tuple[float, float]:
    data = batches(n=4, size=8)
    return measure_overhead(
        mlp(),
        data,
        loss_fn=F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        microbatches=2,
        compute_s=compute_s,
        device=torch.device("cpu"),
    )


def test_the_executors_own_time_is_what_a_batch_takes_beyond_its_compute() -> None:
    per_action, batch_s = launch(_overhead, 0.0, nprocs=1, timeout_s=60)[0]
    assert 0 < per_action < 0.05 and per_action == pytest.approx(batch_s / 6)  # 2 forwards, 2 backwards, 2 more
    # A batch's compute that already accounts for all of its time leaves the executor nothing.
    assert launch(_overhead, 10.0, nprocs=1, timeout_s=60)[0][0] == 0.0


def _updates() -> tuple[UpdateTimes, list[tuple[bool, int]]]:
    published: list[tuple[bool, int]] = []  # each new version: whether it is kept as a copy, and extrapolated
    publish = WeightVersions.publish

    def counted(self: WeightVersions) -> None:
        published.append((self.stashing, self.predict))
        publish(self)

    WeightVersions.publish = counted  # type: ignore[method-assign]  # in this worker process only
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    times = measure_updates(
        model,
        batches(n=4, size=8),
        loss_fn=F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        microbatches=2,
        device=torch.device("cpu"),
    )
    return times, published


def test_updates_and_forwards_are_timed_without_and_with_weight_versions() -> None:
    times, published = launch(_updates, nprocs=1, timeout_s=60)[0]
    # Medians of 6 updates and 6 forwards each (the first batch's 2 a warm-up).
    assert all(0 < t < 1.0 for t in (times.update_s, times.stashed_update_s, times.forward_s, times.stashed_forward_s))
    # An update per microbatch, 4 batches of 2, each batch without versions and then with them, each extrapolated over
    # one step (what they cost is a time, and this machine's other work may make either one the slower).
    assert published == [(False, 0), (False, 0), (True, 1), (True, 1)] * 4
