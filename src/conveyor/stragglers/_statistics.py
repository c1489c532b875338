"""BatchNorm's running statistics on a flexible pipeline's stage, agreed every step: those one process would
hold after running the batch's chunks in order, whichever replica ran which chunk and in whatever order.

A normalisation layer in training moves its running mean once per chunk it sees, toward the chunk's batch
mean ``mu_c`` (its running variance alike, toward the chunk's unbiased variance). One process running a
batch's ``C`` chunks in order ``c = 0 .. C - 1`` leaves

    r(t + 1) = (1 - m)^C r(t) + S,      S = sum over c of m (1 - m)^(C - 1 - c) mu_c      (momentum m)
    r(t + 1) = (k r(t) + S) / (k + C),  S = sum over c of mu_c                            (momentum None)

where ``k`` counts the chunks the layer has tracked before. Replicas run the chunks in other orders and each
only some (claims, reassignment, backups), so each replica's own statistics would follow other chunks, and a
backup's dropped run would count a chunk twice (a later stage, unreplicated, sees the chunks in the order
they arrive). Here the layers of each replica record, for every chunk
whose run it commits, the chunk's batch statistics (the layer's momentum is 1 for the step, so a forward
leaves them in the buffers, which are put back after each chunk), weighted by the chunk's place ``c``. The
all-reduce that sums the replicas' gradients sums these partial ``S`` too, and every replica applies the rule
above with the same numbers (``C``, the batch's non-empty chunks, each counted once, is known to all): all
hold the same statistics, those of one process.
With slack ``s`` they are applied with the step's gradient, ``s`` steps later, in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["RunningStatistics"]

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)  # lazy ones subclass these
Norm = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm


class RunningStatistics:
    """The running statistics of ``module``'s batch-norm layers, recorded per chunk and agreed per step.

    Args:
        layers: a stage's batch-norm layers that track running statistics (:meth:`of`).
        dtype: the dtype of the sums (the gradients' all-reduce dtype).
    """

    def __init__(self, layers: Sequence[Norm], dtype: torch.dtype) -> None:
        self.layers, self.dtype = list(layers), dtype
        self._momenta: list[float | None] = [m.momentum for m in self.layers]
        self._kept: list[list[torch.Tensor]] = []  # each layer's statistics at the step's start
        self._sums: torch.Tensor | None = None  # each layer's partial S of its means, then of its variances

    @classmethod
    def of(cls, module: nn.Module, dtype: torch.dtype) -> RunningStatistics | None:
        """The running statistics of ``module``'s batch-norm layers; ``None`` where it has none."""
        layers = [m for m in module.modules() if isinstance(m, _NORMS) and m.track_running_stats]
        return cls(layers, dtype) if layers else None

    def buffers(self) -> list[torch.Tensor]:
        """The buffers this agrees every step (the same on every replica, so not averaged again)."""
        return [b for m in self.layers for b in self._buffers(m)]

    @property
    def size(self) -> int:
        """The length of :meth:`take`'s tensor."""
        return 2 * sum(self._means(m).numel() for m in self.layers)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A step's chunks: within it each chunk's forward leaves its batch statistics in the buffers, which
        :meth:`end_chunk` records and puts back; afterwards the layers have their own momentum again."""
        self._kept = [[b.clone() for b in self._buffers(m)] for m in self.layers]
        for layer in self.layers:
            layer.momentum = 1.0
        if self._sums is None:
            device = self._means(self.layers[0]).device
            self._sums = torch.zeros(self.size, dtype=self.dtype, device=device)
        try:
            yield
        finally:
            for layer, momentum in zip(self.layers, self._momenta, strict=True):
                layer.momentum = momentum

    @torch.no_grad()
    def end_chunk(self, place: int, chunks: int, *, counted: bool) -> None:
        """A run of the chunk at ``place`` of the step's ``chunks`` ended: add its statistics if ``counted``
        (its run is the one used), and put the layers' statistics back as the step found them."""
        assert self._sums is not None, "end_chunk() outside step()"
        offset = 0
        for layer, momentum, kept in zip(self.layers, self._momenta, self._kept, strict=True):
            weight = 1.0 if momentum is None else momentum * (1 - momentum) ** (chunks - 1 - place)
            for current in (self._means(layer), self._vars(layer)):
                if counted:
                    self._sums[offset : offset + current.numel()] += weight * current.flatten().to(self.dtype)
                offset += current.numel()
            for current, before in zip(self._buffers(layer), kept, strict=True):
                # Not a new version: a pipeline's chunk still to back-propagate saved these buffers (training
                # never reads them in the backward), and autograd refuses tensors changed since it saved them.
                current.data.copy_(before)

    def take(self) -> torch.Tensor:
        """The step's partial sums, to all-reduce with the gradients (zeros start the next step's)."""
        assert self._sums is not None, "take() before any step()"
        sums, self._sums = self._sums, torch.zeros_like(self._sums)
        return sums

    @torch.no_grad()
    def apply(self, summed: torch.Tensor, chunks: int) -> None:
        """Apply a step of ``chunks`` chunks (the batch's, each committed once), :meth:`take`'s tensor summed
        over the replicas: the module docstring's rule, on the device."""
        offset = 0
        for layer, momentum in zip(self.layers, self._momenta, strict=True):
            tracked = layer.num_batches_tracked
            for current in (self._means(layer), self._vars(layer)):
                part = summed[offset : offset + current.numel()].view_as(current).to(current.dtype)
                if momentum is not None:
                    current.mul_((1 - momentum) ** chunks).add_(part)
                elif tracked is not None and chunks:  # k r + S over k + C
                    current.mul_(tracked).add_(part).div_(tracked + chunks)
                offset += current.numel()
            if tracked is not None:
                tracked.add_(chunks)

    @classmethod
    def _buffers(cls, layer: Norm) -> list[torch.Tensor]:
        tracked = layer.num_batches_tracked
        return [cls._means(layer), cls._vars(layer), *([tracked] if tracked is not None else [])]

    @staticmethod
    def _means(layer: Norm) -> torch.Tensor:
        assert layer.running_mean is not None
        return layer.running_mean

    @staticmethod
    def _vars(layer: Norm) -> torch.Tensor:
        assert layer.running_var is not None
        return layer.running_var
