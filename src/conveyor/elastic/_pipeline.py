"""Elastic pipelines: the planner's stages and replicas for each generation's workers, and a step through them.

Every generation re-plans: :func:`planned_layouts` asks the planner (:func:`conveyor.plan.optimize`, GPipe's
memory model, the job's profile) for the layout of the generation's computing workers, so a pipeline
becomes shorter, or its stages lose replicas, as workers go, and grows as they come. Workers take stages in
order (``replicas = (2, 1)``: the first two computing workers run stage 0).

A step (:class:`StagedStep`) is GPipe's: the batch is cut into ``M`` microbatches, microbatch ``k`` runs on
replica ``k % r_s`` of stage ``s``; every forward, then every backward in reverse order; the replicas of a
stage all-reduce their gradient sums and update their stage identically:

    g_s(t) = sum_k n_k grad_s l_k(W(t)) / sum_k n_k,    W_s(t + 1) = opt(W_s(t), g_s(t))

which is the single-process update of the whole batch for an elementwise optimizer. A stage's parameters
are a range of the flat weights (:mod:`conveyor.elastic._state`), so a stage is a shard whose holders are
its replicas: any surviving replica can hand it over, and its first replica backs it up to the reliable tier.

Example:
    >>> from conveyor.plan import Profile
    >>> profile = Profile.chain("m", [1e-3] * 5, [2e-3] * 5, [1000] * 5, [4_000_000, 0, 4_000_000, 0, 4000])
    >>> layout = planned_layouts(profile, bandwidth=1e9, microbatches=4)
    >>> layout(3), layout(2)
    (StageLayout(balance=(2, 3), replicas=(1, 2)), StageLayout(balance=(2, 3), replicas=(1, 1)))
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from conveyor.elastic._comm import Waiting, Watch
from conveyor.elastic._tiers import shard_bounds
from conveyor.errors import InputError
from conveyor.plan import Profile, Topology, optimize

__all__ = ["Shard", "StageLayout", "StagedStep", "agreed_layouts", "planned_layouts"]

Shard = tuple[tuple[int, ...], tuple[int, int], tuple[int, int]]  # holders, weight bounds, buffer bounds


@dataclass(frozen=True)
class StageLayout:
    """Blocks and replicas per stage."""

    balance: tuple[int, ...]
    replicas: tuple[int, ...]

    def stage_workers(self, compute: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The workers of each stage, taken in order from ``compute``."""
        out, first = [], 0
        for r in self.replicas:
            out.append(tuple(compute[first : first + r]))
            first += r
        return out


def planned_layouts(profile: Profile, bandwidth: float, microbatches: int) -> Callable[[int], StageLayout]:
    """The planner's layout for any number of workers on links of ``bandwidth`` bytes/s (the same answer on
    every worker: the same profile, the same deterministic search)."""

    @functools.cache
    def layout(workers: int) -> StageLayout:
        topology = Topology.parse(f"{workers}:{bandwidth:g}")
        plan = optimize(profile, topology, schedule="gpipe", microbatches=microbatches)
        return StageLayout(tuple(plan.balance), tuple(plan.replicas))

    return layout


def agreed_layouts(layout: Callable[[int], StageLayout], store: Any) -> Callable[[int], StageLayout]:
    """``layout``, as the first worker to plan each worker count wrote it to the job's c10d store: workers
    whose planners could break a tie differently (a joiner on another machine) still run the same one."""

    @functools.cache
    def agreed(workers: int) -> StageLayout:
        mine = json.dumps(asdict(layout(workers)))
        first = json.loads(store.compare_set(f"layout/{workers}", "", mine))
        return StageLayout(tuple(first["balance"]), tuple(first["replicas"]))

    return agreed


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


