"""Flexible data parallelism takes the update of its equations whatever the split, with and without a straggler."""

import time
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import batches, mlp

from conveyor.runtime import launch
from conveyor.stragglers import FlexibleDataParallel

pytestmark = pytest.mark.timeout(180)

SGD = partial(torch.optim.SGD, lr=0.05, momentum=0.9)
SIZES = (24, 24, 17, 24, 5, 24)  # a short batch leaves chunks empty
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _data() -> Batches:
    return [(x[:n], y[:n]) for (x, y), n in zip(batches(n=len(SIZES), size=24), SIZES, strict=True)]


def reference(runs: list[Batches], slack: int, predict: bool) -> dict[str, torch.Tensor]:
    """The module docstring's equations in one process: W(t+1) = opt(W(t), g(t - s)), g(t) the batch's mean
    gradient at W~(t) = W(t) + s (W(t) - W(t-1)) from a run's first update on, the last s gradients of a run
    applied after its last batch."""
    model = mlp()
    params = list(model.parameters())
    opt = SGD(params)

    def apply(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        return before

    for data in runs:
        pending, previous = list[list[torch.Tensor]](), None
        for x, y in data:
            master = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, prev in zip(params, (previous or []) if predict and slack else [], strict=False):
                    p.add_(slack * (p - prev))
            pending.append(list(torch.autograd.grad(F.cross_entropy(model(x), y), params)))
            with torch.no_grad():
                for p, w in zip(params, master, strict=True):
                    p.copy_(w)
            if len(pending) > slack:
                previous = apply(pending.pop(0))
        for grads in pending:
            apply(grads)
    return {k: v.detach() for k, v in model.named_parameters()}


def _train(slack: int, reassign: bool, predict: bool, straggler: int | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    loss = F.cross_entropy
    if straggler is not None and torch.distributed.get_rank() == straggler:

        def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # a slow replica: 30 ms per chunk
            time.sleep(0.03)
            return F.cross_entropy(out, y)

    ddp = FlexibleDataParallel(mlp(), loss, SGD, chunks=3, slack=slack, reassign=reassign, predict=predict)
    losses = ddp.train(_data())
    ddp.train(_data()[:4])  # a second run (epoch) goes on from the first's weights and optimizer
    records = ddp.gather_records()
    return {"params": {k: v.detach().clone() for k, v in ddp.module.named_parameters()}, "losses": losses,
            "records": records}  # fmt: skip


@pytest.mark.parametrize(
    ("slack", "reassign", "predict", "straggler"),
    [(0, False, True, None), (0, True, True, 1), (1, True, True, 2), (2, False, True, 0), (2, True, False, 1)],
)
def test_updates_equal_the_reference(slack: int, reassign: bool, predict: bool, straggler: int | None) -> None:
    per_rank = launch(_train, slack, reassign, predict, straggler, nprocs=3, timeout_s=150)
    expected = reference([_data(), _data()[:4]], slack, predict)
    for rank, out in per_rank.items():  # every replica holds the same weights, those of the equations
        for name, p in expected.items():
            torch.testing.assert_close(out["params"][name], p, rtol=1e-5, atol=1e-6, msg=f"replica {rank} {name}")
    records = per_rank[0]["records"]
    assert len(records) == 3 * (len(SIZES) + 4)
    for step, n in enumerate(SIZES + SIZES[:4]):  # every sample ran exactly once
        assert sum(r["samples"] for r in records if r["step"] == step) == n
    taken = sum(r["taken"] for r in records)
    assert (taken > 0) == reassign  # the fast replicas took the straggler's chunks only where allowed
    if straggler is not None and reassign:
        assert sum(r["samples"] for r in records if r["replica"] == straggler) < sum(SIZES + SIZES[:4]) / 3
    losses = per_rank[0]["losses"]
    assert losses is not None and len(losses) == len(SIZES) and per_rank[1]["losses"] is None


def _slack_lets_replicas_run_ahead(slack: int) -> float:
    """The fastest replica's time to its last step's compute, with replica 2 pausing 0.3 s at step 2."""
    torch.set_num_threads(1)
    ddp = FlexibleDataParallel(mlp(), F.cross_entropy, SGD, chunks=1, slack=slack, reassign=False)
    start, reached = time.perf_counter(), 0.0

    def on_step(step: int) -> None:
        nonlocal reached
        if step == 2 and torch.distributed.get_rank() == 2:
            time.sleep(0.3)
        if step == 3:
            reached = time.perf_counter() - start

    ddp.train(_data()[:4], on_step)
    return reached


def test_slack_absorbs_a_short_pause() -> None:
    # With slack 2 the others finish step 3's compute while replica 2 pauses after step 2; with none they wait.
    synchronous = launch(_slack_lets_replicas_run_ahead, 0, nprocs=3, timeout_s=120)
    slack = launch(_slack_lets_replicas_run_ahead, 2, nprocs=3, timeout_s=120)
    assert min(synchronous[0], synchronous[1]) > 0.3
    assert max(slack[0], slack[1]) < 0.2
