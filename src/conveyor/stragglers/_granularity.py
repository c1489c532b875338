"""``--chunks auto``: the chunk count that weighs the chunks' fixed costs against the work a stalled replica
holds, timed on the first batch.

A chunk's forward and backward cost a fixed part (operator launches, Python, autograd's set-up) and a part per
sample, ``t(m) ~ a + b m``. Cutting a replica's ``n`` samples into ``c`` chunks costs a step

    T(c) = c t(n / c) ~ c a + b n

so every chunk more adds ``a``. But a replica that stalls holds the chunk it runs, which no peer can take
(reassignment moves only unstarted chunks; a backup starts over): the step cannot end before that chunk,
``T(c) / c``, has run again or finished. Auto takes the count that minimises the sum of the two,

    J(c) = T(c) + T(c) / c  ~  a c + b n / c + (a + b n),    best near  c = sqrt(b n / a)

over ``c`` in :data:`CANDIDATES` (the smaller on a tie), with ``T(c)`` timed on the first batch: one
replica's share of it, forward and backward through the first stage, the least of 5 runs each with the counts
run in turn (a busy machine only adds time). A model whose chunks are mostly fixed cost keeps one chunk; one
whose samples cost much gets finer chunks.

Worker 0 times and every worker takes its choice (a broadcast), since every stage cuts the batch alike. The
timing leaves the stage as it found it: gradients, buffers (BatchNorm's running statistics) and the random
state are put back; the timing runs once per job, in its first step (six rounds of every count), and counts in
that step's time. The claims' store round trips (0.4 to 1.4 ms a step for 1 to 8 chunks, in an ad-hoc timing
of ``StepClaims`` with two replicas on a CPU) are not in ``T``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.runtime import batch_size, split_batch, to_device

__all__ = ["CANDIDATES", "agree_on_chunks", "choose_chunks", "time_chunks"]

Batches = Iterable[tuple[Any, Any]]
Mixed = Callable[[], contextlib.AbstractContextManager[Any]]  # the trainer's autocast, or nothing

CANDIDATES = (1, 2, 4, 8)  # chunks per replica that auto tries


def agree_on_chunks(
    module: nn.Module, batches: Batches | None, *, first: bool, replicas: int, device: torch.device, mixed: Mixed
) -> tuple[Batches | None, int, dict[int, float]]:
    """Every worker's chunk count, chosen on the ``first`` worker (the first stage's first replica) from one
    replica's share of its first batch (a collective: every worker calls it). Returns ``batches`` whole (the
    first put back), the count, and the times it was chosen from (``{}`` without a batch: one chunk)."""
    choice: list[Any] = [(1, {}, None)]  # (count, times, the timing's error)
    if first and batches is not None:
        iterator = iter(batches)
        head = next(iterator, None)
        batches = iterator
        if head is not None:
            batches = itertools.chain([head], iterator)
            try:
                share = split_batch(to_device(head[0], device), replicas)[0]
                times = time_chunks(module, share, device=device, mixed=mixed)
                choice = [(choose_chunks(times), times, None)]
            except Exception as exc:  # the peers wait in the broadcast: they must hear of it, not time out
                choice = [(1, {}, f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(choice, src=0)
    count, times, error = choice[0]
    if error is not None:
        raise RuntimeError(f"--chunks auto: timing the first batch's chunks failed on worker 0: {error}")
    return batches, int(count), dict(times)


def choose_chunks(step_s: dict[int, float]) -> int:
    """The chunk count ``c`` with the least ``J(c) = T(c) + T(c) / c`` (a step's compute and the one chunk a
    stalled replica holds), from a step's seconds ``T(c)`` at each count.

    Example (a fixed 7.4 ms and 0.43 ms a sample, the benchmark's resnet on one CPU thread: at 16 samples a
    replica, then 64; then almost no fixed cost):
        >>> choose_chunks({c: c * 7.4 + 0.43 * 16 for c in (1, 2, 4, 8)})
        1
        >>> choose_chunks({c: c * 7.4 + 0.43 * 64 for c in (1, 2, 4, 8)})
        2
        >>> choose_chunks({c: c * 0.05 + 0.43 * 16 for c in (1, 2, 4, 8)})
        8
    """
    return min(step_s, key=lambda c: (step_s[c] + step_s[c] / c, c))


def time_chunks(
    module: nn.Module,
    share: Any,
    *,
    device: torch.device,
    mixed: Mixed,
    counts: Sequence[int] = CANDIDATES,
    repeats: int = 5,
) -> dict[int, float]:
    """Seconds of ``share``'s forward and backward through ``module`` cut into each of ``counts`` chunks: the
    least of ``repeats`` after a warm-up round, the counts timed in turn; counts that would leave a chunk under
    two samples are left out. The module's gradients, buffers and the random state are as they were afterwards."""
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [p.grad for p in params]  # kept aside: the timed backwards accumulate into fresh ones
    for p in params:
        p.grad = None
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # dropout's draws put back
            # Two samples a chunk at least: BatchNorm refuses one in training.
            cuts = {c: split_batch(share, c) for c in counts if c == 1 or 2 * c <= batch_size(share)}
            runs: dict[int, list[float]] = {c: [] for c in cuts}
            for _ in range(repeats + 1):  # the counts in turn, so a busy spell of the machine falls on all of them
                for count, parts in cuts.items():
                    runs[count].append(_timed(module, parts, device, mixed))
        return {c: min(seconds[1:]) for c, seconds in runs.items()}  # interference only adds time
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def _timed(module: nn.Module, parts: list[Any], device: torch.device, mixed: Mixed) -> float:
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
