"""What ``REDUCE`` and ``STEP`` do to a stage's gradients and weights.

The last stage starts each microbatch's backward from its loss times its sample count, so after the
backwards of an update a worker holds the sum over its samples of the per-sample gradients. ``REDUCE``
turns that into the update's gradient, the mean over every sample the update covers on every replica
of the stage:

    g = (sum over replicas r, microbatches k of r: n_k grad l_k) / (sum over replicas r, microbatches k of r: n_k)

where ``l_k`` is the loss of microbatch ``k`` averaged over its ``n_k`` samples. The sums over replicas
are all-reduces (the sample count rides along with the last), so replicas may have run different numbers
of microbatches, or none. For ``gpipe`` and ``flush`` this equals gradient accumulation over the batch,
however its samples were split.

Where an update covers a whole batch on every stage (``gpipe``, ``flush``, ``2bw``: ``averaged``), the
last stage knows the update's sample count ``N`` before the backwards (its every replica reads the batch's
targets), so it starts each backward from ``l_k n_k / N`` instead (from ``l_k`` itself for a batch of one
microbatch): the backwards and the all-reduce then sum to ``g`` directly, and nothing is divided, which on
a small model's CPU step saves a pass over every gradient.

**Overlap with the backward**, as ``DistributedDataParallel`` does: the parameters are cut into buckets of
about ``bucket_bytes`` in reverse order (the last layers' gradients are ready first; the first bucket, as
DDP's, of about 1 MB, so that the all-reduce starts early), and during the last
backward before a ``REDUCE`` (the executor :meth:`~Updater.arm` s it) a bucket's all-reduce starts as soon
as the gradients of all its parameters are final, while the backward goes on through the earlier layers.
Buckets start in the same order on every replica (a bucket waits for the ones before it); ``REDUCE``
starts those still waiting (all of them on a replica without a backward in the update, or on a stage that
keeps its gradients on stashed weight versions) and waits for all.

The sample count rides along with the last bucket, except on CUDA, where it is summed on a gloo group of the
same replicas (``count_group``) in host memory: the worker needs the count on the host (an update without a
sample must not step), and reading it off the GPU would make the worker wait for its GPU at every update.

With an :class:`~conveyor.runtime._outer.OuterSync` (replicas in several sites joined by a WAN), the replicas
all-reduce within their site only, and the outer sync replaces the site's gradient (its share of ``g``, or its
mean for ``site_mean``) with what the site steps with, then may replace the weights after the step.

``STEP`` then clips ``g`` (to a norm over the whole model for synchronous schedules, whose stages step
together; over the stage for asynchronous ones) and steps the optimizer. An update without a sample on
any replica leaves the weights as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.runtime._outer import OuterSync

__all__ = ["OptimizerFactory", "Updater", "count_groups", "pack_grads", "reduce_dtype", "set_mean_grads"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]  # builds a stage's optimizer


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket: small, so that the all-reduce starts early in the backward


class Updater:
    """Reduces and applies a stage's gradients.

    Args:
        module: the stage; its parameters' ``.grad`` hold the gradient sums.
        optimizer: the stage's optimizer (``None`` when the stage has no parameters).
        group: the process group of the stage's replicas (``None`` when it has one).
        max_grad_norm: clip to this norm, or ``None``.
        clip_whole_model: clip to the whole model's norm (every worker steps at once) instead of the stage's.
        replicas: the stage's replica count (to count each stage once in the whole model's norm).
        device: where the stage runs (the norm is reduced there, as NCCL needs).
        bucket_bytes: the size of the gradient buckets all-reduced as the backward goes.
        count_group: a gloo group of the same replicas, to sum the sample count in host memory (``None``: it
            rides in the last bucket).
        averaged: the backwards already sum to the update's mean gradient (see the module docstring): only sum
            over the replicas.
        outer: what the stage's sites exchange over the WAN (``group`` is then the site's replicas alone).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        group: dist.ProcessGroup | None,
        max_grad_norm: float | None,
        clip_whole_model: bool,
        replicas: int,
        device: torch.device,
        bucket_bytes: int = BUCKET_BYTES,
        count_group: dist.ProcessGroup | None = None,
        averaged: bool = False,
        outer: OuterSync | None = None,
    ) -> None:
        self.module, self.optimizer, self.group, self.device = module, optimizer, group, device
        self.outer = outer
        self.count_group, self.averaged = count_group, averaged
        self.max_grad_norm, self.clip_whole_model, self.replicas = max_grad_norm, clip_whole_model, replicas
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.samples = 0  # of the update being reduced; 0 after a reduce that found none
        self.dtype = reduce_dtype(self.params)
        first = min(bucket_bytes, FIRST_BUCKET_BYTES)
        self.buckets = _buckets(self.params, bucket_bytes, first) if group is not None else []
        self._bucket_of = {id(self.params[i]): b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._armed: int | None = None  # the samples of the update whose last backward is running
        self._ready = [0] * len(self.buckets)
        self._started: list[tuple[torch.Tensor, dist.Work]] = []
        self.started_in_backward = 0  # buckets whose all-reduce a backward started, since construction
        if group is not None:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def overlaps(self) -> bool:
        """Whether gradients are all-reduced (so that a backward can start it)."""
        return self.group is not None

    def arm(self, samples: int) -> None:
        """The next backward is the last of the update, which covers ``samples`` samples on this replica:
        start each bucket's all-reduce as soon as its gradients are final."""
        self._armed = samples

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._armed is None:
            return
        self._ready[self._bucket_of[id(param)]] += 1
        while len(self._started) < len(self.buckets) and self._ready[len(self._started)] == len(
            self.buckets[len(self._started)]
        ):
            self._start(self._armed)
            self.started_in_backward += 1

    def _start(self, samples: int) -> None:
        """Start the next bucket's all-reduce (the last bucket carries the sample count, without a count group)."""
        b = len(self._started)
        extra = [float(samples)] if b == len(self.buckets) - 1 and self.count_group is None else []
        flat = pack_grads([self.params[i] for i in self.buckets[b]], self.dtype, self.device, extra)
        self._started.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def reduce(self, samples: int) -> None:
        """Sum the gradients and the sample count over the replicas and divide: the update's mean gradient; then
        the outer sync's exchange between sites, if any."""
        self._reduce_replicas(samples)
        if self.outer is not None and self.outer.after_reduce(self.params, self.optimizer) and not self.samples:
            self.samples = 1  # the site had no sample but others' updates arrived: it steps with them

    def _reduce_replicas(self, samples: int) -> None:
        if self.group is None:
            self.samples = samples
            grads = [] if self.averaged or not samples else [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, float(samples))  # one call for all of them, not one per parameter
            return
        assert self._armed in (None, samples), f"armed for {self._armed} samples, reducing {samples}"
        while len(self._started) < len(self.buckets):
            self._start(samples)
        count = None
        if self.count_group is not None:
            count = torch.tensor([float(samples)], dtype=torch.float64)
            dist.all_reduce(count, group=self.count_group)
        for _, work in self._started:
            work.wait()
        self.samples = int((self._started[-1][0][-1] if count is None else count[0]).item())
        for (flat, _), bucket in zip(self._started, self.buckets, strict=True):
            if self.samples:
                set_mean_grads([self.params[i] for i in bucket], flat, 1 if self.averaged else self.samples)
        self._armed, self._ready, self._started = None, [0] * len(self.buckets), []

    def step(self) -> None:
        """Clip, step and clear the gradients (only clear them when the update had no sample). Without an
        optimizer the update's mean gradient stays on ``.grad`` for the caller to read."""
        if self.samples and self.max_grad_norm is not None:
            self._clip()
        if self.optimizer is not None:
            if self.samples:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.outer is not None:
            self.outer.after_step(self.params)

    def _clip(self) -> None:
        assert self.max_grad_norm is not None
        if not self.clip_whole_model:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            return
        # Every worker steps at once: agree on the whole model's norm; replicas hold equal gradients after
        # the reduce, so each stage counts once.
        grads = [p.grad for p in self.params if p.grad is not None]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sq = sum((g.double().pow(2).sum() for g in grads), zero)
        sq = sq / self.replicas
        dist.all_reduce(sq)
        coef = torch.clamp(self.max_grad_norm / (sq.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))


def count_groups(groups: list[Any], stage_workers: list[list[int]], device: torch.device) -> list[Any]:
    """Where each replicated stage's replicas sum their sample counts: on CUDA, in host memory over gloo
    (:class:`Updater`'s ``count_group``), the replica ``groups`` themselves when they are gloo's, else a gloo group
    per stage of ``stage_workers`` (every worker makes every one, in the same order); ``None`` off CUDA."""
    if device.type != "cuda":
        return [None] * len(groups)
    if dist.get_backend() == "gloo":
        return groups
    return [dist.new_group(ws, backend="gloo") if len(ws) > 1 else None for ws in stage_workers]


def reduce_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype gradients are summed in: float64 if any parameter is, else float32."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def pack_grads(
    params: Sequence[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    extra: Sequence[float | torch.Tensor] = (),
) -> torch.Tensor:
    """One flat tensor of the parameters' gradients (zeros where a parameter has none), then ``extra``
    (counts, or 0-d tensors on ``device``, that ride along in the same all-reduce)."""
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in params]
    tail = torch.empty(len(extra), dtype=dtype, device=device)
    for i, value in enumerate(extra):
        tail[i] = value  # a fill, or a copy on the device: a copy from host memory would wait for the GPU
    return torch.cat([*parts, tail])


