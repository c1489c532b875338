"""Models by name: the built-in ones, or a user's ``package.module:factory``.

A factory takes the batch size and returns ``(model, example_batch)``: the model as an ``nn.Sequential``
(or a list of blocks) and one batch of input for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from conveyor.stage import Blocks
from conveyor.train import mlp

__all__ = ["MODELS", "resolve"]


def _digits_mlp(batch_size: int) -> tuple[Blocks, Any]:
    return mlp(), torch.randn(batch_size, 64)


MODELS: dict[str, Callable[[int], tuple[Blocks, Any]]] = {"mlp": _digits_mlp}


def resolve(spec: str, batch_size: int) -> tuple[Blocks, Any]:
    """The model and an example batch for ``spec``: a name in :data:`MODELS` or ``package.module:factory``.

    Raises:
        ValueError: the name is unknown, the factory cannot be imported, or it returns something else.
    """
    if ":" not in spec:
        if spec not in MODELS:
            raise ValueError(
                f"unknown model {spec!r}: use one of {', '.join(sorted(MODELS))}, or package.module:factory"
            )
        return MODELS[spec](batch_size)
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load the model factory {spec!r}: {exc}") from exc
    result = factory(batch_size)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module | list)):
        raise ValueError(
            f"the factory {spec!r} returned {type(result).__name__}: it must return (model, example_batch) "
            "for the batch size it is given"
        )
    return result
