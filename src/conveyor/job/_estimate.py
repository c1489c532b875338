"""``--wan-estimate auto``: workers 0 and 1 try gaia's estimate on the job's model before training
(:class:`conveyor.gaia.Pilot`), and every worker runs with its choice, which checkpoints keep for a resumed run."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

import conveyor.job._data as datasets
from conveyor.config import TrainConfig
from conveyor.gaia import EstimatePilot, Pilot
from conveyor.job._config import wan_sites
from conveyor.job._dataset import rows
from conveyor.runtime import OptimizerFactory, to_device

__all__ = ["checkpoint_extras", "estimate_from_checkpoint", "resolve_estimate"]


def resolve_estimate(
    cfg: TrainConfig,
    model: nn.Module,
    data: datasets.Dataset,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    make_optimizer: OptimizerFactory,
    device: torch.device,
) -> tuple[TrainConfig, EstimatePilot | None]:
    """``cfg`` with gaia's ``--wan-estimate auto`` decided (on or off) by a pilot from ``model``'s first weights
    with the job's loss and optimizer (worker 0 steps on a share's gradient and worker 1 on the data centres' count
    times it, side by side), and the pilot; ``cfg`` as it is, and ``None``, where there is nothing to decide. Every
    worker calls it."""
    if cfg.wan.mode != "gaia" or cfg.wan.estimate != "auto":
        return cfg, None
    pilot = _pilot(cfg, model, data, loss_fn=loss_fn, make_optimizer=make_optimizer, device=device)
    rank = dist.get_rank()
    mine = None
    if rank < 2:  # gaia has two data centres at least, so two workers
        start = time.perf_counter()
        mine = (pilot.score(1.0 if rank == 0 else pilot.sites), time.perf_counter() - start)
    runs: list[tuple[float, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(runs, mine)
    plain, scaled = runs[0], runs[1]
    assert plain is not None and scaled is not None  # workers 0 and 1 ran them
    outcome = pilot.outcome(plain[0], scaled[0], max(plain[1], scaled[1]))
    if rank == 0:
        Console().print(outcome.describe(), highlight=False)
    return decided_estimate(cfg, "on" if outcome.estimate else "off"), outcome


def decided_estimate(cfg: TrainConfig, estimate: str) -> TrainConfig:
    """``cfg`` with ``--wan-estimate`` set to ``estimate``."""
    return dataclasses.replace(cfg, wan=dataclasses.replace(cfg.wan, estimate=estimate))


def checkpoint_extras(cfg: TrainConfig, history: list[dict[str, Any]]) -> dict[str, Any]:
    """What a checkpoint keeps besides the weights: the epochs trained and, for gaia, the estimate's choice (a
    resumed ``--wan-estimate auto`` run takes it instead of trying again)."""
    return {"history": history} | ({"wan_estimate": cfg.wan.estimate} if cfg.wan.mode == "gaia" else {})


def estimate_from_checkpoint(cfg: TrainConfig, saved: Mapping[str, Any]) -> TrainConfig:
    """``cfg`` with ``auto`` replaced by the choice a resumed checkpoint's run made, where it made one."""
    choice = saved.get("wan_estimate")
    if cfg.wan.estimate == "auto" and choice in ("on", "off"):
        return decided_estimate(cfg, choice)
    return cfg


def _pilot(
    cfg: TrainConfig,
    model: nn.Module,
    data: datasets.Dataset,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    make_optimizer: OptimizerFactory,
    device: torch.device,
) -> Pilot:
    """The pilot on this worker's device: a data centre's share of the batch, the job's loss and optimizer."""
    sites = wan_sites(cfg)

    @functools.cache
    def on_device() -> tuple[Any, torch.Tensor]:  # once, and only on the workers that run the pilot
        return to_device(data.train_x, device), data.train_y.to(device)

    def batch(index: torch.Tensor) -> tuple[Any, torch.Tensor]:
        (train_x, train_y), at = on_device(), index.to(device, non_blocking=True)
        return rows(train_x, at), train_y[at]

    return Pilot(
        model=model,
        batch=batch,
        samples=data.samples,
        loss_fn=loss_fn,
        optimizer=make_optimizer,
        sites=sites,
        share=max(1, cfg.optimizer.batch_size // sites),
        seed=cfg.run.seed,
        device=device,
    )
