"""Sparse updates survive their encoding: positions exactly, values as their dtype holds them, in the fewer bytes."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conveyor.gaia import Gaia, decode, encode


def varint_bytes(number: int) -> int:
    """LEB128's length: one byte per 7 bits, at least one."""
    return max(1, -(-number.bit_length() // 7))


@given(st.integers(1, 3000), st.sampled_from([torch.bfloat16, torch.float32]), st.data())
def test_entries_come_back_as_sent_in_the_smaller_encoding(n: int, dtype: torch.dtype, data: st.DataObject) -> None:
    chosen = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=min(n, 300))))
    indices = torch.tensor(chosen, dtype=torch.int64)
    values = torch.randn(len(chosen)).to(dtype)
    encoded = encode(indices, values, n)
    assert encoded.dtype == torch.uint8
    gaps = [b - a - 1 for a, b in zip([-1, *chosen], chosen, strict=False)]
    positions = min(sum(varint_bytes(g) for g in gaps), -(-n // 8))
    assert encoded.numel() == dtype.itemsize * len(chosen) + positions + 1  # values, positions, the tag
    offset = data.draw(st.integers(0, 7))  # a payload cut from a buffer of several
    got_indices, got_values = decode(
        torch.cat([torch.zeros(offset, dtype=torch.uint8), encoded])[offset:], n, len(chosen)
    )
    assert got_indices.tolist() == chosen
    assert got_values.dtype == torch.float32 and torch.equal(got_values, values.float())


def test_gaps_of_every_length_come_back() -> None:
    # Gaps of 1 to 5 LEB128 bytes, each side of every byte's boundary.
    n = 2**35 + 10
    positions = [0, 1, 128, 129, 128 + 2**7 + 1, 2**14 + 300, 2**21 + 2**14 + 301, 2**28 + 2**21 + 2**15, 2**35 + 9]
    indices = torch.tensor(positions)
    got, values = decode(encode(indices, torch.ones(len(positions), dtype=torch.bfloat16), n), n, len(positions))
    assert got.tolist() == positions and values.tolist() == [1.0] * len(positions)


def test_a_filter_s_payload_is_about_three_bytes_an_entry() -> None:
    # One entry in a hundred of VGG-16's 2.3 M weights, bfloat16: 2 bytes of value and mostly one of gap.
    n, k = 2_300_000, 23_000
    indices = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:k].sort().values
    size = encode(indices, torch.randn(k).bfloat16(), n).numel()
    assert 3.0 * k < size < 3.5 * k  # int32 indices and float32 values: 8 k


def test_values_go_as_bfloat16_or_float32() -> None:
    with pytest.raises(ValueError, match=r"bfloat16 or float32, not torch\.float16"):
        encode(torch.tensor([0]), torch.ones(1, dtype=torch.float16), 4)


def test_gaia_sends_bfloat16_or_float32() -> None:
    with pytest.raises(ValueError, match=r"wire_dtype is torch\.bfloat16 or torch\.float32, got torch\.float16"):
        Gaia(2, wire_dtype=torch.float16)
