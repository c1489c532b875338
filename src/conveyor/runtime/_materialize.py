"""A stage of a model built on the meta device, given real tensors on its own worker only.

A model built under ``with torch.device("meta"):`` takes no memory; :func:`split_model` traces it as it would the
real one, and a :class:`~conveyor.runtime.Pipeline` given ``materialize=`` makes real only the tensors its
worker's stage holds, so a model larger than one worker's memory can be split. Two ways to fill them:

- :func:`initialise_from`: the model's own initialisation, one module at a time: each module that holds a tensor
  of the stage gets its own tensors on the device, then the random generators seeded from the seed and the
  module's name, then its ``reset_parameters()`` (a Hugging Face model's ``_init_weights(module)`` instead, which
  also gives the modules inside it their model-specific scale). The weights so made depend on the seed, the
  module's name and the device type, not on which worker makes them: any split gives the same model, the same
  as :func:`initialise_from` applied to the whole model (the tests check), as long as no module's own
  initialisation draws for tensors that different stages hold (a module's draws for tensors left on the meta
  device take nothing from the generator, so the draws after them would shift). They are not the values the model's
  constructor would draw on the CPU (it draws every module in turn from one generator).
- :func:`load_from`: a state dict file (``torch.save(model.state_dict(), path)``), memory-mapped, so a worker
  reads only its stage's tensors.

Example:
    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> stage = nn.Sequential(model[2])
    >>> initialise_from(model, seed=0)(stage, torch.device("cpu"))
    >>> stage[0].weight.device, model[0].weight.device
    (device(type='cpu'), device(type='meta'))
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

from conveyor.errors import InputError
from conveyor.runtime._graph_block import GraphBlock

__all__ = ["Materialize", "initialise_from", "is_on_meta", "load_from", "placed"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)
Materialize = Callable[[nn.Module, torch.device], None]
"""Gives a stage built on the meta device real tensors on ``device``, in place."""


def is_on_meta(stage: nn.Module) -> bool:
    """Whether any of ``stage``'s parameters or buffers is on the meta device (has no data)."""
    return any(t.is_meta for t in [*stage.parameters(), *stage.buffers()])


def _held(stage: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """Each tensor ``stage`` holds: the model's name for it, where it sits in the stage, and the tensor. A
    :class:`GraphBlock` holds its tensors under the model's names; blocks of an ``nn.Sequential`` are the model's
    own children, named in it by the stage's names."""
    for block_name, block in stage.named_children():
        prefix = [] if isinstance(block, GraphBlock) else [block_name]
        for module_name, module in block.named_modules():
            for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None:
                    yield ".".join([*prefix, *([module_name] if module_name else []), attr]), module, attr, tensor


def _place(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    """Put ``value`` where ``module`` holds ``attr``: a parameter stays a parameter."""
    if attr in module._parameters:
        was = module._parameters[attr]
        kept = was is not None and was.requires_grad
        module._parameters[attr] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, kept)
    else:
        module._buffers[attr] = value


def _direct(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]


def _reset(model: nn.Module, name: str, module: nn.Module) -> None:
    init_weights = getattr(model, "_init_weights", None)  # a Hugging Face PreTrainedModel
    if init_weights is not None:
        init_weights(module)
    elif callable(reset := getattr(module, "reset_parameters", None)):
        reset()
    elif any(not t.is_meta for t in _direct(module)):
        raise InputError(
            f"cannot initialise {name or 'the model'} ({type(module).__name__}) on its worker: it has no "
            "reset_parameters(); give it one, or the weights: materialize=load_from(PATH)"
        )


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    """The module of ``model`` that holds the tensor called ``name``, and its attribute there (``None`` for a
    tensor the trace made)."""
    path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return (module, attr) if attr in module._parameters or attr in module._buffers else None


def initialise_from(model: nn.Module, *, seed: int) -> Materialize:
    """Fill a stage of ``model`` (built on the meta device) with ``model``'s own initialisation, per module (see
    the module docstring). ``model``: the one the stage was split from, or the blocks
    :func:`~conveyor.runtime.split_model` made of it; its own modules are left on the meta device (the stage's
    tensors live in the stage alone), and the random generators as they were.

    Raises:
        InputError: a module of the stage holds tensors and has no ``reset_parameters``; a tensor the trace made
            (a constant) is on the meta device.
    """

    sources = [b.source for b in model.modules() if isinstance(b, GraphBlock) and b.source is not None]
    model = sources[0] if sources else model

    def materialize(stage: nn.Module, device: torch.device) -> None:
        places, owners = [], {}
        for name, slot, attr, tensor in _held(stage):
            owner = _owner(model, name)
            if owner is None:  # a constant the trace made: moved with the stage as it is
                if tensor.is_meta:
                    raise InputError(f"{name}, a tensor the model's forward makes, has no value: build it on a device")
                continue
            places.append((slot, attr, *owner))
            owners[id(owner[0])] = owner[0]
        for module in owners.values():
            module.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            for name, module in reversed(list(model.named_modules())):  # inner modules before the ones around them
                if any(not t.is_meta for t in [*module.parameters(), *module.buffers()]):
                    torch.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
                    _reset(model, name, module)
        slots = {id(slot) for slot, *_ in places}
        for slot, attr, module, own in places:
            _place(slot, attr, getattr(module, own))
        for module in owners.values():
            if id(module) not in slots:  # a graph block holds them now: the model's module goes back to no data
                module.to_empty(device=torch.device("meta"), recurse=False)

    return materialize


def load_from(path: str | os.PathLike[str]) -> Materialize:
    """Fill a stage from a state dict file of the whole model (its keys the model's names, as
    ``model.state_dict()`` gives them); the file is memory-mapped, so only the stage's tensors are read.

    Raises:
        InputError: the file cannot be read, or lacks a tensor of the stage or has it in another shape.
    """

    def materialize(stage: nn.Module, device: torch.device) -> None:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except (OSError, RuntimeError) as exc:
            raise InputError(f"cannot read the weights {path}: {exc}") from exc
        for name, module, attr, tensor in _held(stage):
            if name not in state or state[name].shape != tensor.shape:
                found = "missing" if name not in state else f"of shape {tuple(state[name].shape)}"
                raise InputError(f"the weights {path} have no {name} of shape {tuple(tensor.shape)} ({found})")
            _place(module, attr, state[name].to(device, copy=True))

    return materialize


def placed(stage: ModuleT, device: torch.device, materialize: Materialize | None) -> ModuleT:
    """``stage`` on ``device``; first given real tensors by ``materialize`` where it was built on the meta device.

    Raises:
        InputError: the stage is on the meta device and no ``materialize`` was given.
    """
    if is_on_meta(stage):
        if materialize is None:
            raise InputError(
                "the model was built on the meta device (its tensors have no values): give the pipeline "
                "materialize=initialise_from(model, seed=0), or materialize=load_from(PATH) for saved weights"
            )
        materialize(stage, device)
    return stage.to(device)
