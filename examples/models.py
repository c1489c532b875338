"""Two models of your own, as ``conveyor train --model`` takes them (run from the repository's root folder, which
Conveyor looks in as ``python -m`` does):

- ``--model examples.models:factory``: a function given the batch size that returns the model and an example
  batch (here an MLP on the bundled digits, 64 features and 10 classes);
- ``--model examples.models:TinyCNN --dataset digit-images``: a module class, called with ``--model-args`` (here
  none), whose example batch comes from the dataset; any ``nn.Module`` torch.export can trace is split into blocks.
"""

import torch
from torch import nn


def factory(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 10))
    return model, torch.zeros(batch_size, 64)


class TinyCNN(nn.Module):
    """Two convolutions and a linear head, for images of any size and channels."""

    def __init__(self, channels: int = 1, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU()
        )
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.head = nn.Linear(32 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.pool(self.features(x)).flatten(1))
        return logits
