"""BatchNorm's running statistics on a flexible stage are those of one process running each batch's chunks in
order, whichever replica ran which chunk, in whatever order, and whatever runs were dropped."""

import time
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from chunked import cuts_of
from torch import nn

from conveyor.runtime import launch, load_checkpoint, split_batch
from conveyor.stragglers import FlexiblePipeline
from conveyor.stragglers._statistics import RunningStatistics

SGD = partial(torch.optim.SGD, lr=0.05, momentum=0.9)
SIZES = (24, 24, 17, 24)  # the short batch's chunks are uneven; every chunk has two samples at least
CHUNKS = 6  # of every batch: 2 replicas x 3 or 3 x 2


def _model(momentum: float | None = 0.1) -> nn.Sequential:
    """Six blocks, BatchNorm in the first three (a 2-1 pipeline's replicated stage) and in the last three."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.BatchNorm1d(16, momentum=momentum),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16, momentum=momentum),
        nn.Linear(16, 4),
    ).double()  # float64: a chunk of two samples makes BatchNorm ill-conditioned in float32


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 8, generator=g, dtype=torch.float64) * 3 + 1, torch.randint(0, 4, (n,), generator=g))
        for n in SIZES
    ]


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


@pytest.mark.parametrize("momentum", [0.1, None])
def test_replicas_agree_on_the_statistics_of_the_chunks_run_in_order(momentum: float | None) -> None:
    reference, replicas = _model(momentum), [_model(momentum), _model(momentum)]
    stats = [RunningStatistics.of(r, torch.float64) for r in replicas]
    assert all(s is not None and len(s.layers) == 2 for s in stats)
    # Replica 1 runs chunks 5, 0, 3; replica 0 runs 1, 2, 4 and then 3 again, a backup whose run is dropped.
    runs = [[(1, True), (2, True), (4, True), (3, False)], [(5, True), (0, True), (3, True)]]
    for x, _ in _data():
        chunks = split_batch(x, CHUNKS)
        for part in chunks:
            reference(part)
        summed = torch.zeros(stats[0].size, dtype=torch.float64)  # type: ignore[union-attr]
        for replica, s, order in zip(replicas, stats, runs, strict=True):
            assert s is not None
            with s.step():
                for j, counted in order:
                    replica(chunks[j])
                    term = s.end_chunk(j, CHUNKS)
                    if counted:
                        summed += term
        for s in stats:
            assert s is not None
            s.apply(summed, CHUNKS)
    for replica in replicas:
        for name, b in _buffers(reference).items():
            torch.testing.assert_close(_buffers(replica)[name], b, rtol=1e-5, atol=1e-5, msg=name)
        assert [m.momentum for m in replica.modules() if isinstance(m, nn.BatchNorm1d)] == [momentum, momentum]


def test_the_layers_get_their_momentum_back_when_a_step_fails() -> None:
    model = _model()
    stats = RunningStatistics.of(model, torch.float32)
    assert stats is not None
    with pytest.raises(RuntimeError, match="stop"), stats.step():
        assert model[1].momentum == 1.0  # a forward leaves the chunk's own statistics
        raise RuntimeError("stop")
    assert model[1].momentum == 0.1
    assert RunningStatistics.of(nn.Sequential(nn.Linear(2, 2)), torch.float32) is None


def _reference(cuts: list[list[int]]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process: each batch's mean gradient over its chunks run in order, cut as the run cut them (BatchNorm's
    batch statistics per chunk; the cuts follow the replicas' measured speeds), two runs (the second of the first
    two batches); its final weights and buffers."""
    model = _model()
    opt = SGD(model.parameters())
    for (x, y), cut in zip(_data() + _data()[:2], cuts, strict=True):
        opt.zero_grad()
        for xc, yc in zip(split_batch(x, cut), split_batch(y, cut), strict=True):
            if len(xc):
                (F.cross_entropy(model(xc), yc, reduction="sum") / len(x)).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}, _buffers(model)


def _train(balance: list[int] | None, replicas: list[int], backup: bool, path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _model()
    if torch.distributed.get_rank() == 1:  # a straggler: slow throughout, or stopped 1 s once in a chunk
        calls = iter(range(1000))
        model[0].register_forward_pre_hook(
            lambda *_: time.sleep(1.0 if next(calls) == 4 else 0.0) if backup else time.sleep(0.03)
        )
    pipe = FlexiblePipeline(
        model,
        loss_fn=F.cross_entropy,
        optimizer=SGD,
        balance=balance,
        replicas=replicas,
        chunks=CHUNKS // replicas[0],
        backup=backup,
    )
    feed = _data() if pipe.is_first or pipe.is_last else None
    pipe.train(feed)
    pipe.train(feed[:2] if feed else None)
    records = pipe.gather_records()
    pipe.save(path)
    params = {k: v.detach().clone() for k, v in pipe.module.named_parameters()}
    return {"params": params, "buffers": _buffers(pipe.module), "records": records}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("balance", "replicas", "backup"),
    [(None, [3], False), (None, [2], True), ([3, 3], [2, 1], False)],
    ids=["dp-reassign", "dp-backup", "2-1-reassign"],
)
def test_every_worker_holds_the_statistics_of_one_process(
    balance: list[int] | None, replicas: list[int], backup: bool, tmp_path
) -> None:
    path = str(tmp_path / "model.pt")
    per_rank = launch(_train, balance, replicas, backup, path, nprocs=sum(replicas), timeout_s=150)
    records = next(out["records"] for out in per_rank.values() if out["records"] is not None)
    params, buffers = _reference(cuts_of(records))
    saved = load_checkpoint(path)["model"]
    for name, expected in {**params, **buffers}.items():
        torch.testing.assert_close(saved[name], expected, rtol=1e-5, atol=1e-5, msg=f"checkpoint {name}")
    for rank, out in per_rank.items():  # each worker's stage, whoever ran its chunks
        assert out["buffers"], f"worker {rank} holds no statistics"
        for name, b in out["buffers"].items():
            torch.testing.assert_close(b, buffers[name], rtol=1e-5, atol=1e-5, msg=f"worker {rank} {name}")
    moved = sum(r["taken"] + r["dropped"] for r in records)
    assert moved > 0  # the straggler's chunks were taken, or its stalled run dropped
