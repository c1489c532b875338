"""Measure a model block by block: times, activation, saved, parameter and optimizer bytes, step time.

Each block runs on the output of the block before it, as in the pipeline. Times are medians over
``repeats`` runs after ``warmup`` runs (with CUDA synchronised around each), on stock PyTorch.

Example:
    >>> from torch import nn
    >>> p = profile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.zeros(4, 8), repeats=2, warmup=1)
    >>> [layer.param_bytes for layer in p.layers], p.layers[1].output_bytes
    ([288, 0], 128)
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.errors import InputError
from conveyor.plan import Layer, Profile
from conveyor.runtime._devices import default_device, synchronize
from conveyor.runtime._materialize import Materialize, is_on_meta, placed
from conveyor.runtime._microbatch import batch_size
from conveyor.runtime._stage import Blocks, as_blocks
from conveyor.runtime._transport import differentiable_leaves

__all__ = ["profile"]


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def _rows(t: torch.Tensor, count: int) -> torch.Tensor:
    return t[:count]


def _detached_input(tree: Any) -> Any:
    """The block's input as a leaf of a fresh graph: floating tensors require grad, as in a pipeline stage."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if t.is_floating_point() else t

    return pytree.tree_map_only(torch.Tensor, leaf, tree)


def _measure(
    block: nn.Module, x: Any, device: torch.device, autocast: torch.dtype | None = None
) -> tuple[float, float, Any, int]:
    """One forward and one backward of ``block`` on ``x`` (the forward under ``torch.autocast`` to ``autocast``,
    if given): their times, the output and the bytes saved.

    Saved bytes count the activations autograd keeps for the backward, not the parameters it also keeps.
    """
    saved = 0
    weights = {p.data_ptr() for p in block.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.data_ptr() not in weights:
            saved += t.numel() * t.element_size()
        return t

    inp = _detached_input(x)
    mixed = torch.autocast(device.type, autocast) if autocast is not None else contextlib.nullcontext()
    synchronize(device)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mixed:
        out = block(inp)
    synchronize(device)
    forward = time.perf_counter() - start
    roots = [t for t in differentiable_leaves(out) if t.requires_grad]
    start = time.perf_counter()
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    synchronize(device)
    return forward, time.perf_counter() - start, out, saved


def _optimizer_state(
    block: nn.Module, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], repeats: int
) -> tuple[int, float]:
    """Bytes of optimizer state after a step, and the median time of a step (a copy of the block's parameters is
    stepped, not the block)."""
    params = [nn.Parameter(p.detach().clone()) for p in block.parameters()]
    if not params:
        return 0, 0.0
    opt = optimizer(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    times = []
    for _ in range(repeats + 1):  # the first step creates the state
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return sum(_nbytes(list(s.values())) for s in opt.state.values()), statistics.median(times[1:])


def profile(
    model: Blocks,
    example: Any,
    *,
    name: str = "model",
    device: torch.device | str | None = None,
    repeats: int = 10,
    warmup: int = 3,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    batch_sizes: Sequence[int] = (),
    autocast: torch.dtype | None = None,
    materialize: Materialize | None = None,
) -> Profile:
    """Profile every block of ``model`` on the batch ``example``.

    Args:
        model: an ``nn.Sequential`` or a list of blocks, as given to :class:`~conveyor.Pipeline`.
        example: one minibatch of input (any pytree of tensors); its size is the profile's batch size.
        name: the model's name in the profile.
        device: where to run; default :func:`~conveyor.runtime.default_device`.
        repeats: timed runs per block (the median is kept).
        warmup: untimed runs per block first.
        optimizer: builds the optimizer whose state and step time are measured, e.g.
            ``partial(torch.optim.Adam, lr=1e-3)``; ``None`` records neither.
        batch_sizes: also measure at these batch sizes (each at most the example's; the example's first
            rows are used), kept as the profile's :attr:`~conveyor.plan._profiles.Profile.variants`.
        autocast: run the forwards under ``torch.autocast`` to this dtype (``torch.bfloat16``), as the pipeline's
            ``autocast`` does.
        materialize: for a model built on the meta device, how a block gets real tensors
            (:func:`~conveyor.runtime.initialise_from`): one block at a time is real, each given back after it
            is measured, so the model need not fit the device.

    Raises:
        ValueError: a batch size larger than the example's.
    """
    full = batch_size(example)
    if any(not 1 <= b <= full for b in batch_sizes):
        raise InputError(f"batch sizes {list(batch_sizes)} must be between 1 and the example's batch size {full}")
    if batch_sizes:
        others = sorted(set(batch_sizes) - {full})
        rows = [pytree.tree_map_only(torch.Tensor, partial(_rows, count=b), example) for b in others]

        def measure(x: Any) -> Profile:
            return profile(
                model,
                x,
                name=name,
                device=device,
                repeats=repeats,
                warmup=warmup,
                optimizer=optimizer,
                autocast=autocast,
                materialize=materialize,
            )

        return replace(measure(example), variants=tuple(measure(x) for x in rows))
    if repeats < 1 or warmup < 0:
        raise InputError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    device = torch.device(device) if device is not None else default_device()
    x = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), example)
    layers = []
    for block_name, block in as_blocks(model):
        on_meta = is_on_meta(block)
        block = placed(nn.Sequential(OrderedDict([(block_name, block)])), device, materialize)[0]
        for _ in range(warmup):
            _measure(block, x, device, autocast)
        runs = [_measure(block, x, device, autocast) for _ in range(repeats)]
        block.zero_grad(set_to_none=True)
        out = runs[-1][2]
        state_bytes, step_s = (0, 0.0) if optimizer is None else _optimizer_state(block, optimizer, repeats)
        layers.append(
            Layer(
                name=block_name,
                description=repr(block).replace("\n", " ")[:200],
                forward_s=statistics.median(r[0] for r in runs),
                backward_s=statistics.median(r[1] for r in runs),
                output_bytes=_nbytes(out),
                param_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
                saved_bytes=runs[-1][3],
                optimizer_bytes=state_bytes,
                step_s=step_s,
            )
        )
        if on_meta:  # measured: its memory goes back, so that one block at a time is real
            block.to_empty(device=torch.device("meta"))
        x = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
    edges = tuple((i, i + 1) for i in range(len(layers) - 1))
    return Profile(name, tuple(layers), edges, batch_size(example))
