"""Sparse updates survive their encoding, in the fewer bytes of the two."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from conveyor.gaia import decode, encode, encoded_bytes


@given(st.integers(1, 300), st.data())
def test_entries_come_back_as_sent_in_the_smaller_encoding(n: int, data: st.DataObject) -> None:
    chosen = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
    indices = torch.tensor(chosen, dtype=torch.int64)
    values = torch.randn(len(chosen))
    encoded = encode(indices, values, n)
    assert encoded.dtype == torch.uint8
    assert encoded.numel() == encoded_bytes(n, len(chosen)) == min(8 * len(chosen), -(-n // 8) + 4 * len(chosen))
    offset = data.draw(st.integers(0, 7))  # a payload cut from a buffer of several
    got_indices, got_values = decode(
        torch.cat([torch.zeros(offset, dtype=torch.uint8), encoded])[offset:], n, len(chosen)
    )
    assert got_indices.tolist() == chosen
    assert torch.equal(got_values, values)
