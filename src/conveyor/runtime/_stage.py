"""Cut a model given as an ordered list of blocks into pipeline stages that keep the blocks' names.

A stage is an ``nn.Sequential`` of consecutive blocks under their original names, so its
``state_dict()`` keys are exactly the keys the whole model has: ``"3.weight"`` on stage 1 is ``"3.weight"``
in the user's non-pipelined ``nn.Sequential``.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> stage_ranges([2, 1], len(model))
    [(0, 2), (2, 3)]
    >>> list(build_stage(model, (2, 3)).state_dict())
    ['2.weight', '2.bias']
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from conveyor.errors import InputError

__all__ = [
    "Blocks",
    "StagePosition",
    "WorldSizeError",
    "as_blocks",
    "block_shapes",
    "build_stage",
    "check_world_size",
    "even_balance",
    "stage_ranges",
]

Blocks = nn.Sequential | Sequence[nn.Module]


def as_blocks(model: Blocks | nn.Module) -> list[tuple[str, nn.Module]]:
    """The named blocks of ``model``: an ``nn.Sequential`` keeps its names, a list is numbered 0, 1, ...

    Raises:
        TypeError: ``model`` is neither an ``nn.Sequential`` nor a sequence of modules.
    """
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if isinstance(model, nn.Module):
        raise TypeError(
            f"{type(model).__name__} is a single module: give the pipeline an example batch to split it at its "
            "submodules (Pipeline(model, stages, example=batch, ...)), or an nn.Sequential or a list of blocks"
        )
    blocks = list(model)
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"block {i} is a {type(b).__name__}, not an nn.Module")
    return [(str(i), b) for i, b in enumerate(blocks)]


def stage_ranges(balance: Sequence[int], num_blocks: int) -> list[tuple[int, int]]:
    """Turn block counts per stage into ``[start, stop)`` block ranges.

    Raises:
        ValueError: a stage gets no block, or the counts do not add up to the model's blocks.
    """
    if not balance:
        raise InputError("balance is empty: give the number of blocks of each stage, e.g. [2, 2]")
    if len(balance) > num_blocks:
        raise InputError(
            f"{len(balance)} stages but the model has only {num_blocks} blocks: use at most {num_blocks} "
            "stages, or split the model into more blocks"
        )
    if any(n < 1 for n in balance):
        raise InputError(f"balance {list(balance)} gives a stage no block: every stage needs at least one")
    if sum(balance) != num_blocks:
        raise InputError(
            f"balance {list(balance)} covers {sum(balance)} blocks but the model has {num_blocks}: "
            "the counts must add up to the number of blocks"
        )
    ranges, start = [], 0
    for n in balance:
        ranges.append((start, start + n))
        start += n
    return ranges


def even_balance(blocks: int, stages: int) -> list[int]:
    """Blocks per stage, as equal as possible: ``even_balance(5, 2) == [3, 2]``.

    Raises:
        ValueError: fewer blocks than stages, or no stage.
    """
    if not 1 <= stages <= blocks:
        raise InputError(f"cannot cut {blocks} blocks into {stages} stages: use 1 to {blocks} stages")
    return [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]


def block_shapes(blocks: list[tuple[str, nn.Module]]) -> dict[str, torch.Size]:
    """The whole model's state names and shapes, as :func:`build_stage` names them in every stage (what a
    checkpoint of the model must hold)."""
    return {f"{name}.{k}": v.shape for name, block in blocks for k, v in block.state_dict().items()}


def build_stage(model: Blocks | nn.Module, block_range: tuple[int, int]) -> nn.Sequential:
    """The blocks ``[start, stop)`` of ``model`` as an ``nn.Sequential`` under their original names."""
    start, stop = block_range
    return nn.Sequential(OrderedDict(as_blocks(model)[start:stop]))


class WorldSizeError(RuntimeError):
    """The job has a different number of workers than the pipeline's stages and replicas need."""


def check_world_size(world: int, replicas: Sequence[int]) -> None:
    """Raise :class:`WorldSizeError`, saying what to start, unless ``world`` workers are the stages' ``replicas``."""
    workers = sum(replicas)
    if world != workers:
        layout = "-".join(map(str, replicas))
        raise WorldSizeError(
            f"the pipeline has {len(replicas)} stages with replicas {layout}, which need {workers} workers, "
            f"but {world} were started: start {workers} (launch(..., nprocs={workers}) or torchrun "
            f"--nproc_per_node {workers}), or give a balance and replicas for {world} workers"
        )


class StagePosition:
    """Where a worker's stage sits in its pipeline: ``stage`` of ``num_stages`` (set by the subclass)."""

    stage: int
    num_stages: int

    @property
    def is_first(self) -> bool:
        """Whether this worker runs the first stage (and so reads the inputs)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this worker runs the last stage (and so reads the targets)."""
        return self.stage == self.num_stages - 1
