"""Split a batch (any pytree of tensors) into microbatches along its first dimension, as equal as possible.

Example:
    >>> import torch
    >>> parts = split({"x": torch.zeros(7, 3), "n": 5}, 4)
    >>> [tuple(p["x"].shape) for p in parts], parts[0]["n"]
    ([(2, 3), (2, 3), (2, 3), (1, 3)], 5)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from conveyor.errors import InputError

__all__ = ["Parts", "batch_means", "batch_size", "split", "to_device"]


def batch_size(batch: Any) -> int:
    """The first dimension shared by every tensor in ``batch``.

    Raises:
        ValueError: ``batch`` holds no tensor, a 0-d tensor, or tensors of different batch sizes.
    """
    if isinstance(batch, torch.Tensor) and batch.dim():  # the common case, without pytree's cost (tens of us)
        return int(batch.shape[0])
    tensors = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise InputError("the batch holds no tensor: pass a tensor or a tuple/list/dict of tensors")
    if any(t.dim() == 0 for t in tensors):
        raise InputError("a tensor in the batch is 0-d: every tensor needs a batch dimension first")
    sizes = {int(t.shape[0]) for t in tensors}
    if len(sizes) > 1:
        raise InputError(f"tensors in the batch have different first dimensions {sorted(sizes)}: they must agree")
    return sizes.pop()


def split(batch: Any, microbatches: int | Sequence[int]) -> list[Any]:
    """Cut every tensor of ``batch`` into ``microbatches`` parts along dim 0 (views); other leaves are shared.

    With a count, the parts' sizes differ by at most one sample, the larger ones first; a batch of fewer samples
    than ``microbatches`` leaves the last parts empty (a pipeline skips them). With a sequence, it is the parts'
    sizes, which sum to the batch's.

    Example:
        >>> [tuple(p.shape) for p in split(torch.zeros(7, 3), [4, 0, 3])]
        [(4, 3), (0, 3), (3, 3)]

    Raises:
        ValueError: ``microbatches`` is below 1 (or sizes that do not sum to the batch's), or the batch is not a
            pytree of tensors with one batch size.
    """
    samples = batch_size(batch)
    if isinstance(microbatches, int):
        if microbatches < 1:
            raise InputError(f"a batch is split into at least 1 microbatch, got {microbatches}")
        cuts: int | list[int] = microbatches
    else:
        if sum(microbatches) != samples or min(microbatches, default=-1) < 0:
            raise InputError(f"parts of sizes {list(microbatches)} do not make a batch of {samples}")
        cuts = list(itertools.accumulate(microbatches))[:-1]
    if isinstance(batch, torch.Tensor):
        return [batch] if cuts == 1 or cuts == [] else list(batch.tensor_split(cuts))
    leaves, spec = pytree.tree_flatten(batch)
    parts = [leaf.tensor_split(cuts) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    count = microbatches if isinstance(microbatches, int) else len(microbatches)
    return [
        pytree.tree_unflatten([leaf if c is None else c[i] for leaf, c in zip(leaves, parts, strict=True)], spec)
        for i in range(count)
    ]


def to_device(tree: Any, device: torch.device) -> Any:
    """Move every tensor of ``tree`` to ``device`` (without waiting, where the copy allows it)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device, non_blocking=True)
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), tree)


def batch_means(losses: dict[int, tuple[float, int]], batches: int, microbatches: int) -> list[float]:
    """Each of ``batches`` batches' mean loss over its samples, from its microbatches' ``k: (mean loss, samples)``
    (microbatch ``k`` of batch ``k // microbatches``; an empty one is absent).

    Example:
        >>> batch_means({0: (1.0, 3), 1: (3.0, 1), 2: (2.0, 2)}, 2, 2)
        [1.5, 2.0]
    """
    out = []
    for b in range(batches):
        parts = [losses[k] for k in range(b * microbatches, (b + 1) * microbatches) if k in losses]
        out.append(sum(loss * n for loss, n in parts) / sum(n for _, n in parts))
    return out


class Parts:
    """The microbatches of one batch, as a feed for evaluation."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def microbatch(self, k: int) -> tuple[Any, Any, int]:
        return self.parts[k], None, batch_size(self.parts[k])

    def batch_samples(self, k: int) -> int:
        return sum(batch_size(p) for p in self.parts)
