"""Sparse updates as bytes: ``k`` of a flat tensor's ``n`` entries, their values in bfloat16 or float32.

A payload is the ``k`` values as they are given (``2k`` bytes in bfloat16, ``4k`` in float32), then their
positions, then one byte saying how the values and positions are written (bit 1: float32; bit 0: a bitmap). The
positions take whichever form is smaller:

- **gaps** (bit 0 clear): each index's distance from the one before, less one (``i_0`` for the first), as a
  LEB128 varint: 7 bits a byte, the top bit set on every byte but a number's last. The filter's entries are a few in a
  hundred, so most gaps take one byte: with bfloat16 values, about 3 bytes an entry where int32 indices and
  float32 values took 8;
- **bitmap**: ``n`` bits, ``ceil(n / 8)`` bytes, smaller once more than about one entry in eight is sent.

bfloat16 values lose precision; the sender keeps what they leave out (Gaia's pending update keeps ``a - u``,
:class:`~conveyor.gaia.SignificanceFilter`), so nothing is lost over the exchanges. The size depends on the
positions, so the receiver learns it from the notice (:mod:`conveyor.gaia._exchange`).

Example:
    >>> data = encode(torch.tensor([3, 4, 200]), torch.tensor([0.5, -2.0, 1.0], dtype=torch.bfloat16), 1000)
    >>> data.numel(), decode(data, 1000, 3)  # 6 bytes of values, gaps 3, 0, 195 (2 bytes), the tag
    (11, (tensor([  3,   4, 200]), tensor([ 0.5000, -2.0000,  1.0000])))
"""

from __future__ import annotations

import torch

__all__ = ["WIRE_DTYPES", "decode", "encode"]

WIRE_DTYPES = (torch.bfloat16, torch.float32)
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_BITMAP, _FLOAT32 = 1, 2  # the tag's bits


def encode(indices: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """``values`` (bfloat16 or float32, written as they are) at ``indices`` (ascending, of a flat tensor of ``n``)
    as a uint8 tensor, on the values' device."""
    if values.dtype not in WIRE_DTYPES:
        raise ValueError(f"values go as bfloat16 or float32, not {values.dtype}")
    tag = _FLOAT32 if values.dtype == torch.float32 else 0
    gaps = torch.diff(indices.to(torch.int64), prepend=indices.new_full((1,), -1)) - 1
    groups = _varint_lengths(gaps)
    if -(-n // 8) < int(groups.sum()):  # the bitmap is smaller: the gaps' bytes are not built
        mask = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=values.device)
        mask[indices] = 1
        positions = (mask.view(-1, 8) * _BITS.to(values.device)).sum(dim=1, dtype=torch.uint8)
        tag |= _BITMAP
    else:
        positions = _varints(gaps, groups)
    flags = torch.tensor([tag], dtype=torch.uint8, device=values.device)
    return torch.cat([values.reshape(-1).view(torch.uint8), positions, flags])


def decode(data: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices (int64, ascending) and float32 values :func:`encode` wrote for ``k`` of ``n`` entries (``data``
    may be a slice of a larger buffer at any offset)."""
    tag = int(data[-1])
    dtype = torch.float32 if tag & _FLOAT32 else torch.bfloat16
    width = dtype.itemsize * k
    values = data[:width].clone().view(dtype).to(torch.float32)  # cloned: aligned for the view
    positions = data[width:-1]
    if tag & _BITMAP:
        mask = (positions.unsqueeze(1) & _BITS.to(data.device)).ne(0).reshape(-1)[:n]
        return mask.nonzero().reshape(-1), values
    return torch.cumsum(_read_varints(positions, k) + 1, dim=0) - 1, values


def _varint_lengths(numbers: torch.Tensor) -> torch.Tensor:
    """The LEB128 bytes (7-bit groups) of each of ``numbers`` (int64, at least 0, under 2**35)."""
    groups = torch.ones_like(numbers)
    for j in range(1, 5):
        groups += numbers >= 1 << (7 * j)
    return groups


def _varints(numbers: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``numbers`` as LEB128 bytes, ``groups`` of them each (:func:`_varint_lengths`)."""
    owner = torch.repeat_interleave(torch.arange(numbers.numel(), device=numbers.device), groups)
    first = torch.cumsum(groups, dim=0) - groups
    place = torch.arange(owner.numel(), device=numbers.device) - first[owner]  # the 7-bit group, low first
    more = (place < groups[owner] - 1).to(torch.int64) << 7
    return (((numbers[owner] >> (7 * place)) & 127) | more).to(torch.uint8)


def _read_varints(data: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` numbers :func:`_varints` wrote in ``data``."""
    b = data.to(torch.int64)
    last = (b & 128) == 0
    owner = torch.cumsum(last.to(torch.int64), dim=0) - last.to(torch.int64)
    starts = torch.cat([b.new_zeros(1), torch.nonzero(last).reshape(-1)[:-1] + 1])
    place = torch.arange(b.numel(), device=b.device) - starts[owner]
    return torch.zeros(k, dtype=torch.int64, device=b.device).index_add_(0, owner, (b & 127) << (7 * place))
