"""The user-facing pipeline: a model cut into stages, each run by one or more data-parallel workers.

Example (run with ``conveyor.launch(main, nprocs=3)`` or under ``torchrun --nproc_per_node 3``)::

    def main():
        torch.manual_seed(0)  # every worker builds the same model, then keeps its own stage
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        pipe = Pipeline(model, balance=[2, 1], microbatches=4, loss_fn=F.cross_entropy,
                        optimizer=partial(torch.optim.SGD, lr=0.1), schedule="pipedream", replicas=[2, 1])
        for epoch in range(10):
            losses = pipe.train(loader)   # one fill and one drain for the whole epoch, read as it goes
        pipe.save("model.pt")             # the whole model under its original names
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

import conveyor.runtime._checkpoint as checkpoint
from conveyor.errors import InputError
from conveyor.runtime._devices import default_device
from conveyor.runtime._executor import Executor, LossFn
from conveyor.runtime._materialize import Materialize, placed
from conveyor.runtime._microbatch import Parts, batch_means, split
from conveyor.runtime._outer import OuterSync, SiteLinks, gather_records, site_links
from conveyor.runtime._scheduled import Scheduled
from conveyor.runtime._solo import Alone
from conveyor.runtime._split import split_model
from conveyor.runtime._stage import (
    Blocks,
    StagePosition,
    WorldSizeError,
    as_blocks,
    block_shapes,
    build_stage,
    check_world_size,
    even_balance,
    stage_ranges,
)
from conveyor.runtime._transport import P2P
from conveyor.runtime._update import BUCKET_BYTES, OptimizerFactory, Updater, count_groups
from conveyor.runtime._versions import WeightVersions
from conveyor.schedule import (
    Schedule,
    check_replicas,
    forward_only,
    kind,
    make_schedule,
    stage_workers,
    validate,
    worker_stages,
)

__all__ = ["OptimizerFactory", "Pipeline", "WorldSizeError"]


class Pipeline(StagePosition):
    """A model split into stages over the workers of the default process group.

    Every worker constructs the same full model and the same ``Pipeline``; each keeps only its stage (a model
    built on the meta device takes no memory until each worker makes its stage real: ``materialize``).
    Workers are assigned stage by stage: with ``replicas=[2, 1]`` workers 0 and 1 run stage 0 and worker
    2 runs stage 1. Microbatch ``k`` runs on replica ``k % r`` of a stage with ``r`` replicas, and the
    replicas all-reduce their gradients in a process group of their own before each optimizer step, as
    ``DistributedDataParallel`` does; one stage with N replicas is plain data parallelism. No count needs
    to divide another: batches of any size are split into ``microbatches`` parts as equal as possible,
    and an update's gradient is always the mean over the samples it covers (:mod:`conveyor.runtime._update`).

    Schedules (see :mod:`conveyor.schedule`): ``"gpipe"`` and ``"flush"`` give exactly the update of
    gradient accumulation over each batch. The asynchronous ones keep the pipeline full across batches
    and pay one fill and one drain per :meth:`train` call: ``"pipedream"`` (every microbatch is a
    minibatch with its own update, weight stashing), ``"pipedream-vs"`` (the same with vertical sync) and
    ``"2bw"`` (one update per batch, computed on the weights one update old).

    Args:
        model: an ``nn.Sequential``, or a list of modules where each block's output is the next one's
            input (any pytree of tensors: a tensor, a tuple, a dict); or any module with ``example``.
        balance: the number of consecutive blocks in each stage, e.g. ``[2, 2]``; or the number of stages, of
            blocks as equal in number as can be.
        microbatches: how many microbatches each batch is split into.
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over a microbatch's samples.
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
        correct_staleness: for the asynchronous schedules, correct for stale gradients: each stage
            publishes its weights extrapolated over its staleness (weight prediction,
            :mod:`conveyor.runtime._versions`) and, where every minibatch is an update (PipeDream), its
            optimizer's learning rate is scaled by the fraction of a batch an update covers
            (:meth:`~conveyor.schedule.Kind.lr_scale`), so that ``lr`` is the rate of one batch for every
            schedule. ``False`` runs the schedules' plain update rules.
        damp_stale_rate: with ``correct_staleness``, also divide each stage's learning rate by one plus its
            staleness (the damped rate of :meth:`~conveyor.schedule.Kind.lr_scale`).
        bucket_bytes: replicas all-reduce their gradients in buckets of about this size, each started as soon
            as the last backward of an update has made its gradients (as ``DistributedDataParallel``'s
            ``bucket_cap_mb``).
        debug: check at every backward that the microbatch's weights are the ones its forward used.
        materialize: for a model built on the meta device, how this worker gives its stage real tensors
            (:func:`~conveyor.runtime.initialise_from` or :func:`~conveyor.runtime.load_from`): the other stages'
            take no memory here.
        example: an input batch, to split a ``model`` that is neither an ``nn.Sequential`` nor a list with
            :func:`~conveyor.runtime.split_model` (every worker traces it alike).
        outer: the workers sit in ``outer.sites`` sites joined by a WAN (ranks handed out site by site): a stage's
            replicas all-reduce within their site, and ``outer`` keeps the sites in step (:mod:`conveyor.gaia`).
            Needs a schedule with one update per batch (``gpipe``, ``flush``).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        WorldSizeError: the world size is not the number of workers the stages and replicas need.
        ValueError: the balance does not fit the model, or the schedule or replicas are invalid.
    """

    def __init__(
        self,
        model: Blocks | nn.Module,
        balance: list[int] | int,
        *,
        microbatches: int,
        loss_fn: LossFn,
        optimizer: OptimizerFactory | None = None,
        schedule: str = "flush",
        replicas: list[int] | tuple[int, ...] | None = None,
        device: torch.device | str | None = None,
        max_grad_norm: float | None = None,
        autocast: torch.dtype | None = None,
        recompute: bool = False,
        correct_staleness: bool = True,
        damp_stale_rate: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
        debug: bool = False,
        materialize: Materialize | None = None,
        example: Any = None,
        outer: OuterSync | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: run your function with conveyor.launch(fn, nprocs=N) "
                "or under torchrun"
            )
        whole = model
        if isinstance(model, nn.Module) and not isinstance(model, nn.Sequential) and example is not None:
            whole = split_model(model, example)
        blocks = as_blocks(whole)  # (a single module without an example fails here, saying to give one)
        ranges = stage_ranges(even_balance(len(blocks), balance) if isinstance(balance, int) else balance, len(blocks))
        self.kind = kind(schedule)
        self.replicas = check_replicas(len(ranges), replicas)
        self.microbatches = microbatches
        for steps in sorted({1, 2, 2 + math.lcm(*self.replicas)}):
            self.schedule(steps)  # a bad layout fails here, before any worker waits for another
        world = dist.get_world_size()
        check_world_size(world, self.replicas)
        self.worker = dist.get_rank()
        self.worker_stage = worker_stages(self.replicas)
        self.stage = self.worker_stage[self.worker]
        self.num_stages = len(ranges)
        self.device = torch.device(device) if device is not None else default_device()
        # The whole model's names and shapes, to check that a checkpoint belongs to this model.
        self._model_shapes = block_shapes(blocks)
        self.module = placed(build_stage(whole, ranges[self.stage]), self.device, materialize)
        params = list(self.module.parameters())
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        if correct_staleness and self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] *= self.kind.lr_scale(self.stage, self.replicas, microbatches, damped=damp_stale_rate)
        updater = self._updater(outer, max_grad_norm=max_grad_norm, bucket_bytes=bucket_bytes)
        self._eval_schedule = forward_only(self.num_stages, microbatches, self.replicas)
        self.executor = Executor(
            self.module,
            stage=self.stage,
            stages=self.num_stages,
            rank_of_worker=list(range(world)),
            p2p=P2P(self.device),
            loss_fn=loss_fn,
            device=self.device,
            weights=WeightVersions(self.module, debug=debug),
            updater=updater,
            autocast=autocast,
            recompute=recompute,
        )
        self._alone, self._scheduled = self._runners(
            updater, loss_fn=loss_fn, autocast=autocast, recompute=recompute, correct_staleness=correct_staleness
        )
        self.steps = 0  # batches trained on
        self.updates = 0  # this worker's optimizer steps

    def _updater(self, outer: OuterSync | None, *, max_grad_norm: float | None, bucket_bytes: int) -> Updater:
        """The process groups (every worker creates every group, in the same order, as torch.distributed requires)
        and this worker's :class:`Updater`: its replicas all-reduce in its stage's group, or in its site's where
        ``outer`` joins sites."""
        self._stage_workers = stage_workers(self.replicas)
        groups = [dist.new_group(ws) if len(ws) > 1 else None for ws in self._stage_workers]
        self._replica_group = groups[self.stage]
        self.outer = outer
        self._site: SiteLinks | None = None  # where this worker's stage spans sites
        reduce_group = self._site_links(outer) if outer is not None else self._replica_group
        return Updater(
            self.module,
            self.optimizer,
            group=reduce_group,
            max_grad_norm=max_grad_norm,
            clip_whole_model=self.kind.synchronous,
            replicas=self.replicas[self.stage],
            device=self.device,
            bucket_bytes=bucket_bytes,
            count_group=count_groups(groups, self._stage_workers, self.device)[self.stage] if outer is None else None,
            averaged=self.kind.update == "batch" and not (outer is not None and outer.site_mean),
            outer=outer if self._site is not None else None,
        )

    def _runners(
        self,
        updater: Updater,
        *,
        loss_fn: LossFn,
        autocast: torch.dtype | None,
        recompute: bool,
        correct_staleness: bool,
    ) -> tuple[Alone | None, Scheduled]:
        """What trains a batch: the schedule's action lists, and, for one worker that keeps no weight versions
        (every schedule but 2BW's), nothing to schedule: a plain loop's steps."""
        stashing = self.kind.stashes(self.replicas, self.stage)
        alone = (
            Alone(
                self.module,
                microbatches=self.microbatches,
                loss_fn=loss_fn,
                updater=updater,
                device=self.device,
                per_microbatch=self.kind.update == "round",
                autocast=autocast,
                recompute=recompute,
            )
            if sum(self.replicas) == 1 and self.outer is None and not stashing  # the world, as checked
            else None
        )
        scheduled = Scheduled(
            kind=self.kind,
            executor=self.executor,
            worker=self.worker,
            first_replica=self._workers_of(self.stage)[0],
            stage=self.stage,
            replicas=self.replicas,
            microbatches=self.microbatches,
            stashing=stashing,
            predict=self.kind.staleness(self.stage, self.replicas) if correct_staleness else 0,
        )
        return alone, scheduled

    def _site_links(self, outer: OuterSync) -> dist.ProcessGroup | None:
        """The site group this worker's replicas all-reduce in; its links attached to ``outer`` where its stage
        spans sites. (The sample count then rides in the last bucket: the exchange waits on the host anyway.)"""
        if not self.kind.synchronous:
            raise ValueError(
                f"an outer sync across sites needs a synchronous schedule (gpipe, flush), not {self.kind.name}"
            )
        group, self._site = site_links(self._stage_workers, self.stage, outer.sites, self.device)
        if self._site is not None:
            outer.attach(list(self.module.parameters()), self._site)
        return group

    def gather_records(self) -> None:
        """No step records: a pipeline of fixed work keeps none (a flexible pipeline's go to stragglers.jsonl)."""
        return None

    def wan_records(self) -> list[dict[str, Any]] | None:
        """Every site leader's outer-sync counts since the last call, gathered on worker 0 (``None`` elsewhere, or
        without an outer sync)."""
        if self.outer is None:
            return None
        return gather_records(self.outer, self._site)

    def _workers_of(self, stage: int) -> list[int]:
        return self._stage_workers[stage]

    @property
    def schedule_name(self) -> str:
        return self.kind.name

    @property
    def is_output(self) -> bool:
        """Whether this worker reports losses and evaluation outputs: the first replica of the last stage."""
        return self.worker == self._workers_of(self.num_stages - 1)[0]

    @property
    def peak_stashed(self) -> int:
        """The most microbatches this worker has held for a pending backward so far."""
        return self._alone.peak_stashed if self._alone is not None else self.executor.peak_stashed

    @property
    def peak_versions(self) -> int:
        """The most weight versions this worker has held at once (1 when no schedule stashed weights)."""
        return self.executor.weights.peak

    def schedule(self, steps: int) -> Schedule:
        """The validated action lists of a run of ``steps`` batches (what :meth:`train` generates as it goes)."""
        sched = make_schedule(self.kind.name, len(self.replicas), self.microbatches, steps, self.replicas)
        validate(sched)
        return sched

    def train_step(self, inputs: Any = None, targets: Any = None) -> float | None:
        """Run one batch: with ``"gpipe"`` or ``"flush"`` the same update as gradient accumulation over its
        microbatches. An asynchronous schedule fills and drains the pipeline for this one batch: give it
        many batches at once with :meth:`train`.

        The first stage needs ``inputs``, the last ``targets`` (passing both everywhere is simplest).

        Returns:
            The batch's mean loss on the first replica of the last stage, ``None`` elsewhere.
        """
        losses = self.train([(inputs, targets)])
        return None if losses is None else losses[0]

    def train(
        self, batches: Iterable[tuple[Any, Any]] | None, on_step: Callable[[int], None] | None = None
    ) -> list[float] | None:
        """Train on every ``(inputs, targets)`` batch of ``batches`` in one run of the schedule.

        ``batches`` may be any iterable, a ``DataLoader`` or a generator of any length: it is read as the
        run goes, never held whole. Only the first stage reads inputs and only the last reads targets, each
        from its own copy of the same batches in the same order (seed any shuffling alike); other workers
        may pass ``None``. The run ends drained: every stage's weights have seen every batch, so
        :meth:`save` and :meth:`evaluate` after it are consistent. A pipeline of one worker follows no schedule
        (but under ``2bw``): it makes the same updates in a plain loop (:mod:`conveyor.runtime._solo`).

        Args:
            batches: the batches (see above).
            on_step: called with this worker's optimizer step count after each of its steps.

        Returns:
            Each batch's loss (the mean over its samples) on the first replica of the last stage, ``None``
            elsewhere.
        """
        if (self.is_first or self.is_last) and batches is None:
            raise InputError(f"stage {self.stage} reads the batches: pass them on worker {self.worker}")

        def stepped() -> None:
            self.updates += 1
            if on_step is not None:
                on_step(self.updates)

        self.module.train()
        if self._alone is not None:
            assert batches is not None
            out, count = self._alone.run(batches, stepped)
        else:
            out, count = self._scheduled.run(batches, stepped)
        self.steps += count
        return self._batch_losses(out.loss_values(), count)

    def _batch_losses(self, losses: dict[int, tuple[float, int]], count: int) -> list[float] | None:
        """Gather the last stage's per-microbatch losses on its first replica; per-batch means over samples."""
        group = self._workers_of(self.num_stages - 1)
        if len(group) > 1 and self.is_last:
            parts: list[Any] = [None] * len(group) if self.is_output else []
            dst = group[0]
            dist.gather_object(losses, parts if self.is_output else None, dst=dst, group=self._replica_group)
            if self.is_output:
                losses = {k: v for part in parts for k, v in part.items()}
        if not self.is_output:
            return None
        return batch_means(losses, count, self.microbatches)

    @torch.no_grad()
    def evaluate(self, inputs: Any = None) -> Any:
        """Forward ``inputs`` through the first replica of every stage (no gradients, nothing stashed).

        Every worker calls it; worker 0 needs ``inputs``.

        Returns:
            The model's output for the whole batch on the first replica of the last stage (see
            :attr:`is_output`), ``None`` elsewhere.
        """
        self.module.eval()
        feed = None
        if self.worker == 0:
            if inputs is None:
                raise InputError("worker 0 needs the batch's inputs to evaluate: pass them on this worker")
            feed = Parts(split(inputs, self.microbatches))
        out = self.executor.run(self._eval_schedule.actions[self.worker], feed, training=False)
        if not self.is_output:
            return None
        return pytree.tree_map(
            lambda *parts: torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0], *out.outputs
        )

    def save(self, path: str | os.PathLike[str], extra: Mapping[str, Any] | None = None) -> None:
        """Write the whole model and optimizer to ``path`` (worker 0 writes; every worker must call it), with
        worker 0's ``extra`` entries of plain data beside them (``conveyor train`` keeps the run's epochs there).

        Call it between runs (after :meth:`train` returns): a run ends drained, so every stage's weights
        have then seen the same batches, and replicas of a stage hold equal weights.
        """
        first_replica = self.worker == self._workers_of(self.stage)[0]
        checkpoint.save_stages(path, self.module, self.optimizer, first_replica, self.steps, extra)
        if self.outer is not None and self._site is not None and self._site.is_leader:  # each site its own, atomically
            checkpoint.save(self._site.state_path(path, self.stage), self.outer.state_dict())

    def load(self, path: str | os.PathLike[str]) -> None:
        """Load a checkpoint saved by any pipeline (any stage count) of this model, or from a plain model.

        Raises:
            CheckpointError: the file is unreadable or belongs to another model.
        """
        self.steps = checkpoint.load_stage(path, self.module, self.optimizer, self._model_shapes)
        site_path = self._site.state_path(path, self.stage) if self._site is not None else None
        if self.outer is not None and site_path is not None and os.path.exists(site_path):
            self.outer.load_state_dict(checkpoint.load(site_path)["model"])
