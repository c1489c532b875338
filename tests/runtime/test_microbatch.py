"""Splitting batches (pytrees of tensors) into microbatches."""

import pytest
import torch

from conveyor.runtime._microbatch import batch_size, split


def test_split_keeps_structure_and_shares_plain_values() -> None:
    batch = {"x": torch.arange(12.0).reshape(6, 2), "pair": (torch.arange(6), "tag")}
    parts = split(batch, 3)
    assert [p["x"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert [p["pair"][0].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p["pair"][1] == "tag" for p in parts)


def test_uneven_batches_split_as_equally_as_possible() -> None:
    assert [len(p) for p in split(torch.zeros(10, 3), 4)] == [3, 3, 2, 2]
    assert [len(p) for p in split(torch.zeros(2, 3), 4)] == [1, 1, 0, 0]  # a short batch leaves parts empty
    with pytest.raises(ValueError, match="at least 1 microbatch"):
        split(torch.zeros(2, 3), 0)


def test_tensors_of_different_batch_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"different first dimensions \[3, 4\]"):
        batch_size((torch.zeros(4), torch.zeros(3)))


def test_batch_without_tensors_is_rejected() -> None:
    with pytest.raises(ValueError, match="holds no tensor"):
        batch_size({"a": 1})


def test_scalar_tensor_is_rejected() -> None:
    with pytest.raises(ValueError, match="0-d"):
        batch_size(torch.tensor(1.0))
