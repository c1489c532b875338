"""Which device each worker computes on, and which torch.distributed backend joins them.

The conventions are torchrun's and Lightning's: on a machine with CUDA a job runs one worker per visible GPU,
worker ``LOCAL_RANK`` on ``cuda:LOCAL_RANK``, joined by NCCL; without CUDA it runs on the CPU over gloo. NCCL
refuses two ranks on one GPU, so more local workers than GPUs is an error that says what to do instead: fewer
workers, the CPU, or **shared-GPU mode** (``backend="gloo"`` with CUDA), where several workers take turns on
each GPU: worker ``LOCAL_RANK`` on ``cuda:LOCAL_RANK % GPUs``. Gloo all-reduces CUDA tensors itself; its
point-to-point messages of CUDA tensors abort the process, so :class:`~conveyor.runtime.parts.P2P` stages them
through pinned host memory. Shared-GPU mode is for tests and for users with one GPU: it runs every
multi-worker code path on the device, not fast.

The launcher (:func:`~conveyor.runtime.launch`) resolves the choice once and hands it to its workers in the
environment (``CONVEYOR_DEVICE``), so that :func:`default_device` in a worker is the device it was given. Set
by hand, ``CONVEYOR_DEVICE=cpu`` makes ``auto`` mean the CPU on a machine with GPUs (the test suite does
that for every test not marked ``gpu``).

Example:
    >>> resolve_device("cpu"), resolve_backend("auto", "cpu")
    ('cpu', 'gloo')
    >>> resolve_backend("nccl", "cpu")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    conveyor.errors.InputError: NCCL joins GPUs, and this job runs on the CPU: use --backend gloo (or auto), or ...
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from conveyor.config import BACKENDS, DEVICES
from conveyor.errors import InputError

__all__ = [
    "check_workers",
    "default_backend",
    "default_device",
    "default_workers",
    "resolve_backend",
    "resolve_device",
    "synchronize",
]

CPU_WORKERS = 4  # the most local workers a CPU job that names no count starts
_ENV = "CONVEYOR_DEVICE"  # the device type the launcher chose, for its workers


def resolve_device(device: str | None) -> str:
    """``"cuda"`` or ``"cpu"`` for ``--device`` (``auto`` or ``None``: ``CONVEYOR_DEVICE`` where it is set, else
    CUDA where there is a GPU).

    Raises:
        ValueError: an unknown name, or CUDA asked for on a machine without it.
    """
    name = (device or "auto").lower()
    if name not in DEVICES:
        raise InputError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    if name == "auto":
        name = os.environ.get(_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: this machine has no CUDA GPU that PyTorch can use: use --device cpu")
    return name


def resolve_backend(backend: str | None, device: str) -> str:
    """``"nccl"`` or ``"gloo"`` for ``--backend`` on ``device`` (``auto`` or ``None``: NCCL on CUDA, gloo on the CPU).

    Raises:
        ValueError: an unknown name, NCCL on the CPU, or NCCL missing from this PyTorch build.
    """
    name = (backend or "auto").lower()
    if name not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "nccl" if device == "cuda" else "gloo"
    if name == "nccl" and device != "cuda":
        raise InputError(
            "NCCL joins GPUs, and this job runs on the CPU: use --backend gloo (or auto), or --device cuda"
        )
    if name == "nccl" and not dist.is_nccl_available():
        raise InputError("this PyTorch build has no NCCL: use --backend gloo (workers share the GPUs) or --device cpu")
    return name


def default_workers(device: str) -> int:
    """Local workers of a job that names no count: one per visible GPU on CUDA; on the CPU one per core this
    process may use, up to :data:`CPU_WORKERS` (more workers than cores only share them: the planner may still
    run fewer)."""
    return torch.cuda.device_count() if device == "cuda" else min(CPU_WORKERS, len(os.sched_getaffinity(0)))


def check_workers(local_workers: int, device: str, backend: str) -> None:
    """Raise a one-line ValueError unless ``local_workers`` fit this machine's GPUs (NCCL: one GPU each)."""
    if device != "cuda" or backend != "nccl":
        return
    gpus = torch.cuda.device_count()
    if local_workers > gpus:
        raise InputError(
            f"{local_workers} workers on this machine but {gpus} GPU(s): NCCL needs a GPU per worker: use --workers "
            f"{gpus}, --device cpu, or --backend gloo (workers share the GPUs: for tests and one-GPU machines)"
        )


def local_rank() -> int:
    """This worker's rank on its machine (``LOCAL_RANK``, as torchrun and the local launcher set it)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def default_device() -> torch.device:
    """This worker's device: the one its launcher chose (``cuda:LOCAL_RANK`` modulo the GPUs, or the CPU); outside
    a launcher, ``auto``'s."""
    if resolve_device("auto") == "cuda":
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for ``device`` where it runs asynchronously (CUDA), so that a time taken after it is the device's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_backend() -> str:
    """The backend for :func:`default_device`: NCCL on CUDA, gloo on the CPU."""
    return resolve_backend("auto", default_device().type)


def use_device(device: str) -> None:
    """Make ``device`` (``"cpu"`` or ``"cuda"``) what :func:`default_device` gives this process and its children."""
    os.environ[_ENV] = device
