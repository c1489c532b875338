"""The figures a job plans with, measured once and kept: the same command plans from the same figures, and so
picks the same layout with the same prediction, run after run.

Measured afresh at every start, the figures varied 2x between runs on a loaded machine (an all-reduce step 180
to 1,092 us) and the planner, deterministic given them, chose another layout each time. A job's figures
(:class:`~conveyor.job._costs.Costs`) are kept in ``cache_dir()/costs/KEY.json``, where KEY hashes what they
depend on: the machine (its processor, cores and GPU), the software (Conveyor, PyTorch and Python versions),
the model (its modules and parameters' shapes), a batch's shapes, the microbatches, the workers and how they
share the machine, and the emulated network and devices. ``--remeasure`` measures again and keeps the new
figures (after the machine's load changed for good, say). A run that planned from kept figures and measured its
steady rate further from their prediction than the larger of 15% and their spread removes them, so the next run
measures afresh: figures measured in a slow hour (on this project's VM, an MLP's kept figures predicted 80,097
samples/s where runs a day later measured 131,582-138,320) are not planned from forever. The workers' intra-op
threads are chosen afresh every run either way: they follow the machine's load now.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import conveyor
from conveyor.config import TrainConfig
from conveyor.job._costs import Costs
from conveyor.job._measure import choose_threads, measure_costs
from conveyor.paths import cache_dir
from conveyor.runtime import CoreShare, to_device

__all__ = ["correct_layout", "costs_key", "forget_costs", "kept_or_measured", "load_costs", "save_costs"]

# What the kept figures mean, in the key beside the versions: raised when a figure's measurement changes between
# releases, so that figures kept by an earlier build are measured again (2: a batch alone through the plain loop
# that one worker now trains in, not through the executor; 3: the update as the executor makes it; 4: one worker
# timed warm over the job's own feed, whole epochs; 5: layout ratios measured against a simulator whose servers'
# workers share their link to the level above).
FIGURES = 5


def _processor() -> str:
    """The processor's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _shapes(value: Any) -> Any:
    """A batch's structure with each tensor replaced by its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    if isinstance(value, dict):
        return {str(k): _shapes(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_shapes(v) for v in value]
    return repr(value)


def costs_key(model: nn.Module, batch: tuple[Any, torch.Tensor], *, device: torch.device, job: dict[str, Any]) -> str:
    """The key a job's figures are kept under: a hash of the machine, the software, ``model``'s modules and
    parameters, ``batch``'s shapes, the ``device``'s kind and the ``job``'s own facts (JSON-able: its workers,
    microbatches, network, ...)."""
    facts = {
        "machine": {
            "processor": _processor(),
            "cpus": os.cpu_count(),
            "cores": len(os.sched_getaffinity(0)),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "software": [conveyor.__version__, FIGURES, torch.__version__, sys.version.split()[0]],
        "model": [repr(model), [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]],
        "batch": _shapes(batch),
        "device": device.type,
        "job": job,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _path(key: str) -> Path:
    return cache_dir() / "costs" / f"{key}.json"


def load_costs(key: str) -> Costs | None:
    """The figures kept under ``key``, or ``None`` where there are none (or none readable: they are measured
    again and replace the file)."""
    path = _path(key)
    try:
        text = path.read_text()
        measured = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
        source = f"kept from a run on {measured} ({path}; --remeasure to measure again)"
        return Costs.from_json(text, source=source, kept_at=str(path), key=key)
    except (OSError, ValueError):
        return None


def save_costs(key: str, costs: Costs) -> None:
    """Keep ``costs`` under ``key`` (written whole, then renamed: a run reading it at once sees the old file or
    the new, never part of one)."""
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(costs.to_json())
    partial.replace(path)


def forget_costs(path: str) -> None:
    """Remove figures kept at ``path`` (a run measured far from their prediction:
    ``RunSummary.kept_figures_missed``), so the next run of the job measures afresh."""
    Path(path).unlink(missing_ok=True)


def correct_layout(key: str, layout: str, ratio: float) -> None:
    """Keep, with the figures kept under ``key`` (if still there), that a run of ``layout``
    (:func:`~conveyor.plan.layout_key`) planned with them measured ``ratio`` times its simulated rate
    (``RunSummary.layout_missed``): the next plan from them predicts it so."""
    kept = load_costs(key)
    if kept is not None:
        measured = _path(key).stat()  # the file's time is when the figures were measured: kept so
        save_costs(key, replace(kept, layout_ratios={**kept.layout_ratios, layout: ratio}))
        os.utime(_path(key), (measured.st_atime, measured.st_mtime))


def kept_or_measured(
    cfg: TrainConfig,
    model: nn.Sequential,
    batches: list[tuple[Any, torch.Tensor]],
    *,
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[..., torch.optim.Optimizer],
    device: torch.device,
    share: CoreShare | None,
    **measure: Any,
) -> Costs | None:
    """The figures of ``cfg``'s job (every worker calls it; the first worker's :class:`Costs`, ``None``
    elsewhere): those kept for it (:func:`costs_key` of the model, the first batch and the job's facts), unless
    ``--remeasure``, else :func:`~conveyor.job._measure.measure_costs` with ``measure``'s arguments, then kept.
    With kept figures each worker still chooses its threads (``share``) with a training step, as a measurement
    does."""
    kept: Costs | None = None
    box: list[Any] = [False, ""]  # whether the first worker has kept figures, and their key
    if dist.get_rank() == 0:
        job = {
            "workers": dist.get_world_size(),
            "local_workers": int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
            "microbatches": microbatches,
            "emulation": [cfg.emulation.network, cfg.emulation.devices],
            "autocast": cfg.run.autocast,
            "materialize": cfg.model.materialize,
            "optimizer": cfg.optimizer.name,  # its step is timed
            "dataset": cfg.model.dataset,  # and the loss with it
            # One worker is timed over whole epochs of the job's feed (or over the sample, with loader processes).
            "loader_workers": cfg.run.loader_workers,
            "max_train_samples": cfg.model.max_train_samples,
        }
        box[1] = costs_key(model, batches[0], device=device, job=job)
        kept = None if cfg.layout.remeasure else load_costs(box[1])
        box[0] = kept is not None
    dist.broadcast_object_list(box, src=0)  # the flag, not the figures: only the first worker plans
    is_kept, key = box
    if not is_kept:
        costs = measure_costs(
            model,
            batches,
            microbatches=microbatches,
            loss_fn=loss_fn,
            optimizer=optimizer,
            device=device,
            share=share,
            **measure,
        )
        if costs is not None:
            costs = replace(costs, key=key)
            save_costs(key, costs)
        return costs
    if share is not None and measure.get("materialize") is None and measure.get("device_cores") is None:
        x, y = batches[0]
        step = (to_device(x, device), y.to(device))
        choose_threads(share, model, step, microbatches=microbatches, loss_fn=loss_fn, optimizer=optimizer)
    return kept
