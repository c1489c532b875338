"""Sparse updates as bytes: the positions and values of ``k`` of a flat tensor's ``n`` entries.

Two encodings, whichever is smaller, chosen from ``(n, k)`` alone so the receiver needs no header: ``k`` int32
indices then ``k`` float32 values (``8k`` bytes), or a bitmap of ``n`` bits then the ``k`` values in order
(``ceil(n / 8) + 4k`` bytes); the bitmap wins above one entry in 32.
"""

from __future__ import annotations

import torch

__all__ = ["decode", "encode", "encoded_bytes"]

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def encoded_bytes(n: int, k: int) -> int:
    """The bytes of ``k`` of ``n`` entries.

    Example:
        >>> encoded_bytes(1000, 10), encoded_bytes(1000, 100)
        (80, 525)
    """
    return min(8 * k, -(-n // 8) + 4 * k)


def _bitmap(n: int, k: int) -> bool:
    return -(-n // 8) + 4 * k < 8 * k


def encode(indices: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """``values`` (float32) at ``indices`` (ascending, of a flat tensor of ``n``) as a uint8 tensor of
    :func:`encoded_bytes` bytes, on the values' device.

    Example:
        >>> data = encode(torch.tensor([1, 6]), torch.tensor([0.5, -2.0]), 8)
        >>> data.numel(), decode(data, 8, 2)  # 2 of 8: a 1-byte bitmap and 2 values, not 2 indices and 2 values
        (9, (tensor([1, 6]), tensor([ 0.5000, -2.0000])))
    """
    k = int(indices.numel())
    values = values.to(torch.float32).reshape(-1)
    if not _bitmap(n, k):
        return torch.cat([indices.to(torch.int32).view(torch.uint8), values.view(torch.uint8)])
    mask = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=values.device)
    mask[indices] = 1
    bits = (mask.view(-1, 8) * _BITS.to(values.device)).sum(dim=1, dtype=torch.uint8)
    return torch.cat([bits, values.view(torch.uint8)])


def decode(data: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices (int64, ascending) and float32 values :func:`encode` wrote for ``k`` of ``n`` entries (``data``
    may be a slice of a larger buffer at any offset)."""
    if data.storage_offset() % 4:
        data = data.clone()  # 4-byte views need 4-byte alignment
    if not _bitmap(n, k):
        indices = data[: 4 * k].view(torch.int32).to(torch.int64)
        return indices, data[4 * k : 8 * k].view(torch.float32)
    head = -(-n // 8)
    mask = (data[:head].unsqueeze(1) & _BITS.to(data.device)).ne(0).reshape(-1)[:n]
    return mask.nonzero().reshape(-1), data[head : head + 4 * k].clone().view(torch.float32)  # 4-byte aligned