class StagedStep:
    """The blocks of a model as stages of flat weight and buffer ranges, and one GPipe step through them.

    Args:
        model: an ``nn.Sequential`` (its children are the blocks the planner cuts between).
        microbatches: ``M``, microbatches per step.
        example: a batch of inputs (one sample of it gives the shape a stage receives).

    Raises:
        TypeError: the model is not an ``nn.Sequential``.
        ValueError: a block appears twice, or a parameter is shared between blocks (a stage must own its
            parameters; the planner's profile counts each block once).
    """

    def __init__(self, model: nn.Module, microbatches: int, example: torch.Tensor) -> None:
        if not isinstance(model, nn.Sequential):
            raise TypeError(f"an elastic pipeline cuts an nn.Sequential between its blocks, got {type(model).__name__}")
        self.blocks = list(model)
        if len(self.blocks) != len(list(model.children())):  # the profile (children) would count fewer blocks
            raise InputError(
                "a block appears twice in the nn.Sequential: an elastic pipeline needs each block once "
                "(make a second instance of it)"
            )
        params = [sum(p.numel() for p in b.parameters() if p.requires_grad) for b in self.blocks]
        if sum(params) != sum(p.numel() for p in model.parameters() if p.requires_grad):
            raise InputError("a parameter is shared between blocks: an elastic pipeline needs blocks that own theirs")
        buffers = [sum(b.numel() for b in blk.buffers() if b.is_floating_point()) for blk in self.blocks]
        self.param_at, self.buffer_at = _offsets(params), _offsets(buffers)
        self.microbatches = microbatches
        self.in_shape, self.in_dtype = _block_inputs(self.blocks, example)

    def shards(self, layout: StageLayout, compute: tuple[int, ...]) -> list[Shard]:
        """Each stage as a shard: its workers, its weights' and its buffers' ranges.

        Raises:
            ValueError: the layout does not cover every block with every computing worker.
        """
        if sum(layout.balance) != len(self.blocks) or sum(layout.replicas) != len(compute):
            raise InputError(
                f"{layout} does not fit {len(self.blocks)} blocks on {len(compute)} workers: plan the "
                "layout from a profile of this model for this many workers"
            )
        out, first = [], 0
        for workers, n in zip(layout.stage_workers(compute), layout.balance, strict=True):
            last = first + n
            out.append(
                (workers, (self.param_at[first], self.param_at[last]), (self.buffer_at[first], self.buffer_at[last]))
            )
            first = last
        return out

    def stage_of(self, layout: StageLayout, compute: tuple[int, ...], worker: int) -> tuple[int, int, nn.Sequential]:
        """``worker``'s stage, its first block and its blocks."""
        first = 0
        for s, (workers, n) in enumerate(zip(layout.stage_workers(compute), layout.balance, strict=True)):
            if worker in workers:
                return s, first, nn.Sequential(*self.blocks[first : first + n])
            first += n
        raise InputError(f"worker {worker} computes nothing in {layout}")

    def run(
        self,
        watch: Watch,
        group: Any,
        *,
        layout: StageLayout,
        compute: tuple[int, ...],
        worker: int,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> tuple[float, int]:
        """Run this worker's forwards and backwards of one batch (``inputs``, ``targets``: the whole batch);
        its stage's gradients are left in its parameters' ``.grad`` as sums ``sum_k n_k grad l_k``; returns
        its loss sum (the last stage's, 0 elsewhere) and how many samples it ran."""
        s, first, stage = self.stage_of(layout, compute, worker)
        workers = layout.stage_workers(compute)
        rank = {w: i for i, w in enumerate(compute)}  # ranks in the group of the computing workers
        parts = shard_bounds(len(inputs), max(self.microbatches, *layout.replicas))  # every replica gets work
        mine = [k for k in range(len(parts)) if workers[s][k % len(workers[s])] == worker and parts[k][1] > parts[k][0]]
        last = s == len(workers) - 1

        def peer(stage: int, k: int) -> int:
            return rank[workers[stage][k % len(workers[stage])]]

        sends: list[Waiting] = []
        kept: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        device = inputs.device
        loss_sum = torch.zeros((), device=device)  # read once, at the end: not a wait for the GPU per microbatch
        for k in mine:
            a, b = parts[k]
            x: torch.Tensor | None = None
            if s == 0:
                out = stage(inputs[a:b])
            else:  # messages cross in host memory (the group is gloo's), tensors compute on the device
                host = torch.empty((b - a, *self.in_shape[first]), dtype=self.in_dtype[first])
                watch.wait(group.recv([host], peer(s - 1, k), k), stepping=True)
                x = host.to(device).requires_grad_()
                out = stage(x)
            if last:
                out = loss_fn(out, targets[a:b]) * (b - a)
                loss_sum += out.detach()
            else:
                sends.append(Waiting(group.send([out.detach().cpu().contiguous()], peer(s + 1, k), k)))
            kept[k] = (x, out)
        for k in reversed(mine):
            x, out = kept.pop(k)
            if last:
                out.backward()
            else:
                grad = torch.empty(out.shape, dtype=out.dtype)
                watch.wait(group.recv([grad], peer(s + 1, k), len(parts) + k), stepping=True)
                if out.requires_grad:  # (not in a first stage without parameters: nothing to differentiate)
                    out.backward(grad.to(device))
            if x is not None:
                assert x.grad is not None
                sends.append(Waiting(group.send([x.grad.cpu()], peer(s - 1, k), len(parts) + k)))
        for send in sends:
            watch.wait(send, stepping=True)
        return float(loss_sum), sum(parts[k][1] - parts[k][0] for k in mine)


def _block_inputs(blocks: list[nn.Module], example: torch.Tensor) -> tuple[list[torch.Size], list[torch.dtype]]:
    """Each block's input shape per sample and dtype, from one sample run in eval mode (so that no running
    statistic moves)."""
    shapes, dtypes = [], []
    modes = [b.training for b in blocks]
    x = example[:1]
    try:
        with torch.no_grad():
            for block in blocks:
                shapes.append(x.shape[1:])
                dtypes.append(x.dtype)
                x = block.eval()(x)
                if not torch.is_tensor(x) or not x.is_floating_point():
                    what = f"{type(x).__name__} {getattr(x, 'dtype', '')}".strip()
                    raise TypeError(
                        f"an elastic pipeline sends one float tensor between blocks, "
                        f"{type(block).__name__} returns {what}"
                    )
    finally:
        for block, mode in zip(blocks, modes, strict=True):
            block.train(mode)
    return shapes, dtypes
