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
they arrive). Here each run of a chunk gives the chunk's batch statistics (the layer's momentum is 1 for the
step, so a forward leaves them in the buffers, which are put back after each chunk), weighted by the chunk's
place ``c``: its term of ``S``. The terms of the runs committed are summed with the gradients (in the
replicas' all-reduce, or in live reduction's sum of the chunks' buffers), and every replica applies the rule
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
        self._stats = [t for m in self.layers for t in (self._means(m), self._vars(m))]  # a term's order
        self._kept: list[torch.Tensor] = []  # every buffer at the step's start
        self._weights: dict[tuple[int, int], torch.Tensor] = {}  # a term's weights, by (place, chunks)
        self._decays: dict[int, torch.Tensor] = {}  # (1 - m)^C, by C, for the layers with a momentum

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
        """The length of :meth:`end_chunk`'s tensor: each layer's means, then its variances."""
        return sum(t.numel() for t in self._stats)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A step's chunks: within it each chunk's forward leaves its batch statistics in the buffers (the layers'
        momentum is 1), which :meth:`end_chunk` reads; afterwards the buffers are as the step found them and the
        layers have their own momentum again."""
        self._kept = [b.clone() for b in self.buffers()]
        for layer in self.layers:
            layer.momentum = 1.0
        try:
            yield
        finally:
            for layer, momentum in zip(self.layers, self._momenta, strict=True):
                layer.momentum = momentum
            with torch.no_grad():
                for current, before in zip(self.buffers(), self._kept, strict=True):
                    # Not a new version: a pipeline's chunk still to back-propagate saved these buffers (training
                    # never reads them in the backward), and autograd refuses tensors changed since it saved them.
                    current.data.copy_(before)

    @torch.no_grad()
    def end_chunk(self, place: int, chunks: int) -> torch.Tensor:
        """A run of the chunk at ``place`` of the step's ``chunks`` ended its forward: its term of ``S`` (to sum
        where the run is the one used). The next chunk's forward replaces the statistics it read."""
        return torch.cat([t.reshape(-1) for t in self._stats]).to(self.dtype) * self._weight(place, chunks)

    def _weight(self, place: int, chunks: int) -> torch.Tensor:
        """Each element's weight in a term: ``m (1 - m)^(C - 1 - c)``, or 1 for a cumulative average."""
        if (place, chunks) not in self._weights:
            parts = [
                torch.full((t.numel(),), 1.0 if m is None else m * (1 - m) ** (chunks - 1 - place), dtype=self.dtype)
                for layer, m in zip(self.layers, self._momenta, strict=True)
                for t in (self._means(layer), self._vars(layer))
            ]
            self._weights[(place, chunks)] = torch.cat(parts).to(self._stats[0].device)
        return self._weights[(place, chunks)]

    @torch.no_grad()
    def apply(self, summed: torch.Tensor, chunks: int) -> None:
        """Apply a step of ``chunks`` chunks (the batch's, each committed once), the sum of their
        :meth:`end_chunk` terms: the module docstring's rule, on the device."""
        if chunks not in self._decays:
            parts = [
                torch.full((t.numel(),), 1.0 if m is None else (1 - m) ** chunks, dtype=self.dtype)
                for layer, m in zip(self.layers, self._momenta, strict=True)
                for t in (self._means(layer), self._vars(layer))
            ]
            self._decays[chunks] = torch.cat(parts).to(summed.device)
        moved = (torch.cat([t.reshape(-1) for t in self._stats]).to(self.dtype) * self._decays[chunks] + summed).to(
            self._stats[0].dtype
        )
        offset = 0
        for layer, momentum in zip(self.layers, self._momenta, strict=True):
            tracked = layer.num_batches_tracked
            for current in (self._means(layer), self._vars(layer)):
                span = slice(offset, offset + current.numel())
                if momentum is not None:
                    current.copy_(moved[span].view_as(current))
                elif tracked is not None and chunks:  # k r + S over k + C
                    current.mul_(tracked).add_(summed[span].view_as(current)).div_(tracked + chunks)
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