def set_mean_grads(params: Sequence[torch.Tensor], flat: torch.Tensor, samples: float) -> None:
    """Set each parameter's gradient to its part of ``flat`` (as :func:`pack_grads` laid it out) over ``samples``.

    Example:
        >>> w = torch.zeros(2, requires_grad=True)
        >>> w.grad = torch.tensor([2.0, 4.0])
        >>> flat = pack_grads([w], torch.float32, torch.device("cpu"), [2.0])
        >>> set_mean_grads([w], flat, flat[-1].item()); w.grad
        tensor([1., 2.])
    """
    grads = flat[: sum(p.numel() for p in params)]
    if samples != 1:
        grads = grads / samples
    for p, g in zip(params, grads.split([p.numel() for p in params]), strict=True):
        p.grad = g.view_as(p).to(p.dtype)


def _buckets(
    params: Sequence[torch.Tensor], bucket_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Parameter indices in buckets of about ``bucket_bytes`` (the first of about ``first_bytes``), last
    parameters first (as a backward makes their gradients); a parameter larger than a bucket has one of its own.

    Example:
        >>> _buckets([torch.zeros(4), torch.zeros(4), torch.zeros(8)], bucket_bytes=32, first_bytes=16)
        [[2], [1, 0]]
    """
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if buckets[-1] and size + nbytes > (first_bytes if len(buckets) == 1 else bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets  # no parameters: one empty bucket, for the sample count
