"""What ``REDUCE`` and ``STEP`` do to a stage's gradients and weights.

The last stage starts each microbatch's backward from its loss times its sample count, so after the
backwards of an update a worker holds the sum over its samples of the per-sample gradients. ``REDUCE``
turns that into the update's gradient, the mean over every sample the update covers on every replica
of the stage:

    g = (sum over replicas r, microbatches k of r: n_k grad l_k) / (sum over replicas r, microbatches k of r: n_k)

where ``l_k`` is the loss of microbatch ``k`` averaged over its ``n_k`` samples. The sums over replicas
are one all-reduce (the sample count rides along), so replicas may have run different numbers of
microbatches, or none. For ``gpipe`` and ``flush`` this equals gradient accumulation over the batch,
however its samples were split. ``STEP`` then clips ``g`` (to a norm over the whole model for synchronous
schedules, whose stages step together; over the stage for asynchronous ones) and steps the optimizer.
An update without a sample on any replica leaves the weights as they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Updater"]


class Updater:
    """Reduces and applies a stage's gradients.

    Args:
        module: the stage; its parameters' ``.grad`` hold the gradient sums.
        optimizer: the stage's optimizer (``None`` when the stage has no parameters).
        group: the process group of the stage's replicas (``None`` when it has one).
        max_grad_norm: clip to this norm, or ``None``.
        clip_whole_model: clip to the whole model's norm (every worker steps at once) instead of the stage's.
        replicas: the stage's replica count (to count each stage once in the whole model's norm).
        device: where the stage runs (the sample count and norm are reduced there, as NCCL needs).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        group: dist.ProcessGroup | None,
        max_grad_norm: float | None,
        clip_whole_model: bool,
        replicas: int,
        device: torch.device,
    ) -> None:
        self.module, self.optimizer, self.group, self.device = module, optimizer, group, device
        self.max_grad_norm, self.clip_whole_model, self.replicas = max_grad_norm, clip_whole_model, replicas
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.samples = 0  # of the update being reduced; 0 after a reduce that found none

    def reduce(self, samples: int) -> None:
        """Sum the gradients and the sample count over the replicas and divide: the update's mean gradient."""
        if self.group is None:
            self.samples = samples
            for p in self.params:
                if p.grad is not None and samples:
                    p.grad.div_(samples)
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        count = torch.tensor([float(samples)], dtype=dtype, device=self.device)
        flat = torch.cat([*(g.reshape(-1).to(dtype) for g in grads), count])
        dist.all_reduce(flat, group=self.group)
        self.samples = int(flat[-1].item())
        if self.samples:
            flat[:-1].div_(self.samples)
            for p, g in zip(self.params, flat[:-1].split([p.numel() for p in self.params]), strict=True):
                p.grad = g.view_as(p).to(p.dtype)

    def step(self) -> None:
        """Clip, step and clear the gradients (only clear them when the update had no sample). Without an
        optimizer the update's mean gradient stays on ``.grad`` for the caller to read."""
        if self.samples and self.max_grad_norm is not None:
            self._clip()
        if self.optimizer is not None:
            if self.samples:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

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
