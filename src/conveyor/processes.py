"""How Conveyor starts local worker processes: forked from a server process that imported torch once.

A spawned worker imports torch itself (about 3 s of CPU on a small machine, in every worker of every launch); a
worker forked from the server starts in a fraction of a second. Nothing but imports has run in the server (no
CUDA context, no work), so its workers start as clean as spawned ones, and like them receive their function and
arguments by pickling. What a worker would otherwise inherit from the server rather than its launcher is put right
first thing (:func:`become_worker`): the environment, standard output and error, the signals, and the server's
keep-alive pipe (held by a worker, it would keep the server, and through the parent-death signal the worker, alive
after its launcher was killed). Known limits: the worker unpickles its function (importing its module) before
that, with the server's environment (``TORCH_DISTRIBUTED_DEBUG`` and other variables read when torch is imported
are the server's); an error there is reported as a worker that died. This module imports no torch, so a command
can start the server first and let it import torch while the command itself does (:func:`start_worker_server`).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import reduction
from pathlib import Path
from typing import Any, NoReturn

from conveyor.errors import InputError

__all__ = [
    "LauncherOutput",
    "WorkerReport",
    "become_worker",
    "failure_report",
    "job_folder",
    "launcher_environment",
    "process_alive",
    "report_and_exit",
    "request_stop",
    "set_parent_death_signal",
    "start_worker_server",
    "stop_requested",
    "stop_workers",
    "under_torchrun",
    "wait_for_exit",
    "worker_context",
]

# Imported once by the server rather than by every worker: torch; dynamo, which the first optimizer a process
# builds imports (2 s of CPU on a small machine); torch.export's tracer, which splits a model that is not a sequence;
# conveyor.job, what a training worker runs (and conveyor.runtime with it).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.export._trace", "conveyor.job"]

# How long a worker gets to exit after SIGTERM before it is killed.
_TERMINATE_GRACE_S = 5.0


def worker_context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context local workers start from, its server running. The server ignores Ctrl-C and
    SIGTERM (started so from the main thread), so a signal to the whole process group is left to the launcher and
    its workers, which decide what it means."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    if threading.current_thread() is not threading.main_thread():
        multiprocessing.forkserver.ensure_running()
        return ctx
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        multiprocessing.forkserver.ensure_running()  # the server inherits the ignored dispositions
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return ctx


def launcher_environment() -> dict[str, str]:
    """What a worker's environment will be (:func:`become_worker`): the launcher's now, local workers talking over
    loopback unless it says otherwise."""
    return {"GLOO_SOCKET_IFNAME": "lo", **os.environ}


def become_worker(environment: dict[str, str], output: LauncherOutput, *, graceful: bool = False) -> None:
    """First thing in a worker forked from the server: its launcher's ``environment`` and ``output`` of the moment
    it launched, the server's keep-alive pipe let go, and the signals a worker has: Ctrl-C raises
    ``KeyboardInterrupt`` and SIGTERM ends it, or, ``graceful``, Ctrl-C is left to the launcher and SIGTERM only
    asks (:func:`stop_requested`)."""
    server: Any = multiprocessing.forkserver._forkserver  # the stdlib keeps the pipe's end here, nothing public
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    os.environ.clear()
    os.environ.update(environment)
    output.adopt()
    if graceful:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every process of the group
        signal.signal(signal.SIGTERM, lambda *_: _stop_request.set())
    else:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# Set when this worker is asked to stop where it can (a graceful worker's SIGTERM; under torchrun, Ctrl-C too).
_stop_request = threading.Event()
# A local launcher's workers find this file once their launcher is asked to stop (a file, unlike a signal, cannot
# arrive before a worker is ready for it).
STOP_FILE = "CONVEYOR_STOP_FILE"


def request_stop() -> None:
    """Ask this process's work to stop at its next safe point (a signal handler under torchrun calls it)."""
    _stop_request.set()


def stop_requested() -> bool:
    """Whether this worker's job was asked to stop at its next safe point (a launcher started with
    ``on_interrupt`` got a Ctrl-C or SIGTERM, or this worker a SIGTERM; under torchrun, this process a Ctrl-C or
    SIGTERM). The worker function decides where that is (``conveyor train``: the end of the epoch, after which it
    saves as usual). A file check: call it at a step or epoch boundary, not per operation."""
    stop_file = os.environ.get(STOP_FILE)
    return _stop_request.is_set() or (stop_file is not None and os.path.exists(stop_file))


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
            if fd != target:  # a spawned worker's duplicates are its own 1 and 2 already
                os.dup2(fd, target)
                os.close(fd)


def start_worker_server() -> None:
    """Start the server now, so that its import of torch overlaps the caller's own start-up."""
    worker_context()


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@dataclass
class WorkerReport:
    """What a worker leaves behind: its result, or the error it raised and when."""

    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    time: float = 0.0
    bad_input: bool = False  # an InputError or OSError, not a bug


@contextlib.contextmanager
def job_folder(kind: str) -> Iterator[Path]:
    """A folder for this process's job, ``conveyor-KIND-NS.PID-XXXXXXXX`` in the temporary directory, removed when
    the job ends. A launcher killed outright (SIGKILL) cannot remove its own, so each job first removes the ``kind``
    folders whose launcher is gone: its workers died with it (:func:`set_parent_death_signal`). ``NS`` names the
    PID namespace, so that a container sharing the temporary directory, whose PIDs this process cannot see, keeps
    its folders."""
    here = _pid_namespace()
    for stale in Path(tempfile.gettempdir()).glob(f"conveyor-{kind}-{here}.*-*"):
        owner = stale.name.split("-")[2].split(".")[1]
        if owner.isdigit() and not process_alive(int(owner)):
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"conveyor-{kind}-{here}.{os.getpid()}-") as tmp:
        yield Path(tmp)


def _pid_namespace() -> int:
    """This process's PID namespace (its inode; 0 where ``/proc`` does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def set_parent_death_signal() -> None:
    """Ask Linux to kill this worker if the launching process dies, so no worker outlives its job."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def failure_report(exc: BaseException) -> WorkerReport:
    """What a worker that raised ``exc`` (inside its ``except``) tells its launcher."""
    message = str(exc).splitlines()[0] if str(exc) else ""
    bad_input = isinstance(exc, InputError | OSError)
    return WorkerReport(False, None, type(exc).__name__, message, traceback.format_exc(), time.time(), bad_input)


def report_and_exit(path: Path, report: WorkerReport) -> NoReturn:
    """Write a worker's report where its launcher reads it, and end the worker process."""
    with open(path, "wb") as fh:
        pickle.dump(report, fh)
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without tearing down the process group: its threads can abort the interpreter's shutdown
    # ("terminate called without an active exception") after the work is done and reported.
    os._exit(0 if report.ok else 1)


def wait_for_exit(procs: list[Any], grace_s: float) -> None:
    """Give the started ``procs`` up to ``grace_s`` seconds in all to exit (their reports are written by then)."""
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))


def stop_workers(procs: list[Any], ask_first: bool = True) -> None:
    """End whichever of ``procs`` still run: SIGTERM first (``ask_first``) and a grace period, then SIGKILL."""
    procs = [p for p in procs if p.pid is not None]  # a failed start leaves later processes unstarted
    if ask_first:
        for p in procs:
            if p.is_alive():
                p.terminate()
        wait_for_exit(procs, _TERMINATE_GRACE_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
