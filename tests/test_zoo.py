"""Resolving model names and user factories."""

import pytest
import torch

from conveyor.zoo import resolve


def factory(batch_size: int) -> tuple[torch.nn.Sequential, torch.Tensor]:
    return torch.nn.Sequential(torch.nn.Linear(3, 3)), torch.zeros(batch_size, 3)


def not_a_model(batch_size: int) -> int:
    return batch_size


def test_builtin_and_user_factories() -> None:
    model, example = resolve("mlp", 5)
    assert example.shape == (5, 64) and len(model) == 5
    model, example = resolve("test_zoo:factory", 2)
    assert example.shape == (2, 3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("resnet9000", "unknown model 'resnet9000': use one of mlp"),
        ("no_such_module:f", "cannot load the model factory"),
        ("test_zoo:missing", "cannot load the model factory"),
        ("test_zoo:not_a_model", r"must return \(model, example_batch\)"),
    ],
)
def test_bad_specs_say_what_to_do(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(spec, 2)
