"""What every dataset is: train and test tensors in memory, the inputs one tensor or tensors by name."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from conveyor.errors import InputError

__all__ = ["Dataset", "Inputs", "rows"]

Inputs = torch.Tensor | dict[str, torch.Tensor]
"""A dataset's inputs: one tensor, or tensors by the name of the model's argument they are (``input_ids`` and
``attention_mask``), every one with a row per sample."""


@dataclass(frozen=True)
class Dataset:
    """Train and test tensors. ``classes`` is the number of labels (the vocabulary for text);
    ``sequence`` says targets are per position (language modelling) rather than per sample."""

    name: str
    train_x: Inputs
    train_y: torch.Tensor
    test_x: Inputs
    test_y: torch.Tensor
    classes: int
    sequence: bool = False

    @property
    def samples(self) -> int:
        """Training samples."""
        return len(self.train_y)

    def first_batches(self, size: int, count: int) -> list[tuple[Inputs, torch.Tensor]]:
        """The first ``count`` training batches of ``size`` samples, in order (the last may be short)."""
        return [
            (rows(self.train_x, slice(i * size, (i + 1) * size)), self.train_y[i * size : (i + 1) * size])
            for i in range(count)
        ]

    def subset(self, samples: int, seed: int) -> Dataset:
        """``samples`` training samples drawn without replacement (every one where there are fewer), seeded, in
        the order they were; the test split whole. Drawn rather than the first ones: a folder of images may be
        sorted by class."""
        if samples >= self.samples:
            return self
        drawn = torch.randperm(self.samples, generator=torch.Generator().manual_seed(seed))[:samples].sort().values
        return replace(self, train_x=rows(self.train_x, drawn), train_y=self.train_y[drawn])

    def tensor_inputs(self, needs: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The training and test inputs, where each is one tensor.

        Raises:
            InputError: the inputs are named tensors (``input_ids`` and ``attention_mask``); ``needs`` says who
                needs one tensor.
        """
        if isinstance(self.train_x, dict) or isinstance(self.test_x, dict):
            names = ", ".join(self.train_x)
            raise InputError(
                f"one input tensor is needed for {needs}, and {self.name} gives {names}: use a module:callable model"
            )
        return self.train_x, self.test_x


def rows(x: Inputs, index: slice | torch.Tensor) -> Inputs:
    """The samples ``index`` selects, of every input tensor."""
    return {k: v[index] for k, v in x.items()} if isinstance(x, dict) else x[index]
