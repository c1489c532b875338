"""How a training job measures its :class:`~conveyor.job._costs.Costs` before it plans, and the intra-op threads
each worker trains with.

Every worker measures at once, so each measurement sees the cores as busy as they will be in the run: four workers
on two cores each get half a core, and sharing costs more than the share (caches, context switches).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.job._costs import Costs
from conveyor.job._timing import batch_times, fed_batch_s
from conveyor.plan import Profile, Topology
from conveyor.runtime import (
    CoreShare,
    Materialize,
    MeasuredLink,
    batch_size,
    measure_allreduce,
    measure_link,
    measure_overhead,
    measure_updates,
    profile,
    split_batch,
    to_device,
)
from conveyor.runtime.parts import P2P, Alone

__all__ = ["choose_threads", "measure_costs"]


def measure_costs(
    model: nn.Sequential,
    batches: list[tuple[Any, torch.Tensor]],
    *,
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    name: str,
    network: Topology | None = None,
    device_cores: float | None = None,
    device: torch.device,
    autocast: torch.dtype | None = None,
    share: CoreShare | None = None,
    materialize: Materialize | None = None,
    feed: Callable[[], Iterable[tuple[Any, Any]]] | None = None,
) -> Costs | None:
    """Measure (every worker calls it); the first worker's :class:`Costs`, ``None`` elsewhere. ``batches`` are
    whole training batches, at least two (the first is a warm-up). ``network`` is the emulated network the job
    runs on; ``device_cores``: each worker has a device of its own, an emulated one of this many cores (a CPU
    quota). Such a device is a whole core for 25 ms at a time, stopped in between, so a short operation
    measured alone runs at full speed (it almost never spans a stop) and takes ``1/c`` as long on average on
    a device of ``c`` cores; measured beside the other workers, the machine's own cores would be shared too,
    which a quota that fits the machine never lets happen on average. The profile, the per-action cost and
    the link are then measured by the first worker(s) alone, and put per device; the all-reduce is timed
    without compute before it (the replicas' skew, which a stop makes long, is the simulator's to model).
    ``device`` is the worker's, ``autocast`` the dtype the pipeline's forwards run in (or ``None``), and
    ``share`` the worker's share of the CPU (:class:`~conveyor.runtime.CoreShare`): it first picks the worker's
    threads with a forward and backward at the microbatch size, and the plain loop runs on as many threads as
    other processes leave cores (default: every core). ``materialize``: the model was built on the meta device
    (``--materialize stage``), and only the profile is measured, one block real at a time; the whole model's
    measures (the executor's overhead, the update and the forward through a weight version
    (:func:`~conveyor.runtime.measure_updates`), the threads, the plain loop) are not taken: none of it fits.
    ``feed``: a new epoch of the job's own batches at each call, as its run reads them (on ``device``): one worker
    alone is timed over them (:func:`~conveyor.job._timing.fed_batch_s`); ``None``: over ``batches``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cores = len(os.sched_getaffinity(0))
    batches = [(to_device(x, device), y.to(device)) for x, y in batches]  # on the device before anything is timed
    alone = device_cores is not None
    # Without emulated devices every worker profiles at once: the times are those of a core as busy as in the
    # run (sharing it costs more than the share: caches, switches), then put per core; the simulator shares the
    # cores again.
    shares = min(1.0, cores / world) if device.type == "cpu" else 1.0
    per_core = 1.0 / device_cores if device_cores is not None else shares
    whole = materialize is None  # the whole model is real and may be run
    if share is not None and not alone and whole:
        choose_threads(share, model, batches[0], microbatches=microbatches, loss_fn=loss_fn, optimizer=optimizer)
    dist.barrier()
    profiled = partial(_profile_and_runtime, model, batches, name=name, microbatches=microbatches, loss_fn=loss_fn)
    prof, overhead, factors, forward = (
        profiled(optimizer=optimizer, device=device, autocast=autocast, materialize=materialize, fastest=alone)
        if rank == 0 or not alone
        else (None, 0.0, (1.0, 1.0), 1.0)
    )
    dist.barrier()
    between = whole and not alone and world > 1  # the work between messages, as in the run
    work = _forward_backward(model, batches[0], microbatches, loss_fn, device) if between else None
    link, allreduce = _network(device, alone=alone, busy=work)
    dist.barrier()
    free = None if share is None else share.free
    plain = partial(_plain_loop, model, batches, loss_fn=loss_fn, optimizer=optimizer, device=device)
    single, spread, alone_s = (
        plain(autocast=autocast, free_cores=free, feed=feed or (lambda: batches))
        if rank == 0 and whole
        else (None, 0.0, None)
    )
    dist.barrier()
    if rank != 0:
        return None
    assert prof is not None
    shared = cores if device.type == "cpu" and not alone else None
    if alone and link is not None:  # sending and receiving are work on the device too
        link = replace(link, send_s=link.send_s * per_core, recv_s=link.recv_s * per_core)
    return Costs(
        _scaled(prof, per_core),
        link,
        allreduce,
        overhead * per_core,
        single,
        world,
        shared,
        network,
        alone_batch_s=alone_s,
        # On an emulated device the plain loop's batches vary by the quota's stops (a batch stopped for most of
        # 25 ms, or not), 1,000-1,300% around their median, which says nothing of the figures put per device.
        spread=0.0 if alone else spread,
        update_factors=factors,
        stashed_forward_factor=forward,
    )


