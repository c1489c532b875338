"""The user-facing pipeline: a model cut into stages, each run by one or more data-parallel workers.

Example (run with ``conveyor.launch(main, nprocs=3)`` or under ``torchrun --nproc_per_node 3``)::

    def main():
        torch.manual_seed(0)  # every worker builds the same model, then keeps its own stage
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        pipe = Pipeline(model, balance=[2, 1], microbatches=4, loss_fn=F.cross_entropy,
                        optimizer=partial(torch.optim.SGD, lr=0.1), schedule="pipedream", replicas=[2, 1])
        for epoch in range(10):
            losses = pipe.train(loader)   # one fill and one drain for the whole epoch
        pipe.save("model.pt")             # the whole model under its original names
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

import conveyor.runtime._checkpoint as checkpoint
from conveyor.runtime._executor import Executor, LossFn
from conveyor.runtime._microbatch import split
from conveyor.runtime._stage import Blocks, as_blocks, build_stage, stage_ranges
from conveyor.runtime._transport import P2P
from conveyor.runtime._versions import WeightVersions
from conveyor.schedule._schedule import ASYNCHRONOUS, Schedule, forward_only, make_schedule
from conveyor.schedule._validate import validate

__all__ = ["OptimizerFactory", "Pipeline", "WorldSizeError"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class WorldSizeError(RuntimeError):
    """The job has a different number of workers than the pipeline's stages and replicas need."""


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


