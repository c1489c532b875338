"""What a training job measures at start-up, and the figures it plans with."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from conveyor.config import TrainConfig
from conveyor.job import model_and_data
from conveyor.job._costs import Costs
from conveyor.job._measure import measure_costs
from conveyor.runtime import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _measure() -> Costs | None:
    model, data = model_and_data(TrainConfig.from_options())
    sample = [(data.train_x[i * 64 : (i + 1) * 64], data.train_y[i * 64 : (i + 1) * 64]) for i in range(3)]
    sgd = partial(torch.optim.SGD, lr=0.05)
    return measure_costs(
        model, sample, microbatches=4, loss_fn=F.cross_entropy, optimizer=sgd, name="mlp", device=torch.device("cpu")
    )


def test_every_worker_measures_and_the_first_keeps_the_figures() -> None:
    out = launch(_measure, nprocs=2, timeout_s=100)
    assert out[1] is None
    costs = out[0]
    assert costs is not None and costs.workers == 2 and costs.link is not None and costs.allreduce is not None
    assert [lay.name for lay in costs.profile.layers] == ["0", "1", "2", "3", "4"]
    assert costs.profile.batch_size == 16 and all(lay.step_s > 0 for lay in costs.profile.layers[::2])
    assert costs.single_worker_samples_per_s > 0 and costs.overhead_s < 0.01
    level = costs.topology.levels[0]
    assert (level.count, level.bandwidth, level.latency) == (2, costs.link.bandwidth, costs.link.latency)
    runtime = costs.runtime
    assert (runtime.send_s, runtime.recv_s, runtime.cores) == (costs.link.send_s, costs.link.recv_s, costs.cores)
    assert costs.summary()["workers"] == 2
    # An update as the executor makes it, over the profile's step, measured without and with weight versions
    # (which is the dearer is a time: tests/runtime/test_calibrate.py checks what each measures).
    plain, stashed = costs.update_factors
    assert plain > 0 and stashed > 0 and (plain, stashed) != (1.0, 1.0)
    assert (runtime.update_factor, runtime.stashed_update_factor) == (plain, stashed)
    forward = costs.stashed_forward_factor
    assert forward > 0 and forward != 1.0 and runtime.stashed_forward_factor == forward
    assert costs.summary()["update_factors"] == [plain, stashed]
    assert costs.summary()["stashed_forward_factor"] == forward


def test_one_worker_measures_no_link() -> None:
    costs = launch(_measure, nprocs=1, timeout_s=100)[0]
    assert costs is not None and costs.link is None and costs.allreduce is None
    assert costs.topology.workers == 1 and costs.runtime.send_s == 0.0


def _measure_on_device(cores: float) -> Costs | None:
    model, data = model_and_data(TrainConfig.from_options())
    sample = [(data.train_x[i * 64 : (i + 1) * 64], data.train_y[i * 64 : (i + 1) * 64]) for i in range(3)]
    sgd = partial(torch.optim.SGD, lr=0.05)
    return measure_costs(
        model,
        sample,
        microbatches=1,
        loss_fn=F.cross_entropy,
        optimizer=sgd,
        name="mlp",
        device=torch.device("cpu"),
        device_cores=cores,
    )


def test_on_an_emulated_device_the_plain_loops_spread_is_not_the_figures() -> None:
    """A quota stops the device for most of each 25 ms: the plain loop's batches vary by that, not by the figures'
    noise, so no spread is recorded (the planner's ties and the trust in kept figures fall back to their own)."""
    costs = launch(_measure_on_device, 0.45, nprocs=1, timeout_s=100)[0]
    assert costs is not None and costs.spread == 0.0 and costs.single_worker_samples_per_s > 0
    quiet = launch(_measure, nprocs=1, timeout_s=100)[0]
    assert quiet is not None and quiet.spread > 0  # measured without a device: the batches' spread
