"""Split a batch (any pytree of tensors) into equal microbatches along its first dimension.

Example:
    >>> import torch
    >>> parts = split({"x": torch.zeros(8, 3), "n": 5}, 4)
    >>> [tuple(p["x"].shape) for p in parts], parts[0]["n"]
    ([(2, 3), (2, 3), (2, 3), (2, 3)], 5)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["batch_size", "split"]


def batch_size(batch: Any) -> int:
    """The first dimension shared by every tensor in ``batch``.

    Raises:
        ValueError: ``batch`` holds no tensor, a 0-d tensor, or tensors of different batch sizes.
    """
    sizes = {t.shape[0] if t.dim() > 0 else None for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)}
    if not sizes:
        raise ValueError("the batch holds no tensor: pass a tensor or a tuple/list/dict of tensors")
    if None in sizes:
        raise ValueError("a tensor in the batch is 0-d: every tensor needs a batch dimension first")
    if len(sizes) > 1:
        raise ValueError(f"tensors in the batch have different first dimensions {sorted(sizes)}: they must agree")
    return sizes.pop()


def split(batch: Any, microbatches: int) -> list[Any]:
    """Cut every tensor of ``batch`` into ``microbatches`` equal parts along dim 0; other leaves are shared.

    Raises:
        ValueError: the batch size is not a multiple of ``microbatches``.
    """
    size = batch_size(batch)
    if microbatches < 1 or size % microbatches:
        raise ValueError(
            f"a batch of {size} samples cannot be split into {microbatches} equal microbatches: "
            f"use a batch size that is a multiple of {microbatches}, or another number of microbatches"
        )
    leaves, spec = pytree.tree_flatten(batch)
    chunks = [leaf.chunk(microbatches) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    return [
        pytree.tree_unflatten([leaf if c is None else c[i] for leaf, c in zip(leaves, chunks, strict=True)], spec)
        for i in range(microbatches)
    ]
