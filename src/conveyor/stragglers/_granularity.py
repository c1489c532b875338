"""``--chunks auto``: the finest chunks whose fixed costs stay small, timed on the first batch.

A chunk's forward and backward cost a fixed part (operator launches, Python, autograd's set-up) and a part per
sample, ``t(m) ~ a + b m``. Cutting a replica's ``n`` samples into ``c`` chunks costs

    T(c) = c t(n / c) ~ c a + b n

so every chunk more adds ``a``, while finer chunks let reassignment and backups move smaller pieces of a slow
replica's work. Auto times ``T(c)`` for ``c`` in :data:`CANDIDATES` on the first batch (one replica's share of
it, forward and backward through the first stage) and keeps the largest ``c`` with

    T(c) <= (1 + OVERHEAD) T(1)

Worker 0 times and every worker takes its choice (a broadcast), since every stage cuts the batch alike. The
timing leaves the stage as it found it: gradients, buffers (BatchNorm's running statistics) and the random
state are put back. The claims' store round trips, a few hundred microseconds a step, are not in ``T``.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.runtime import batch_size, split_batch, to_device

__all__ = ["CANDIDATES", "OVERHEAD", "agree_on_chunks", "choose_chunks", "time_chunks"]

Batches = Iterable[tuple[Any, Any]]
Mixed = Callable[[], contextlib.AbstractContextManager[Any]]  # the trainer's autocast, or nothing

CANDIDATES = (1, 2, 4, 8)  # chunks per replica that auto tries
OVERHEAD = 0.10  # how much more compute than one chunk per replica a finer cut may cost


def agree_on_chunks(
    module: nn.Module, batches: Batches | None, *, first: bool, replicas: int, device: torch.device, mixed: Mixed
) -> tuple[Batches | None, int, dict[int, float]]:
    """Every worker's chunk count, chosen on the ``first`` worker (the first stage's first replica) from one
    replica's share of its first batch (a collective: every worker calls it). Returns ``batches`` whole (the
    first put back), the count, and the times it was chosen from (``{}`` without a batch: one chunk)."""
    choice: list[Any] = [(1, {})]
    if first and batches is not None:
        iterator = iter(batches)
        head = next(iterator, None)
        batches = iterator
        if head is not None:
            share = split_batch(to_device(head[0], device), replicas)[0]
            times = time_chunks(module, share, device=device, mixed=mixed)
            choice = [(choose_chunks(times), times)]
            batches = itertools.chain([head], iterator)
    dist.broadcast_object_list(choice, src=0)
    return batches, *choice[0]


def choose_chunks(step_s: dict[int, float], overhead: float = OVERHEAD) -> int:
    """The largest chunk count whose step costs at most ``1 + overhead`` times one chunk's.

    Example (a fixed 7.4 ms and 0.43 ms a sample, 16 samples a replica; then a model ten times heavier a sample):
        >>> choose_chunks({c: c * 7.4 + 0.43 * 16 for c in (1, 2, 4, 8)})
        1
        >>> choose_chunks({c: c * 7.4 + 4.3 * 16 for c in (1, 2, 4, 8)})
        2
    """
    base = step_s[1]
    return max(c for c, seconds in step_s.items() if seconds <= (1 + overhead) * base)


def time_chunks(
    module: nn.Module,
    share: Any,
    *,
    device: torch.device,
    mixed: Mixed,
    counts: Sequence[int] = CANDIDATES,
    repeats: int = 5,
) -> dict[int, float]:
    """Seconds of ``share``'s forward and backward through ``module`` cut into each of ``counts`` chunks (the
    median of ``repeats`` after one warm-up); counts that would leave a chunk under two samples are left out.
    The module's gradients, buffers and the random state are as they were afterwards."""
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [p.grad for p in params]  # kept aside: the timed backwards accumulate into fresh ones
    for p in params:
        p.grad = None
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    try:
        times = {}
        # Two samples a chunk at least: BatchNorm refuses one in training.
        for count in (c for c in counts if c == 1 or 2 * c <= batch_size(share)):
            parts = split_batch(share, count)
            runs = [_timed(module, parts, device, mixed) for _ in range(repeats + 1)]
            times[count] = statistics.median(runs[1:])
        return times
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _timed(
    module: nn.Module,
    parts: list[Any],
    device: torch.device,
    mixed: Callable[[], contextlib.AbstractContextManager[Any]],
) -> float:
    """One step's chunks through ``module``, forward and backward of the sum of its floating outputs (the
    gradient's values do not change its cost)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for part in parts:
        with mixed():
            out = module(part)
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.stack([t.float().sum() for t in leaves]).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
