"""Each worker's batches for ``conveyor train``: ``torch.utils.data`` loaders over just the part it reads.

The first stage reads inputs and the last stage targets, so each gets a loader over that tensor alone,
in the same shuffled order (a permutation drawn from the seed and the epoch); the workers between read
nothing. The last batch of an epoch may be short: the pipeline splits any batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler, TensorDataset

__all__ = ["EpochBatches", "EpochOrder"]


class EpochOrder(Sampler[int]):
    """The sample order of an epoch: the same permutation on every worker for a given seed and epoch."""

    def __init__(self, samples: int, seed: int) -> None:
        self.samples, self.seed, self.epoch = samples, seed, 0

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.samples, generator=generator).tolist())

    def __len__(self) -> int:
        return self.samples


class EpochBatches:
    """``(inputs or None, targets or None)`` batches of one epoch, for :meth:`~conveyor.runtime.Pipeline.train`.

    Args:
        inputs, targets: the training tensors; give ``None`` for a part this worker does not read.
        batch_size: samples per batch (the last batch of an epoch may have fewer).
        seed: the shuffling seed.
        loader_workers: ``DataLoader`` worker processes (0 loads in the training process).
        pin_memory: pin batches for fast copies to a GPU.

    Example:
        >>> batches = EpochBatches(torch.zeros(10, 3), None, batch_size=4, seed=0)
        >>> len(batches), [tuple(x.shape) for x, _ in batches]
        (3, [(4, 3), (4, 3), (2, 3)])
    """

    def __init__(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        batch_size: int,
        seed: int,
        loader_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        parts = [t for t in (inputs, targets) if t is not None]
        self.order = EpochOrder(len(parts[0]), seed)
        self._which = (inputs is not None, targets is not None)
        # Whole batches at a time: a TensorDataset takes a list of indices, so no per-sample fetch and collate.
        self._loader = DataLoader(
            TensorDataset(*parts), batch_size=None, sampler=BatchSampler(self.order, batch_size, drop_last=False),
            num_workers=loader_workers, pin_memory=pin_memory, persistent_workers=loader_workers > 0,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        has_inputs, has_targets = self._which
        for parts in self._loader:
            yield (parts[0] if has_inputs else None, parts[-1] if has_targets else None)
