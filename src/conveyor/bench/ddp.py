"""The baseline users run today: torch's ``DistributedDataParallel`` on the same workers, network and data.

Every worker builds the same model (the same seed as ``conveyor train``), reads the same shuffled batches
and trains on its share of each (``tensor_split`` over the workers, as Conveyor's data parallelism gives
one microbatch of the batch to each replica); DDP all-reduces the gradients in buckets during the
backward. After each epoch the first worker evaluates on the test set. The summary has the fields of
:func:`conveyor.job.train`'s that the benchmarks read.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from conveyor.config import TrainConfig
from conveyor.emulate import Emulation, launch_emulated
from conveyor.emulate.parts import ServerTraffic
from conveyor.job import EpochBatches, loss_and_optimizer, model_and_data

__all__ = ["train_ddp"]


def _worker(cfg: TrainConfig) -> dict[str, Any]:
    model, data = model_and_data(cfg)
    loss_fn, make_optimizer = loss_and_optimizer(cfg.optimizer, data.sequence)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.run.seed + 1 + rank)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(ddp.parameters())
    batches = EpochBatches(data.train_x, data.train_y, cfg.optimizer.batch_size, cfg.run.seed)
    history: list[dict[str, Any]] = []
    dist.barrier()  # every worker built before the clock starts, as conveyor train's
    started_at, start, train_seconds, traffic = time.time(), time.perf_counter(), 0.0, ServerTraffic(rank == 0)
    for epoch in range(cfg.run.epochs):
        batches.order.epoch = epoch
        began = time.perf_counter()
        traffic.start()
        ddp.train()
        for x, y in batches:
            loss = loss_fn(ddp(x.tensor_split(world)[rank]), y.tensor_split(world)[rank])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        train_seconds += time.perf_counter() - began
        traffic.stop()
        accuracy = torch.zeros(1)
        if rank == 0:
            model.eval()
            with torch.no_grad():
                accuracy[0] = (model(data.test_x).argmax(-1) == data.test_y).float().mean()
        dist.broadcast(accuracy, src=0)
        samples = (epoch + 1) * data.samples
        history.append(
            {
                "seconds": time.perf_counter() - start,
                "train_seconds": train_seconds,
                "samples": samples,
                "samples_per_s": samples / train_seconds,
                "accuracy": float(accuracy),
                "bytes_between_servers": traffic.total,
            }
        )
        if cfg.run.target_accuracy is not None and float(accuracy) >= cfg.run.target_accuracy:
            break
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"history": history, "peak_rss_bytes": peak, "started_at": started_at}


def train_ddp(cfg: TrainConfig, workers: int, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Train ``cfg``'s model with DDP on ``workers`` processes (on ``cfg``'s emulated cluster, faults included, if
    any; their log in ``run_dir/faults.jsonl``).

    Returns:
        ``accuracy`` and ``epoch_seconds`` per epoch, ``samples_per_s`` (of training time), ``seconds``,
        ``samples`` trained, ``bytes_between_servers`` while training (``None`` off an emulated network),
        ``peak_rss_bytes`` per worker, ``started_at`` (``time.time()`` when training began) and ``layout``.
    """
    per_rank = launch_emulated(_worker, cfg, nprocs=workers, emulation=Emulation.of(cfg.emulation), log_dir=run_dir)
    history = per_rank[0]["history"]
    return {
        "accuracy": [h["accuracy"] for h in history],
        "epoch_seconds": [h["seconds"] for h in history],
        "seconds": history[-1]["seconds"],
        "samples_per_s": history[-1]["samples_per_s"],
        "samples": history[-1]["samples"],
        "bytes_between_servers": history[-1]["bytes_between_servers"],
        "peak_rss_bytes": [per_rank[r]["peak_rss_bytes"] for r in sorted(per_rank)],
        "started_at": per_rank[0]["started_at"],
        "layout": {"replicas": [workers], "schedule": "ddp"},
    }
