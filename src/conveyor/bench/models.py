"""``conveyor bench models``: users' own models, split by torch.export, against the same models unsplit.

For each case (a ``module:callable`` with its ``--model-args`` and dataset):

- **split against unsplit**: a plain PyTorch loop on one worker (the GPU where there is one) trains the model
  as the user wrote it and, from the same initial weights on the same batches, its split
  (:func:`conveyor.runtime.split_model`): samples per second over the epochs after the first, and the accuracy
  after each epoch;
- **Conveyor on one worker** (``conveyor train --workers 1``), and the zoo's ``nn.Sequential`` twin where one
  exists (the same layers, written as blocks);
- **the planner's layout on** ``workers`` (default 4): stages, replicas, schedule, samples/s and peak memory
  per worker;
- **two stages**: accuracy after each epoch of ``conveyor train --stages 2``, set against the plain loop's;

then **memory**: a model big in weights and cheap in compute (:data:`MEMORY`) in two stages, built whole in every
worker and built per stage (``--materialize stage``): each worker's peak resident memory.
"""

from __future__ import annotations

import copy
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.bench._checks import require_known
from conveyor.bench._run import run_job
from conveyor.config import TrainConfig
from conveyor.errors import InputError
from conveyor.job import load_dataset, loss_and_optimizer, steady_rate, user_model
from conveyor.runtime import default_device, launch, split_model

__all__ = ["CASES", "MEMORY", "Case", "ModelsBenchConfig", "TwinMLP", "run"]


