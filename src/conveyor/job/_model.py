"""The model and the dataset a training config names, built alike on every worker."""

from __future__ import annotations

import torch
from torch import nn

import conveyor.job._data as datasets
import conveyor.job._zoo as zoo
from conveyor.job._config import TrainConfig
from conveyor.job._warmstart import apply_plan

__all__ = ["model_and_data"]


def model_and_data(cfg: TrainConfig, warm_start_plan: str | None = None) -> tuple[nn.Sequential, datasets.Dataset]:
    """The model (initialised from ``cfg.seed``, identical on every worker, then given the parent's weights a
    ``warm_start_plan`` maps) and its dataset."""
    if ":" in cfg.model.name:
        data = datasets.load(cfg.model.dataset or "digits", cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        model, _ = zoo.resolve(cfg.model.name, cfg.optimizer.batch_size, data, cfg.model.args)
    else:
        data = datasets.load(cfg.model.dataset or zoo.default_dataset(cfg.model.name), cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        model = zoo.build(cfg.model.name, data, cfg.model.width, cfg.model.depth)
    apply_plan(
        warm_start_plan, model, cfg.run.seed
    )  # --warm-start: the parent's weights, transformed (the same in every worker)
    return model, data