class Pipeline:
    """A model split into stages over the workers of the default process group.

    Every worker constructs the same full model and the same ``Pipeline``; each keeps only its stage.
    Workers are assigned stage by stage: with ``replicas=[2, 1]`` workers 0 and 1 run stage 0 and worker
    2 runs stage 1. Replicas of a stage all-reduce their gradients in a process group of their own
    before each optimizer step, as ``DistributedDataParallel`` does; one stage with N replicas is plain
    data parallelism.

    Schedules (see :mod:`conveyor.schedule._schedule`): ``"gpipe"`` and ``"flush"`` give exactly the update of
    gradient accumulation over each batch's microbatches. The asynchronous ones keep the pipeline full
    across batches and pay one fill and one drain per :meth:`train` call: ``"pipedream"`` (every
    microbatch is a minibatch with its own update, weight stashing), ``"pipedream-vs"`` (the same with
    vertical sync) and ``"2bw"`` (one update per batch, computed on the weights one update old).

    Args:
        model: an ``nn.Sequential``, or a list of modules where each block's output is the next one's
            input (any pytree of tensors: a tensor, a tuple, a dict).
        balance: the number of consecutive blocks in each stage, e.g. ``[2, 2]``.
        microbatches: how many microbatches each batch is split into.
        loss_fn: ``loss_fn(output, target) -> scalar``, averaged over microbatches, as a batch loss.
        optimizer: builds a stage's optimizer from its parameters, e.g. ``partial(torch.optim.SGD, lr=0.1)``.
        schedule: ``"flush"``, ``"gpipe"``, ``"pipedream"``, ``"pipedream-vs"`` or ``"2bw"``.
        replicas: data-parallel workers per stage (default one each); the job needs ``sum(replicas)``.
        device: this worker's device; default ``cuda:LOCAL_RANK`` with CUDA, else CPU.
        max_grad_norm: clip gradients to this norm before each step: the whole model's norm with a
            synchronous schedule (as ``clip_grad_norm_`` on the unsplit model), each stage's own norm
            with an asynchronous one, whose stages step at different times.
        autocast: run forwards and the loss under ``torch.autocast`` with this dtype (``torch.bfloat16``);
            the weights and the optimizer stay in their own dtype.
        recompute: stash only each microbatch's stage input and re-run its forward in the backward
            (activation recomputation; random state such as dropout's is replayed). BatchNorm's running
            statistics see the batch twice.
        debug: check at every backward that the microbatch's weights are the ones its forward used.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        WorldSizeError: the world size is not the number of workers the stages and replicas need.
        ValueError: the balance does not fit the model, or the schedule or replicas are invalid.
    """

    def __init__(
        self,
        model: Blocks,
        balance: Sequence[int],
        microbatches: int,
        loss_fn: LossFn,
        optimizer: OptimizerFactory | None = None,
        schedule: str = "flush",
        replicas: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        max_grad_norm: float | None = None,
        autocast: torch.dtype | None = None,
        recompute: bool = False,
        debug: bool = False,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: run your function with conveyor.launch(fn, nprocs=N) "
                "or under torchrun"
            )
        blocks = as_blocks(model)
        ranges = stage_ranges(balance, len(blocks))
        self.replicas = tuple(replicas) if replicas is not None else (1,) * len(ranges)
        self.schedule_name = schedule
        self.microbatches = microbatches
        # A bad name or layout fails here, before any worker waits for another.
        make_schedule(schedule, len(ranges), microbatches, math.lcm(*self.replicas), self.replicas)
        world, workers = dist.get_world_size(), sum(self.replicas)
        if world != workers:
            layout = "-".join(map(str, self.replicas))
            raise WorldSizeError(
                f"the pipeline has {len(ranges)} stages with replicas {layout}, which need {workers} workers, "
                f"but {world} were started: start {workers} (launch(..., nprocs={workers}) or torchrun "
                f"--nproc_per_node {workers}), or give a balance and replicas for {world} workers"
            )
        self.worker = dist.get_rank()
        self.worker_stage = tuple(s for s, r in enumerate(self.replicas) for _ in range(r))
        self.stage = self.worker_stage[self.worker]
        self.num_stages = len(ranges)
        self.device = torch.device(device) if device is not None else _default_device()
        self.max_grad_norm = max_grad_norm
        # The whole model's names and shapes, to check that a checkpoint belongs to this model.
        self._model_shapes = {f"{name}.{k}": v.shape for name, block in blocks for k, v in block.state_dict().items()}
        self.module = build_stage(model, ranges[self.stage]).to(self.device)
        params = list(self.module.parameters())
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        # Every worker creates every group, in the same order, as torch.distributed requires.
        groups = [dist.new_group(self._workers_of(s)) if r > 1 else None for s, r in enumerate(self.replicas)]
        self._replica_group = groups[self.stage]
        self._schedules: dict[int, Schedule] = {}
        self._eval_schedule = forward_only(self.num_stages, microbatches, self.replicas)
        weights = WeightVersions(self.module, debug=debug)
        p2p = P2P(self.device)
        self.executor = Executor(
            self.module, self.worker, range(world), p2p, loss_fn, self.device, weights, autocast, recompute
        )
        self.steps = 0  # batches trained on
        self.updates = 0  # this worker's optimizer steps

    def _workers_of(self, stage: int) -> list[int]:
        return [w for w, s in enumerate(self.worker_stage) if s == stage]

    @property
    def is_first(self) -> bool:
        """Whether this worker runs the first stage (and so needs the inputs)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this worker runs the last stage (and so needs the targets)."""
        return self.stage == self.num_stages - 1

    @property
    def is_output(self) -> bool:
        """Whether this worker reports losses and evaluation outputs: the first replica of the last stage."""
        return self.worker == self._workers_of(self.num_stages - 1)[0]

    @property
    def peak_stashed(self) -> int:
        """The most microbatches this worker has held for a pending backward so far."""
        return self.executor.peak_stashed

    @property
    def peak_versions(self) -> int:
        """The most weight versions this worker has held at once (1 when no schedule stashed weights)."""
        return self.executor.weights.peak

    def schedule(self, steps: int) -> Schedule:
        """The validated schedule of a run of ``steps`` batches."""
        if steps not in self._schedules:
            sched = make_schedule(self.schedule_name, self.num_stages, self.microbatches, steps, self.replicas)
            validate(sched)
            self._schedules[steps] = sched
        return self._schedules[steps]

    def train_step(self, inputs: Any = None, targets: Any = None) -> float | None:
        """Run one batch: with ``"gpipe"`` or ``"flush"`` the same update as gradient accumulation over its
        microbatches. An asynchronous schedule fills and drains the pipeline for this one batch: give it
        many batches at once with :meth:`train`.

        Every worker calls it; the first stage needs ``inputs``, the last needs ``targets`` (passing
        both everywhere is simplest).

        Returns:
            The batch's mean loss on the first replica of the last stage, ``None`` elsewhere.
        """
        losses = self.train([(inputs, targets)])
        return None if losses is None else losses[0]

    def train(
        self, batches: Iterable[tuple[Any, Any]], on_step: Callable[[int], None] | None = None
    ) -> list[float] | None:
        """Train on every ``(inputs, targets)`` batch of ``batches`` in one run of the schedule.

        Every worker calls it with the same batches in the same order (seed any shuffling alike); a
        worker reads only the parts its stage needs. The run ends drained: every stage's weights have
        seen every batch, so :meth:`save` and :meth:`evaluate` after it are consistent.

        Args:
            batches: a sequence of batches (an iterable such as a DataLoader is read into a list first).
            on_step: called with this worker's optimizer step count after each of its steps.

        Returns:
            Each batch's mean loss on the first replica of the last stage, ``None`` elsewhere.
        """
        batches = batches if isinstance(batches, Sequence) else list(batches)
        if not batches:
            return [] if self.is_output else None
        sched = self.schedule(len(batches))
        inputs = self._microbatches(batches, 0) if self.is_first else None
        targets = self._microbatches(batches, 1) if self.is_last else None
        # The loss is scaled for the last stage's update size; this stage's updates may cover another count.
        factor = sched.update_size(self.num_stages - 1) / sched.update_size(self.stage)
        self.module.train()
        out = self.executor.run(
            sched,
            inputs,
            targets,
            on_step=lambda: self._optimizer_step(factor, on_step),
        )
        self.steps += len(batches)
        return self._batch_losses(out.losses, len(batches))

    def _microbatches(self, batches: Sequence[tuple[Any, Any]], index: int) -> list[Any]:
        """Element ``index`` (0: inputs, 1: targets) of every batch, split into microbatches (views)."""
        parts = []
        for batch in batches:
            if batch[index] is None:
                what = "inputs" if index == 0 else "targets"
                raise ValueError(f"stage {self.stage} needs the batch's {what}: pass them on this worker")
            parts += split(batch[index], self.microbatches)
        return parts

    def _batch_losses(self, losses: dict[int, torch.Tensor], count: int) -> list[float] | None:
        """Gather the last stage's per-microbatch losses on its first replica; per-batch means."""
        group = self._workers_of(self.num_stages - 1)
        if len(group) > 1 and self.is_last:
            parts: list[Any] = [None] * len(group) if self.is_output else []
            dist.gather_object(
                {k: float(v) for k, v in losses.items()},
                parts if self.is_output else None,
                dst=group[0],
                group=self._replica_group,
            )
            if self.is_output:
                losses = {k: torch.tensor(v) for part in parts for k, v in part.items()}
        if not self.is_output:
            return None
        m = self.microbatches
        return [float(torch.stack([losses[b * m + i] for i in range(m)]).mean()) for b in range(count)]

    def _optimizer_step(self, factor: float, on_step: Callable[[int], None] | None) -> None:
        """All-reduce the replicas' gradients, scale them by ``factor`` into the mean over the update's
        microbatches, clip, step."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self._replica_group is not None and params:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._replica_group)
            for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad = g.view_as(p)
        if factor != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        if self.max_grad_norm is not None:
            self._clip(params)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        if on_step is not None:
            on_step(self.updates)

    def _clip(self, params: list[nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if self.schedule_name in ASYNCHRONOUS:
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            return
        # Synchronous: every worker steps once per batch, so the whole model's norm can be agreed on;
        # replicas hold equal gradients after the all-reduce, so each stage counts once.
        sq = sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=self.device))
        sq = sq / self.replicas[self.stage]
        dist.all_reduce(sq)
        coef = torch.clamp(self.max_grad_norm / (sq.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))

    @torch.no_grad()
    def evaluate(self, inputs: Any = None) -> Any:
        """Forward ``inputs`` through the first replica of every stage (no gradients, nothing stashed).

        Every worker calls it; worker 0 needs ``inputs``.

        Returns:
            The model's output for the whole batch on the first replica of the last stage (see
            :attr:`is_output`), ``None`` elsewhere.
        """
        self.module.eval()
        parts = None
        if self.worker == 0:
            if inputs is None:
                raise ValueError("worker 0 needs the batch's inputs to evaluate: pass them on this worker")
            parts = split(inputs, self.microbatches)
        out = self.executor.run(self._eval_schedule, parts, None)
        if not self.is_output:
            return None
        return pytree.tree_map(
            lambda *parts: torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0], *out.outputs
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the whole model and optimizer to ``path`` (worker 0 writes; every worker must call it).

        Call it between runs (after :meth:`train` returns): a run ends drained, so every stage's weights
        have then seen the same batches, and replicas of a stage hold equal weights.
        """
        first_replica = self.worker == self._workers_of(self.stage)[0]
        state = None
        if first_replica:
            cpu = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
            opt = None if self.optimizer is None else checkpoint.named_optimizer_state(self.optimizer, self.module)
            state = (cpu, opt)
        parts: list[Any] = [None] * len(self.worker_stage) if self.worker == 0 else []
        dist.gather_object(state, parts if self.worker == 0 else None, dst=0)
        if self.worker == 0:
            states = [p for p in parts if p is not None]
            model = {k: v for weights, _ in states for k, v in weights.items()}
            opts = [o for _, o in states if o is not None]
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
