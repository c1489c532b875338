"""Each reading worker's batches: the dataset on the device, indexed there, in the same order as a DataLoader's."""

import pytest
import torch

from conveyor.job import EpochBatches


@pytest.mark.slow
def test_batches_on_the_device_are_the_loaders_in_the_same_order() -> None:
    x, y = torch.arange(50.0).reshape(25, 2), torch.arange(25)
    on_device = EpochBatches(x, y, batch_size=8, seed=3, device=torch.device("cpu"))
    loaded = EpochBatches(x, y, batch_size=8, seed=3, loader_workers=1)
    firsts = []
    for epoch in (0, 1):
        on_device.order.epoch = loaded.order.epoch = epoch
        ours, theirs = list(on_device), list(loaded)
        assert len(ours) == len(on_device) == 4 and [len(b[0]) for b in ours] == [8, 8, 8, 1]
        for (a, b), (c, d) in zip(ours, theirs, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d) and torch.equal(a[:, 0], 2 * b.float())  # pairs kept
        firsts.append(ours[0][1])
    assert not torch.equal(*firsts)  # each epoch its own order


def test_a_reader_of_one_part_gets_none_for_the_other() -> None:
    batches = EpochBatches(None, torch.arange(10), batch_size=4, seed=0)
    assert [(x, len(y)) for x, y in batches] == [(None, 4), (None, 4), (None, 2)]


def test_named_inputs_are_indexed_alike_and_come_back_by_name() -> None:
    x = {"input_ids": torch.arange(20).reshape(10, 2), "attention_mask": torch.arange(10)[:, None].repeat(1, 2)}
    y = torch.arange(10)
    for reader in (EpochBatches(x, y, batch_size=4, seed=1), EpochBatches(x, None, batch_size=4, seed=1)):
        batches = list(reader)
        assert [len(b[0]["input_ids"]) for b in batches] == [4, 4, 2]
        for inputs, targets in batches:
            assert torch.equal(inputs["input_ids"][:, 0], 2 * inputs["attention_mask"][:, 0])  # rows kept together
            assert targets is None or torch.equal(inputs["attention_mask"][:, 0], targets)
    assert all(x is None for x, _ in EpochBatches(None, y, batch_size=4, seed=1))
