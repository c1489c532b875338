"""Cutting a model into stages that keep the original parameter names."""

from collections import OrderedDict

import pytest
from torch import nn

from conveyor.runtime._stage import as_blocks, block_shapes, build_stage, stage_ranges


def test_sequential_keeps_its_names_and_lists_are_numbered() -> None:
    named = nn.Sequential(OrderedDict(embed=nn.Linear(2, 2), act=nn.ReLU()))
    assert [n for n, _ in as_blocks(named)] == ["embed", "act"]
    assert [n for n, _ in as_blocks([nn.ReLU(), nn.Tanh()])] == ["0", "1"]


def test_stage_state_dict_has_the_full_models_keys() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.BatchNorm1d(2))
    stages = [build_stage(model, r) for r in stage_ranges([2, 2], len(model))]
    keys = [k for s in stages for k in s.state_dict()]
    assert keys == list(model.state_dict())


def test_single_module_is_rejected_with_advice() -> None:
    with pytest.raises(TypeError, match=r"give the pipeline an example batch to split it .*example=batch"):
        as_blocks(nn.Linear(2, 2))


def test_non_module_block_is_rejected() -> None:
    with pytest.raises(TypeError, match="block 1 is a str"):
        as_blocks([nn.ReLU(), "relu"])


@pytest.mark.parametrize(
    ("balance", "message"),
    [
        ([1, 1, 1, 1], "4 stages but the model has only 3 blocks"),
        ([2, 0, 1], "gives a stage no block"),
        ([1, 1], "covers 2 blocks but the model has 3"),
        ([], "balance is empty"),
    ],
)
def test_bad_balance_names_the_fix(balance: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stage_ranges(balance, 3)


def test_block_shapes_are_the_whole_models_state_under_its_names() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.BatchNorm1d(3))
    shapes = block_shapes(as_blocks(model))
    assert shapes == {k: v.shape for k, v in model.state_dict().items()}
    assert shapes["2.running_mean"] == (3,)
