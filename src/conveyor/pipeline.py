"""The user-facing pipeline: one stage per worker, trained with a synchronous schedule.

Example (run with ``conveyor.launch(main, nprocs=2)`` or under ``torchrun --nproc_per_node 2``)::

    def main():
        torch.manual_seed(0)  # every worker builds the same model, then keeps its own stage
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        pipe = Pipeline(model, balance=[2, 1], microbatches=4, loss_fn=F.cross_entropy,
                        optimizer=partial(torch.optim.SGD, lr=0.1))
        for x, y in loader:
            loss = pipe.train_step(x, y)  # a float on the last stage, None elsewhere
        pipe.save("model.pt")             # the whole model under its original names
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from conveyor import checkpoint
from conveyor.comm import P2P
from conveyor.executor import Executor, LossFn
from conveyor.microbatch import split
from conveyor.schedule import forward_only, make_schedule
from conveyor.stage import Blocks, as_blocks, build_stage, stage_ranges
from conveyor.validate import validate

__all__ = ["OptimizerFactory", "Pipeline", "WorldSizeError"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class WorldSizeError(RuntimeError):
    """The job has a different number of workers than the pipeline has stages."""


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


class Pipeline:
    """A model split into stages, one per worker of the default process group.

    Every worker constructs the same full model and the same ``Pipeline``; each keeps only its stage.
    Worker ``r`` runs stage ``r``.

    Args:
        model: an ``nn.Sequential``, or a list of modules where each block's output is the next one's
            input (any pytree of tensors: a tensor, a tuple, a dict).
        balance: the number of consecutive blocks in each stage, e.g. ``[2, 2]``.
        microbatches: how many microbatches each batch is split into.
        loss_fn: ``loss_fn(output, target) -> scalar``, averaged over microbatches, as a batch loss.
        optimizer: builds the stage's optimizer from its parameters, e.g. ``partial(torch.optim.SGD, lr=0.1)``.
        schedule: ``"flush"`` (PipeDream-Flush, 1F1B) or ``"gpipe"``.
        device: this worker's device; default ``cuda:LOCAL_RANK`` with CUDA, else CPU.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        WorldSizeError: the world size is not the stage count.
        ValueError: the balance does not fit the model, or the schedule is unknown.
    """

    def __init__(
        self,
        model: Blocks,
        balance: Sequence[int],
        microbatches: int,
        loss_fn: LossFn,
        optimizer: OptimizerFactory | None = None,
        schedule: str = "flush",
        device: torch.device | str | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: run your function with conveyor.launch(fn, nprocs=N) "
                "or under torchrun"
            )
        blocks = as_blocks(model)
        ranges = stage_ranges(balance, len(blocks))
        world = dist.get_world_size()
        if world != len(ranges):
            raise WorldSizeError(
                f"the pipeline has {len(ranges)} stages but {world} workers were started: start {len(ranges)} "
                f"(launch(..., nprocs={len(ranges)}) or torchrun --nproc_per_node {len(ranges)}), or give "
                f"a balance with {world} stages"
            )
        self.stage = dist.get_rank()
        self.num_stages = len(ranges)
        self.device = torch.device(device) if device is not None else _default_device()
        self.microbatches = microbatches
        # The whole model's names and shapes, to check that a checkpoint belongs to this model.
        self._model_shapes = {f"{name}.{k}": v.shape for name, block in blocks for k, v in block.state_dict().items()}
        self.module = build_stage(model, ranges[self.stage]).to(self.device)
        params = list(self.module.parameters())
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        self.schedule = make_schedule(schedule, self.num_stages, microbatches)
        validate(self.schedule)
        self._eval_schedule = forward_only(self.num_stages, microbatches)
        self.executor = Executor(self.module, self.stage, range(world), P2P(self.device), loss_fn, self.device)
        self.steps = 0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def peak_stashed(self) -> int:
        """The most microbatches this worker has held for a pending backward so far."""
        return self.executor.peak_stashed

    def _split(self, data: Any, needed: bool, what: str) -> list[Any] | None:
        if not needed:
            return None
        if data is None:
            raise ValueError(f"stage {self.stage} needs the batch's {what}: pass them on this worker")
        return split(data, self.microbatches)

    def train_step(self, inputs: Any = None, targets: Any = None) -> float | None:
        """Run one optimizer step on a batch: the same update as gradient accumulation over its microbatches.

        Every worker calls it; the first stage needs ``inputs``, the last needs ``targets`` (passing
        both everywhere is simplest).

        Returns:
            The batch's mean loss on the last stage, ``None`` on the others.
        """
        self.module.train()
        out = self.executor.run(
            self.schedule,
            self._split(inputs, self.is_first, "inputs"),
            self._split(targets, self.is_last, "targets"),
            on_step=self._optimizer_step,
        )
        self.steps += 1
        return float(torch.stack(out.losses).mean()) if self.is_last else None

    def _optimizer_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, inputs: Any = None) -> Any:
        """Forward ``inputs`` through the pipeline (no gradients, nothing stashed).

        Returns:
            The model's output for the whole batch on the last stage, ``None`` on the others.
        """
        self.module.eval()
        out = self.executor.run(self._eval_schedule, self._split(inputs, self.is_first, "inputs"), None)
        if not self.is_last:
            return None
        return pytree.tree_map(
            lambda *parts: torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0], *out.outputs
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the whole model and optimizer to ``path`` (rank 0 writes; every worker must call it)."""
        cpu = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        opt = None if self.optimizer is None else checkpoint.named_optimizer_state(self.optimizer, self.module)
        parts: list[Any] = [None] * self.num_stages if self.stage == 0 else []
        dist.gather_object((cpu, opt), parts if self.stage == 0 else None, dst=0)
        if self.stage == 0:
            model = {k: v for state, _ in parts for k, v in state.items()}
            opts = [o for _, o in parts if o is not None]
            optim = {
                "state": {k: v for o in opts for k, v in o["state"].items()},
                "param_groups": opts[0]["param_groups"] if opts else [],
            }
            checkpoint.save(path, model, optimizer=optim, steps=self.steps)
        dist.barrier()  # the file is complete for everyone once save returns

    def load(self, path: str | os.PathLike[str]) -> None:
        """Load a checkpoint saved by any pipeline (any stage count) of this model, or from a plain model.

        Raises:
            CheckpointError: the file is unreadable or belongs to another model.
        """
        payload = checkpoint.load(path)
        checkpoint.check_compatible(payload["model"], self._model_shapes, str(path))
        mine = self.module.state_dict().keys()
        self.module.load_state_dict({k: payload["model"][k] for k in mine})
        if self.optimizer is not None and payload.get("optimizer"):
            checkpoint.set_optimizer_state(self.optimizer, self.module, payload["optimizer"])
        self.steps = int(payload.get("steps", 0))