def _network(
    device: torch.device, *, alone: bool, busy: Callable[[], object] | None
) -> tuple[MeasuredLink | None, tuple[float, float] | None]:
    """A message between two workers (the first pair's, kept by the first worker) and an all-reduce among all of
    them (``None`` for a worker alone), every worker running ``busy`` between messages and before each all-reduce,
    as in the run. ``alone``: on emulated devices, the first pair alone measures the message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return None, None
    link = None
    peer = rank ^ 1  # pairs 0-1, 2-3, ...: every worker sends (and computes) while the first pair measures
    p2p = P2P(device)  # on every worker: on CUDA its first one makes a group
    if peer < world and (rank < 2 or not alone):
        link = measure_link(p2p, peer, leader=rank % 2 == 0, busy=busy)
    dist.barrier()
    return link, measure_allreduce(busy=busy)


def _profile_and_runtime(
    model: nn.Sequential,
    batches: list[tuple[Any, torch.Tensor]],
    *,
    name: str,
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    device: torch.device,
    autocast: torch.dtype | None,
    materialize: Materialize | None,
    fastest: bool,
) -> tuple[Profile, float, tuple[float, float], float]:
    """The model's profile at the microbatch size, the executor's own time per action, an update's factors
    (:attr:`Costs.update_factors`) and a forward's through a weight version (:attr:`Costs.stashed_forward_factor`),
    each as this worker measures them (not yet put per core). With ``materialize`` only the profile: the whole
    model is not real. ``fastest``: the overhead from the fastest batch
    (:func:`~conveyor.runtime.measure_overhead`)."""
    whole = materialize is None
    factors, forward = (1.0, 1.0), 1.0  # over the profile's step and forward: none measured
    example = split_batch(batches[0][0], microbatches)[0]
    # A copy: profiling runs the blocks in training mode, which would move BatchNorm's running statistics.
    prof = profile(
        copy.deepcopy(model),
        example,
        name=name,
        device=device,
        repeats=5,
        warmup=2,
        optimizer=optimizer,
        autocast=autocast,
        materialize=materialize,
    )
    if not whole:
        return prof, 0.0, factors, forward
    updates = measure_updates(
        model,
        batches,
        loss_fn=loss_fn,
        optimizer=optimizer,
        microbatches=microbatches,
        device=device,
        autocast=autocast,
    )
    step_s = sum(lay.step_s for lay in prof.layers)
    if step_s > 0:  # over the profile's step as timed: a scaling below scales both
        factors = (updates.update_s / step_s, updates.stashed_update_s / step_s)
    if updates.forward_s > 0:
        forward = updates.stashed_forward_s / updates.forward_s
    # The batch's compute with its update as the executor makes it, so that what the update costs beyond the
    # profile's step is not counted again in the executor's own time per action.
    compute = microbatches * sum(lay.forward_s + lay.backward_s for lay in prof.layers) + step_s * factors[0]
    overhead, batch_s = measure_overhead(
        model,
        batches,
        loss_fn=loss_fn,
        optimizer=optimizer,
        microbatches=microbatches,
        compute_s=compute,
        device=device,
        fastest=fastest,
        autocast=autocast,
    )
    if 0 < batch_s < compute:
        # Timed block by block, the profile counts each block's own fixed costs (its input made a leaf, a backward
        # of its own; on a GPU, a synchronisation and every kernel launch's latency, which a whole batch hides
        # behind the GPU's work): where a whole batch through the executor is faster, scale it to that batch.
        prof = _scaled(prof, batch_s / compute)
    return prof, overhead, factors, forward


def choose_threads(
    share: CoreShare,
    model: nn.Module,
    batch: tuple[Any, torch.Tensor],
    *,
    microbatches: int,
    loss_fn: Callable[[Any, Any], Any],
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
) -> None:
    """This worker's intra-op threads: the faster count for a microbatch's training step on a copy of ``model``
    (:meth:`~conveyor.runtime.CoreShare.choose`), ``batch`` on the worker's device."""
    device = batch[1].device
    share.choose(
        _training_step(model, batch, microbatches=microbatches, loss_fn=loss_fn, optimizer=optimizer, device=device)
    )


