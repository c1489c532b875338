"""How Conveyor starts local worker processes: forked from a server process that imported torch once.

A spawned worker imports torch itself (about 3 s of CPU on a small machine, in every worker of every launch); a
worker forked from the server starts in a fraction of a second. Nothing but imports has run in the server (no CUDA,
no threads), so its workers start as clean as spawned ones, and like them receive their function and arguments by
pickling. This module imports no torch, so a command can start the server first and let it import torch while the
command itself does (:func:`start_worker_server`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
from multiprocessing import reduction
from typing import Any

__all__ = ["LauncherOutput", "adopt_environment", "start_worker_server", "under_torchrun", "worker_context"]

_PRELOAD = ["torch", "torch.distributed"]


def worker_context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context local workers start from (the server starts on its first use)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def adopt_environment(environment: dict[str, str]) -> None:
    """Make this worker's environment its launcher's ``environment`` of the moment it launched: a worker forked from
    the server has the server's, of the moment the server started."""
    os.environ.clear()
    os.environ.update(environment)


class LauncherOutput:
    """The launcher's standard output and error, for a worker to write to. A worker forked from the server has the
    server's, those of the moment the server started (in a test run, the capture of whichever test started it);
    pickled when the worker starts, this carries duplicates of the launcher's two descriptors of that moment."""

    def __init__(self, fds: tuple[Any, Any] | None = None) -> None:
        self._fds = fds

    def __reduce__(self) -> tuple[type[LauncherOutput], tuple[tuple[Any, Any]]]:
        return LauncherOutput, ((reduction.DupFd(1), reduction.DupFd(2)),)

    def adopt(self) -> None:
        """In the worker: write to the launcher's output and error from now on."""
        for target, duplicate in zip((1, 2), self._fds or (), strict=False):
            fd = duplicate.detach()
            os.dup2(fd, target)
            os.close(fd)


def start_worker_server() -> None:
    """Start the server now, so that its import of torch overlaps the caller's own start-up."""
    worker_context()
    multiprocessing.forkserver.ensure_running()


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