class TwinMLP(nn.Module):
    """The zoo's ``mlp`` (64 -> 128 -> 128 -> 10 with ReLUs, ``depth`` hidden layers of ``width``) written as a user
    would: a module with a ``forward``, not an ``nn.Sequential``."""

    def __init__(self, width: int = 128, depth: int = 2) -> None:
        super().__init__()
        self.hidden = nn.ModuleList(nn.Linear(64 if i == 0 else width, width) for i in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> Any:
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.out(x)


@dataclass(frozen=True)
class Case:
    """A model, its arguments and data, how it trains, and its zoo twin (``None``: there is none)."""

    model: str
    model_args: str = ""
    dataset: str = "digits"
    epochs: int = 4
    batch_size: int = 64
    optimizer: str = "sgd"
    lr: float = 0.05
    twin: str | None = None

    def train_config(self, **options: Any) -> TrainConfig:
        fields = {k: v for k, v in asdict(self).items() if k != "twin"}
        return TrainConfig.from_options(**fields, energy_meter="off", **options)


_GPT2 = "n_layer=2,n_embd=64,n_head=2,vocab_size=101,n_positions=32,bos_token_id=0,eos_token_id=0"
_RESNET = "num_channels=1,num_labels=10,embedding_size=16,hidden_sizes=[16,32],depths=[1,1]"
CASES = {
    "module-mlp": Case("conveyor.bench.models:TwinMLP", epochs=12, twin="mlp"),
    "gpt2": Case("transformers:GPT2LMHeadModel", _GPT2, "text", epochs=3, optimizer="adam", lr=3e-3),
    "resnet": Case("transformers:ResNetForImageClassification", _RESNET, "digit-images", epochs=4),
}
MEMORY = Case("conveyor.bench.models:TwinMLP", "width=4096,depth=4", epochs=2)
"""Big in weights (50.6M, 202 MB), cheap in compute: two stages built whole in every worker, and per stage."""


@dataclass(frozen=True)
class ModelsBenchConfig:
    """What ``conveyor bench models`` runs."""

    models: tuple[str, ...] = tuple(CASES)
    workers: int = 4
    epochs: int | None = None  # every case's, instead of its own (at least 2: the first is a warm-up)
    cases: dict[str, Case] = field(default_factory=lambda: CASES)
    memory: Case | None = MEMORY  # None: no memory comparison

    def __post_init__(self) -> None:
        require_known("models", self.models, self.cases)
        if self.workers < 2 or (self.epochs is not None and self.epochs < 2):
            raise InputError("--workers must be at least 2 and --epochs at least 2 (the first is a warm-up)")


def _plain_worker(case: Case) -> dict[str, Any]:
    """The plain loop on the model as written and on its split, from the same weights and batches: each one's
    epoch seconds and accuracy after each epoch."""
    cfg, device = case.train_config(), default_device()
    data = load_dataset(case.dataset, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model, example = user_model(case.model, case.batch_size, data, case.model_args)
    loss_fn, make_optimizer = loss_and_optimizer(cfg.optimizer, data.sequence)
    inputs = data.tensor_inputs("bench models' plain loop")
    x, y, test_x, test_y = (t.to(device) for t in (inputs[0], data.train_y, inputs[1], data.test_y))
    out = {}
    for name in ("unsplit", "split"):
        trained = copy.deepcopy(model).to(device)
        net = split_model(trained, example.to(device)) if name == "split" else trained
        optimizer = make_optimizer(list(trained.parameters()))
        seconds, accuracy = [], []
        for epoch in range(case.epochs):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(cfg.run.seed + epoch)).to(device)
            net.train()
            start = time.perf_counter()
            for index in order.split(case.batch_size):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(_logits(net(x[index])), y[index]).backward()
                optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
            net.eval()
            with torch.no_grad():
                accuracy.append((_logits(net(test_x)).argmax(-1) == test_y).double().mean().item())
        out[name] = {"epoch_seconds": seconds, "accuracy": accuracy, "samples": len(x)}
    return out


def _logits(output: Any) -> Any:
    return output["logits"] if isinstance(output, dict) or hasattr(output, "logits") else output


def _conveyor(cfg: TrainConfig) -> dict[str, Any]:
    """One ``conveyor train`` run: its layout, steady samples/s, accuracy per epoch and peak memory per worker."""
    summary = run_job(cfg)
    layout = summary.layout
    return {
        "samples_per_s": summary.steady_samples_per_s,
        "accuracy": summary.accuracy,
        "layout": {k: layout[k] for k in ("schedule", "balance", "replicas", "microbatches")},
        "peak_rss_bytes": summary.peak_rss_bytes,
    }


def _sharing(workers: int) -> dict[str, str]:
    """More workers than GPUs share them over gloo (NCCL takes one GPU per worker)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"backend": "gloo"} if 0 < gpus < workers else {}


def _measure(case: Case, workers: int, folder: Path) -> dict[str, Any]:
    plain = launch(_plain_worker, case, nprocs=1, timeout_s=3600)[0]
    unsplit, split = (steady_rate(plain[k]["epoch_seconds"], plain[k]["samples"]) for k in ("unsplit", "split"))
    one = _conveyor(case.train_config(workers=1, run_dir=str(folder / "one")))
    twin = None
    if case.twin is not None:
        twin_case = Case(**{**asdict(case), "model": case.twin, "model_args": "", "twin": None})
        twin = _conveyor(twin_case.train_config(workers=1, run_dir=str(folder / "twin")))
    return {
        "model": case.model,
        "model_args": case.model_args,
        "dataset": case.dataset,
        "plain_unsplit_samples_per_s": unsplit,
        "plain_split_samples_per_s": split,
        "split_over_unsplit": split / unsplit,
        "plain_accuracy": plain["unsplit"]["accuracy"],
        "plain_split_accuracy": plain["split"]["accuracy"],
        "conveyor_one_worker": one,
        "twin": None if twin is None else {"model": case.twin, **twin},
        "planned": _conveyor(case.train_config(workers=workers, run_dir=str(folder / "planned"), **_sharing(workers))),
        "two_stages": _conveyor(case.train_config(stages=2, run_dir=str(folder / "two-stages"), **_sharing(2))),
    }


def _memory(case: Case, folder: Path) -> dict[str, Any]:
    """``case`` in two stages, built whole in every worker and then per stage (``--materialize stage``)."""
    with torch.device("meta"):
        model, _ = user_model(case.model, case.batch_size, None, case.model_args)
    return {
        "model": case.model,
        "model_args": case.model_args,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        **{
            how: _conveyor(case.train_config(stages=2, materialize=how, run_dir=str(folder / how), **_sharing(2)))
            for how in ("whole", "stage")
        },
    }


def run(cfg: ModelsBenchConfig) -> dict[str, Any]:
    """Measure every case, then the memory case; the JSON-ready report (``config``, ``results``, ``memory``, the
    machine)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="conveyor-models-") as tmp:
        for name in cfg.models:
            case = cfg.cases[name]
            if cfg.epochs is not None:
                case = Case(**{**asdict(case), "epochs": cfg.epochs})
            results.append({"case": name, **_measure(case, cfg.workers, Path(tmp) / name)})
        memory = None if cfg.memory is None else _memory(cfg.memory, Path(tmp) / "memory")
    config = {k: v for k, v in asdict(cfg).items() if k != "cases"}
    config["cases"] = {name: asdict(cfg.cases[name]) for name in cfg.models}
    machine = {"cores": torch.get_num_threads(), "torch": torch.__version__}
    return {"config": config, "results": results, "memory": memory, "machine": machine}
