"""Checkpoint files: the whole model under its original parameter names, written atomically.

A checkpoint holds the full ``state_dict`` of the user's model (every stage's part under the names the
non-pipelined model has), the optimizer state keyed by the same names, and the step count. Because
nothing in it depends on the stage split, it loads into a plain ``nn.Module``
(``model.load_state_dict(load(path)["model"])``) and into a pipeline with any number of stages.

A save writes a temporary file beside the target, syncs it to disk and renames it over the target: a
crash at any point leaves either the old checkpoint or the new one, never a torn file. Every tensor in it is
on the CPU, whatever device trained it, so it loads anywhere; loading puts each part on its stage's device.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.errors import InputError
from conveyor.runtime._transport import host_group

__all__ = [
    "CheckpointError",
    "check_compatible",
    "load",
    "load_stage",
    "named_optimizer_state",
    "save",
    "save_stages",
    "set_optimizer_state",
]

FORMAT = "conveyor.checkpoint"
VERSION = 1


class CheckpointError(InputError):
    """A checkpoint that cannot be read, or that belongs to another model."""


def save(path: str | os.PathLike[str], model: Mapping[str, torch.Tensor], **extra: Any) -> Path:
    """Atomically write ``model`` (a full state dict) and ``extra`` entries to ``path``.

    Returns:
        The path written.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory: give a file name such as {path / 'model.pt'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "model": dict(model), **extra}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def load(path: str | os.PathLike[str], *, mapped: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (tensors on the CPU). ``mapped``: the tensors memory-mapped from
    the file, their bytes read only where used (for a caller that needs their shapes or the extra entries alone).

    Raises:
        CheckpointError: the file is missing, unreadable, or not a Conveyor checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: check the path")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as exc:  # torch.load's own message runs over many lines and suggests unsafe loading
        if mapped:  # a file torch cannot map (not its zip format) is read, or refused, as it would be unmapped
            return load(path)
        raise CheckpointError(
            f"{path} is not a readable checkpoint ({type(exc).__name__}): give a file written by Pipeline.save "
            "or conveyor train"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a Conveyor checkpoint: save one with Pipeline.save")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {payload.get('version')}; this Conveyor reads {VERSION}")
    return payload


def check_compatible(state: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size], source: str) -> None:
    """Raise unless ``state`` has exactly the keys of ``shapes``, each with that shape."""
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(set(state) - set(shapes))
    wrong = sorted(k for k in set(shapes) & set(state) if tuple(state[k].shape) != tuple(shapes[k]))
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        if wrong:
            k = wrong[0]
            parts.append(f"{len(wrong)} of other shape (e.g. {k}: {tuple(state[k].shape)} vs {tuple(shapes[k])})")
        raise CheckpointError(
            f"{source} is from another model ({'; '.join(parts)}): load it into the model it was saved from"
        )


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def named_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name instead of position, so any stage split can use it.

    Assumes the optimizer was built over ``module.parameters()`` in their order (as the pipeline does).
    """
    sd = optimizer.state_dict()
    names = [n for n, _ in module.named_parameters()]
    return {
        "state": {names[i]: s for i, s in sd["state"].items()},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
    }


def set_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, named: Mapping[str, Any]) -> None:
    """Load state saved by :func:`named_optimizer_state` (from any stage split) into ``optimizer``."""
    sd = optimizer.state_dict()
    names = [n for n, _ in module.named_parameters()]
    hyper = named["param_groups"][0] if named["param_groups"] else {}
    groups = [{**g, **hyper, "params": g["params"]} for g in sd["param_groups"]]
    state = {i: named["state"][n] for i, n in enumerate(names) if n in named["state"]}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_stages(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    writes: bool,
    steps: int,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write one checkpoint of a model split over workers (every worker calls it; worker 0 writes).

    Each worker passes its stage's ``module`` and ``optimizer``; ``writes`` is true on exactly one worker of
    each stage (its first replica), whose part goes into the file; worker 0's ``extra`` entries (plain data:
    numbers, strings, lists, dicts) go in beside them. Returns once the file is complete.
    """
    state = None
    if writes:
        named = None if optimizer is None else named_optimizer_state(optimizer, module)
        state = ({k: v.detach() for k, v in module.state_dict().items()}, named)
    parts = _gather_in_host_memory(state)
    if parts is not None:
        model = {k: v for weights, _ in parts for k, v in weights.items()}
        opts = [o for _, o in parts if o is not None]
        optim = {
            "state": {k: v for o in opts for k, v in o["state"].items()},
            "param_groups": opts[0]["param_groups"] if opts else [],
        }
        save(path, model, optimizer=optim, steps=steps, **(extra or {}))
    dist.barrier()  # the file is complete for everyone once this returns


_CHECKPOINT_TAG = 7919  # its messages match no pipeline message


def _gather_in_host_memory(state: Any) -> list[Any] | None:
    """Every worker's ``state`` (``None`` where it has none to give) on worker 0, its tensors in host memory, in
    worker order (``None`` elsewhere). Each structure goes by ``gather_object`` with its tensors' shapes in their
    place, then each tensor in a message of its own over gloo, copied to the host one at a time: pickling the
    tensors with the structure would hold several copies of the whole model on worker 0 at once (the pickles,
    the gather padded to the largest, the unpickled tensors)."""
    group, rank = host_group(), dist.get_rank()
    leaves, spec = pytree.tree_flatten(state)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    shapes = {i: (tuple(leaves[i].shape), leaves[i].dtype) for i in at}
    skeleton = None  # the structure as text: a pickled TreeSpec warns on unpickling
    if state is not None:
        skeleton = (pytree.treespec_dumps(spec), [shapes.get(i, leaf) for i, leaf in enumerate(leaves)], at)
    skeletons: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(skeleton, skeletons if rank == 0 else None, dst=0, group=group)
    if rank != 0:
        for i in at:
            dist.send(leaves[i].detach().cpu().contiguous(), dst=0, group=group, tag=_CHECKPOINT_TAG)
        return None
    parts = []
    for source, received in enumerate(skeletons):
        if received is None:
            continue
        spec_k, flat, tensor_at = received
        for i in tensor_at:
            if source == 0:
                flat[i] = leaves[i].detach().cpu()
            else:
                flat[i] = torch.empty(flat[i][0], dtype=flat[i][1])
                dist.recv(flat[i], src=source, group=group, tag=_CHECKPOINT_TAG)
        parts.append(pytree.tree_unflatten(flat, pytree.treespec_loads(spec_k)))
    return parts


def load_stage(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_shapes: Mapping[str, torch.Size],
) -> int:
    """Load a stage's part of a checkpoint of the whole model (any split, or a plain model) into ``module``
    and ``optimizer``; return the checkpoint's step count.

    Raises:
        CheckpointError: the file is unreadable, or its model is not the one ``model_shapes`` describes.
    """
    payload = load(path)
    check_compatible(payload["model"], model_shapes, str(path))
    module.load_state_dict({k: payload["model"][k] for k in module.state_dict()})
    if optimizer is not None and payload.get("optimizer"):
        set_optimizer_state(optimizer, module, payload["optimizer"])
    return int(payload.get("steps", 0))
