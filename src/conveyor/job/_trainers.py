"""Each worker's trainer for its layout: a :class:`~conveyor.runtime.Pipeline`, or with ``--stragglers`` a
:class:`~conveyor.stragglers.FlexiblePipeline`, with ``--wan``'s exchange between data centres."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from conveyor.config import TrainConfig, mode_settings
from conveyor.gaia import outer_sync
from conveyor.job._config import autocast_dtype, wan_sites
from conveyor.job._layout import Layout
from conveyor.job._model import materializer
from conveyor.runtime import OptimizerFactory, OuterSync, Pipeline
from conveyor.stragglers import FlexiblePipeline, flexible_layout

__all__ = ["chunks_of", "trainer"]


def chunks_of(pipe: Pipeline | FlexiblePipeline) -> dict[str, Any] | None:
    """A flexible pipeline's chunks per replica, and with ``--chunks auto`` the step seconds it chose from at each
    count (``None``: no ``--stragglers``); where auto chose, worker 0 says so."""
    if not isinstance(pipe, FlexiblePipeline):
        return None
    if pipe.chunk_times and dist.get_rank() == 0:
        timed = ", ".join(f"{c}: {1e3 * t:.1f} ms" for c, t in pipe.chunk_times.items())
        Console().print(f"--chunks auto chose {pipe.chunks} per replica (a replica's step at each count: {timed})")
    return {"per_replica": pipe.chunks, "step_s": {str(c): t for c, t in pipe.chunk_times.items()} or None}


def trainer(
    cfg: TrainConfig,
    model: nn.Sequential,
    *,
    layout: Layout,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    make_optimizer: OptimizerFactory,
    device: torch.device,
) -> Pipeline | FlexiblePipeline:
    """A pipeline for ``layout``; with ``--stragglers`` on and the first stage replicated (data parallelism
    is one stage), a flexible one whose replicas share each batch's chunks."""
    stragglers = cfg.stragglers
    if stragglers is not None and flexible_layout(layout.replicas):
        settings = mode_settings(stragglers.mode, stragglers.slack)
        return FlexiblePipeline(
            model,
            loss_fn=loss_fn,
            optimizer=make_optimizer,
            balance=layout.balance,
            replicas=layout.replicas,
            chunks=stragglers.chunks,
            slack=settings.slack,
            reassign=settings.reassign,
            backup=settings.backup,
            live=settings.live,
            weighted=not stragglers.equal_shares,
            predict=cfg.optimizer.stale_correction,
            device=device,
            autocast=autocast_dtype(cfg),
        )
    if stragglers is not None and dist.get_rank() == 0:
        layout_text = "-".join(map(str, layout.replicas))
        Console().print(
            f"--stragglers {stragglers.mode} applies to layouts whose first stage alone is replicated; "
            f"this one is {layout_text}: it runs as planned, synchronously"
        )
    return Pipeline(
        model,
        layout.balance,
        microbatches=layout.microbatches,
        loss_fn=loss_fn,
        optimizer=make_optimizer,
        schedule=layout.schedule,
        replicas=layout.replicas,
        device=device,
        autocast=autocast_dtype(cfg),
        recompute=layout.recompute,
        correct_staleness=cfg.optimizer.stale_correction,
        damp_stale_rate=layout.stale_rate == "damped",
        materialize=materializer(cfg, model),
        outer=_outer_sync(cfg),
    )


def _outer_sync(cfg: TrainConfig) -> OuterSync | None:
    """``--wan``'s exchange between the data centres, the outer level of ``--network``."""
    if cfg.wan.mode == "off" or cfg.emulation.network is None:
        return None
    wan = cfg.wan
    return outer_sync(
        wan.mode,
        sites=wan_sites(cfg),
        threshold=wan.threshold,
        staleness=wan.staleness,
        period=wan.period,
        estimate=wan.estimate == "on",  # auto is decided before anything is built (job._estimate)
        local_steps=wan.local_steps,
        outer_lr=wan.outer_lr,
    )