def _copy_and_microbatch(
    model: nn.Module, batch: tuple[Any, torch.Tensor], microbatches: int, device: torch.device
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A copy of the model on ``device``, and a microbatch of ``batch`` there."""
    x, y = (split_batch(part, microbatches)[0] for part in batch)
    return copy.deepcopy(model).to(device), to_device(x, device), y.to(device)


def _forward_backward(
    model: nn.Module,
    batch: tuple[Any, torch.Tensor],
    microbatches: int,
    loss_fn: Callable[[Any, Any], Any],
    device: torch.device,
) -> Callable[[], object]:
    """A microbatch's forward and backward on a copy of the model: the work between two all-reduces."""
    module, x, y = _copy_and_microbatch(model, batch, microbatches, device)
    return lambda: loss_fn(module(x), y).backward()


def _training_step(
    model: nn.Module,
    batch: tuple[Any, torch.Tensor],
    *,
    microbatches: int,
    loss_fn: Callable[[Any, Any], Any],
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    device: torch.device,
) -> Callable[[], object]:
    """A microbatch's forward, backward and optimizer step on a copy of the model."""
    module, x, y = _copy_and_microbatch(model, batch, microbatches, device)
    opt = optimizer(list(module.parameters()))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(module(x), y).backward()
        opt.step()

    return step


def _scaled(prof: Profile, factor: float) -> Profile:
    """``prof`` with every time multiplied by ``factor``."""
    layers = tuple(
        replace(lay, forward_s=lay.forward_s * factor, backward_s=lay.backward_s * factor, step_s=lay.step_s * factor)
        for lay in prof.layers
    )
    return replace(prof, layers=layers)


def _plain_loop(
    model: nn.Module,
    batches: list[tuple[Any, torch.Tensor]],
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    device: torch.device,
    autocast: torch.dtype | None,
    free_cores: float | None,
    feed: Callable[[], Iterable[tuple[Any, Any]]],
) -> tuple[float, float, float]:
    """Samples per second of forward, backward and step on whole batches, with the free cores (the other workers
    wait), timed as :func:`~conveyor.job._timing.batch_times` does; the batches' spread (their times' interquartile
    range over the median); and a batch's mean seconds as one worker alone trains ``feed``'s epochs
    (:class:`~conveyor.runtime.parts.Alone`, :func:`~conveyor.job._timing.fed_batch_s`) at the same threads."""
    module = copy.deepcopy(model).to(device)
    opt = optimizer(list(module.parameters()))
    alone = Alone.of_copy(model, loss_fn=loss_fn, optimizer=optimizer, device=device, autocast=autocast)
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores if free_cores is None else max(1, min(cores, math.floor(free_cores + 0.2))))
    mixed = torch.autocast(device.type, autocast) if autocast is not None else contextlib.nullcontext()

    def plain_step(x: Any, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with mixed:
            loss = loss_fn(module(x), y)
        loss.backward()
        opt.step()

    try:
        timed = batch_times(plain_step, batches, device)
        alone_s = fed_batch_s(alone, feed, device)
    finally:
        torch.set_num_threads(threads)
    median = statistics.median(timed)
    quartiles = statistics.quantiles(timed, n=4) if len(timed) > 1 else [median] * 3
    return batch_size(batches[0][0]) / median, (quartiles[2] - quartiles[0]) / median, alone_s
