"""The model and the dataset a training config names, built alike on every worker."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import conveyor.job._data as datasets
import conveyor.job._zoo as zoo
from conveyor.config import TrainConfig
from conveyor.job._warmstart import apply_plan
from conveyor.runtime import Materialize, initialise_from

__all__ = ["materializer", "model_and_data"]


def model_and_data(cfg: TrainConfig, warm_start_plan: str | None = None) -> tuple[nn.Sequential, datasets.Dataset]:
    """The model (initialised from ``cfg.seed``, identical on every worker, then given the parent's weights a
    ``warm_start_plan`` maps; with ``--materialize stage``, built on the meta device: see :func:`materializer`)
    and its dataset."""
    data = datasets.load(cfg.model.dataset or zoo.default_dataset(cfg.model.name), cfg.run.seed)
    if cfg.model.max_train_samples is not None:
        data = data.subset(cfg.model.max_train_samples, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    with torch.device("meta") if cfg.model.materialize == "stage" else contextlib.nullcontext():
        if ":" in cfg.model.name:
            model, _ = zoo.resolve(cfg.model.name, cfg.optimizer.batch_size, data, cfg.model.args)
        else:
            model = zoo.build(cfg.model.name, data, cfg.model.width, cfg.model.depth)
    apply_plan(
        warm_start_plan, model, cfg.run.seed
    )  # --warm-start: the parent's weights, transformed (the same in every worker)
    return model, data


def materializer(cfg: TrainConfig, model: nn.Sequential) -> Materialize | None:
    """How a worker makes its stage of ``model`` real: with ``--materialize stage``, each module initialised on its
    own from ``cfg.run.seed`` (:func:`~conveyor.runtime.initialise_from`); ``None`` for a whole model."""
    return initialise_from(model, seed=cfg.run.seed) if cfg.model.materialize == "stage" else None
