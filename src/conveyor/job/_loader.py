"""Each worker's batches for ``conveyor train``: just the part it reads, on its device.

The first stage reads inputs and the last stage targets, so each gets that tensor alone, in the same
shuffled order (a permutation drawn from the seed and the epoch); the workers between read nothing. The
last batch of an epoch may be short: the pipeline splits any batch.

A dataset held in memory moves to the worker's device once, when the feed is made, and each batch is an
index into it there: no copy per batch, no loader process, nothing for the worker to wait for. With
``loader_workers`` (``--loader-workers N``), ``torch.utils.data`` processes read it from host memory instead,
into pinned buffers on CUDA, and the pipeline copies each batch to the device without waiting, as it feeds it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import BatchSampler, DataLoader, Sampler, TensorDataset

__all__ = ["EpochBatches", "EpochOrder", "epochs_when_read"]


class EpochOrder(Sampler[int]):
    """The sample order of an epoch: the same permutation on every worker for a given seed and epoch."""

    def __init__(self, samples: int, seed: int) -> None:
        self.samples, self.seed, self.epoch = samples, seed, 0

    def permutation(self) -> torch.Tensor:
        """This epoch's order, as a tensor (on the CPU: the same on every worker whatever its device)."""
        return torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def __iter__(self) -> Iterator[int]:
        return iter(self.permutation().tolist())

    def __len__(self) -> int:
        return self.samples


class EpochBatches:
    """``(inputs or None, targets or None)`` batches of one epoch, for :meth:`~conveyor.runtime.Pipeline.train`.

    Args:
        inputs, targets: the training tensors (the inputs may be tensors by name); give ``None`` for a part this
            worker does not read.
        batch_size: samples per batch (the last batch of an epoch may have fewer).
        seed: the shuffling seed.
        device: where the batches are used: the tensors move there once (without ``loader_workers``).
        loader_workers: ``DataLoader`` worker processes reading host memory instead (0: none).

    Example:
        >>> batches = EpochBatches(torch.zeros(10, 3), None, batch_size=4, seed=0)
        >>> len(batches), [tuple(x.shape) for x, _ in batches]
        (3, [(4, 3), (4, 3), (2, 3)])
    """

    def __init__(
        self,
        inputs: torch.Tensor | dict[str, torch.Tensor] | None,
        targets: torch.Tensor | None,
        batch_size: int,
        seed: int,
        *,
        device: torch.device | None = None,
        loader_workers: int = 0,
    ) -> None:
        leaves: list[Any] = []
        self._spec: pytree.TreeSpec | None = None
        if inputs is not None:  # named inputs: a tensor each
            leaves, self._spec = pytree.tree_flatten(inputs)
        parts = leaves + ([targets] if targets is not None else [])
        self.order = EpochOrder(len(parts[0]), seed)
        self._which = (len(leaves), targets is not None)  # how many tensors are inputs; whether targets follow
        self._batch_size = batch_size
        self._device = device or torch.device("cpu")
        self._parts: list[torch.Tensor] = []
        self._loader: DataLoader[Any] | None = None
        if loader_workers:
            # Whole batches at a time: a TensorDataset takes a list of indices, so no per-sample fetch and collate.
            self._loader = DataLoader(
                TensorDataset(*parts),
                batch_size=None,
                sampler=BatchSampler(self.order, batch_size, drop_last=False),
                num_workers=loader_workers,
                pin_memory=self._device.type == "cuda",
                persistent_workers=True,
            )
        else:
            self._parts = [t.to(self._device) for t in parts]

    def __len__(self) -> int:
        return -(-len(self.order) // self._batch_size)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        inputs, has_targets = self._which
        spec = self._spec
        for parts in self._batches():
            x = pytree.tree_unflatten(list(parts[:inputs]), spec) if spec is not None else None
            yield (x, parts[-1] if has_targets else None)

    def _batches(self) -> Iterator[tuple[torch.Tensor, ...] | list[torch.Tensor]]:
        if self._loader is not None:
            yield from self._loader
            return
        order = self.order.permutation().to(self._device)  # one copy per epoch
        for index in order.split(self._batch_size):
            yield tuple(t.index_select(0, index) for t in self._parts)


def epochs_when_read(
    inputs: torch.Tensor | dict[str, torch.Tensor],
    targets: torch.Tensor,
    batch_size: int,
    seed: int,
    *,
    device: torch.device | None,
) -> Callable[[], Iterator[tuple[Any, Any]]]:
    """A new epoch of :class:`EpochBatches` at each call, the tensors moved to ``device`` at the first call only:
    what a start-up measurement times one worker over, made where (and if) that worker calls it.

    Example:
        >>> epochs = epochs_when_read(torch.zeros(10, 3), torch.zeros(10), batch_size=4, seed=0, device=None)
        >>> [len(list(epochs())) for _ in range(2)]
        [3, 3]
    """
    held = functools.cache(lambda: EpochBatches(inputs, targets, batch_size, seed, device=device))
    return lambda: iter(held())
