"""Start workers on this machine (or join a torchrun job) with torch.distributed set up."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conveyor.errors import InputError
from conveyor.processes import (
    STOP_FILE,
    LauncherOutput,
    WorkerReport,
    become_worker,
    failure_report,
    job_folder,
    launcher_environment,
    report_and_exit,
    request_stop,
    set_parent_death_signal,
    stop_requested,
    stop_workers,
    under_torchrun,
    wait_for_exit,
    worker_context,
)
from conveyor.runtime._devices import check_workers, local_rank, resolve_backend, resolve_device, use_device
from conveyor.runtime._transport import forget_host_groups, host_group

__all__ = ["WorkerError", "keep_first", "launch", "stop_requested", "under_torchrun"]

# How this process joined the job: keep_first joins again the same way.
_joined_with: dict[str, float] = {"timeout_s": 300.0}

# How long a failed job waits for the other workers to report their own errors before terminating them.
_REPORT_GRACE_S = 2.0


class WorkerError(RuntimeError):
    """A worker process raised; carries the first (root-cause) error and its traceback.

    Attributes:
        rank: the global rank of the worker that failed first.
        error_type: the class name of the original exception.
        remote_traceback: the original traceback, formatted in the worker.
        bad_input: whether the original was an :class:`~conveyor.errors.InputError` or an ``OSError`` (the
            command line says it in one line; anything else is a bug, shown with its traceback).
    """

    def __init__(
        self, rank: int, error_type: str, message: str, remote_traceback: str, *, bad_input: bool = False
    ) -> None:
        self.rank = rank
        self.error_type = error_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.bad_input = bad_input
        super().__init__(f"worker {rank} failed with {error_type}: {message}\n\n{remote_traceback}")


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int,
    device: str | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
    collective_timeout_s: float = 300.0,
    setup: Callable[[int], None] | None = None,
    on_interrupt: Callable[[], None] | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args)`` on every worker with the default process group initialised.

    Outside torchrun this starts ``nprocs`` local processes (spawned, so ``fn`` and ``args`` must be
    picklable: define ``fn`` at module level). Under torchrun the current process is one worker: it joins
    the job through the env:// variables torchrun sets and ``nprocs`` is ignored, so the same script runs
    unchanged on one machine or many.

    Args:
        fn: the worker function. Inside it ``torch.distributed`` is ready and ``RANK``, ``WORLD_SIZE``
            and ``LOCAL_RANK`` are set.
        nprocs: number of local workers to start when not under torchrun.
        device: ``"cuda"``, ``"cpu"`` or ``"auto"`` (default: CUDA where there is a GPU); each worker's
            :func:`~conveyor.runtime.default_device` is then ``cuda:LOCAL_RANK`` (modulo the GPUs) or the CPU.
        backend: ``"nccl"``, ``"gloo"`` or ``"auto"`` (default: NCCL on CUDA, gloo on the CPU). Gloo with CUDA
            is shared-GPU mode (:mod:`conveyor.runtime._devices`).
        timeout_s: wall-clock limit for the whole local job; its workers are killed past it.
        collective_timeout_s: how long a communication may wait before it fails instead of hanging.
        setup: called as ``setup(rank)`` first thing in each local worker, before torch.distributed starts
            (to place it in an emulated network or cgroup); must be picklable.
        on_interrupt: makes the job stoppable without loss. Local workers then ignore Ctrl-C themselves; the
            launcher's first Ctrl-C or SIGTERM calls ``on_interrupt()`` (to say what happens next) and sets every
            worker's :func:`stop_requested`, and the workers go on until they return; a second one stops them
            (``KeyboardInterrupt``). Under torchrun, a Ctrl-C or SIGTERM of this process sets it. Without
            ``on_interrupt``, an interrupt stops the workers at once.

    Returns:
        ``{rank: fn's return value}`` for the workers that ran in this machine's launch.

    Raises:
        WorkerError: a worker raised; all other workers were stopped. The first error is reported.
        TimeoutError: the job ran past ``timeout_s``.
        ValueError: the device or backend is unknown or missing, or NCCL would put two workers on one GPU.

    Example:
        >>> def work() -> int:
        ...     return torch.distributed.get_rank()
        >>> launch(work, nprocs=2)  # doctest: +SKIP
        {0: 0, 1: 1}
    """
    kind = resolve_device(device)
    backend = resolve_backend(backend, kind)
    if under_torchrun():
        check_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), kind, backend)
        use_device(kind)  # this process is the worker: its default_device()
        rank = int(os.environ["RANK"])
        if on_interrupt is not None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: request_stop())
        _init_process_group(
            backend,
            kind,
            init_method="env://",
            rank=rank,
            world=int(os.environ["WORLD_SIZE"]),
            timeout_s=collective_timeout_s,
        )
        try:
            return {rank: fn(*args)}
        finally:
            if dist.is_initialized():  # a worker that :func:`keep_first` let go has left it already
                dist.destroy_process_group()
    if nprocs < 1:
        raise InputError(f"nprocs must be at least 1, got {nprocs}")
    check_workers(nprocs, kind, backend)
    with job_folder("launch") as tmp:
        job = _LocalJob(
            fn=fn,
            args=args,
            world=nprocs,
            device=kind,
            backend=backend,
            tmp=tmp,
            collective_timeout_s=collective_timeout_s,
            setup=setup,
            graceful=on_interrupt is not None,
            environment=launcher_environment(),
            output=LauncherOutput(),
        )
        return _run_local(job, timeout_s, on_interrupt)


def _init_process_group(
    backend: str, device: str, *, init_method: str, rank: int, world: int, timeout_s: float
) -> None:
    """Join the job. On CUDA the worker's GPU becomes its current device, NCCL's communicators are bound to it
    (``device_id``: created at once, no guessing which GPU a rank uses), and the gloo group that carries messages
    between stages through host memory is made (:func:`~conveyor.runtime._transport.host_group`)."""
    _joined_with["timeout_s"] = timeout_s
    gpu = None
    if device == "cuda":
        gpu = torch.device("cuda", local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(gpu)
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=gpu if backend == "nccl" else None,
        )
        if backend == "nccl":
            host_group()


def _share_cores(workers: int) -> None:
    """This worker's intra-op threads where ``workers`` local workers share this machine's cores: its share of them
    (at least one), so that together they do not oversubscribe it."""
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def keep_first(workers: int) -> bool:
    """Narrow the job to its first ``workers`` workers (every worker calls it at the same point): they form the
    default process group again, of ``workers`` ranks with the same numbers, on the same store and backend, and
    go on (``True``); the others leave it (``False``) and must not communicate again: their function returns.
    A job planned for fewer workers than it started (one worker, say, where the model is too small for a pipeline
    to pay) runs on as many; the others' processes end as soon as they return. Where the job's workers all ran on
    this machine, the ones kept take the intra-op threads the launcher gives so many (its cores shared among them).

    Every group made before is gone afterwards (subgroups too): call it before building anything that holds one.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if workers >= world:
        return True
    store = dist.distributed_c10d._get_default_store()
    backend = dist.get_backend()
    device = torch.cuda.current_device() if backend == "nccl" else None
    dist.barrier()  # every worker done with the old group before any destroys its end of it
    dist.destroy_process_group()
    forget_host_groups()
    if rank >= workers:
        return False
    if os.environ.get("LOCAL_WORLD_SIZE") == str(world):  # every worker of the job on this machine: fewer share it
        os.environ["LOCAL_WORLD_SIZE"] = str(workers)
        _share_cores(workers)
    os.environ["WORLD_SIZE"] = str(workers)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"first-{workers}/", store),
        rank=rank,
        world_size=workers,
        timeout=timedelta(seconds=_joined_with["timeout_s"]),
        device_id=None if device is None else torch.device("cuda", device),
    )
    if backend == "nccl":
        host_group()
    return True


@dataclass(frozen=True, kw_only=True)
class _LocalJob:
    """What every local worker process is given: the work, the job's shape, and where to rendezvous and report."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    world: int
    device: str
    backend: str
    tmp: Path
    collective_timeout_s: float
    setup: Callable[[int], None] | None
    graceful: bool  # the launcher alone answers Ctrl-C, and asks the workers to stop through a file in tmp
    environment: dict[str, str]  # the launcher's, when it launched
    output: LauncherOutput  # and its standard output and error


def _worker(rank: int, job: _LocalJob) -> None:
    set_parent_death_signal()
    become_worker(job.environment, job.output, graceful=job.graceful)
    if job.graceful:
        os.environ[STOP_FILE] = str(job.tmp / "stop")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(job.world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(job.world))
    _share_cores(job.world)
    try:
        if job.setup is not None:
            job.setup(rank)
        use_device(job.device)
        rendezvous = f"file://{job.tmp / 'rendezvous'}"
        _init_process_group(
            job.backend,
            job.device,
            init_method=rendezvous,
            rank=rank,
            world=job.world,
            timeout_s=job.collective_timeout_s,
        )
        value = job.fn(*job.args)
        if dist.is_initialized():  # (a worker that keep_first let go has no peers left)
            dist.barrier()  # nobody leaves while a peer may still be receiving from it
        report = WorkerReport(ok=True, value=value)
    except BaseException as exc:  # report everything, KeyboardInterrupt included, to the launcher
        report = failure_report(exc)
    report_and_exit(job.tmp / f"report-{rank}.pkl", report)


def _run_local(job: _LocalJob, timeout_s: float | None, on_interrupt: Callable[[], None] | None) -> dict[int, Any]:
    ctx = worker_context()
    procs = [ctx.Process(target=_worker, args=(r, job)) for r in range(job.world)]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    interrupted = False
    try:
        with _interrupts(on_interrupt is not None):
            for p in procs:
                p.start()
            running = {p.sentinel: p for p in procs}
            while running:
                wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    ready = multiprocessing.connection.wait(list(running), timeout=wait_s)
                except KeyboardInterrupt:
                    if on_interrupt is None or interrupted:
                        raise
                    interrupted = True  # the first: the workers stop where they can; a second stops them now
                    on_interrupt()
                    (job.tmp / "stop").touch()
                    continue
                if not ready:
                    raise TimeoutError(f"local job of {job.world} workers ran past its {timeout_s} s limit")
                for sentinel in ready:
                    proc = running.pop(sentinel)  # type: ignore[arg-type]  # wait() returns the sentinels given
                    proc.join()
                    if proc.exitcode != 0:
                        wait_for_exit(procs, _REPORT_GRACE_S)
                        raise _first_error(procs, job.tmp)
        return {r: _read_report(job.tmp, r).value for r in range(job.world)}
    finally:
        stop_workers(procs, ask_first=not job.graceful)  # a graceful worker takes SIGTERM as a request


@contextlib.contextmanager
def _interrupts(on: bool) -> Iterator[None]:
    """While ``on``, Ctrl-C and SIGTERM interrupt the launcher (``KeyboardInterrupt``), where it can: in the main
    thread. Ctrl-C too, because a process started in the background by a shell without job control inherits it
    ignored, and Python then leaves it so: a SIGINT sent on purpose would do nothing."""
    if not on or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read_report(tmp: Path, rank: int) -> WorkerReport:
    path = tmp / f"report-{rank}.pkl"
    if not path.exists():
        # Died without a Python error (killed, out of memory): the likely root cause of what others saw.
        return WorkerReport(ok=False, error_type="WorkerDied", message="exited without a report", time=-float("inf"))
    with open(path, "rb") as fh:
        report: WorkerReport = pickle.load(fh)
        return report


def _first_error(procs: list[Any], tmp: Path) -> WorkerError:
    """The error that happened first: later ones are usually peers noticing the failed worker is gone."""
    failures = [(r, _read_report(tmp, r)) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    rank, rep = min(failures, key=lambda f: f[1].time)
    if rep.error_type == "WorkerDied":
        code = procs[rank].exitcode
        rep.message = f"exited with code {code} without a Python error (killed, or out of memory?)"
    return WorkerError(rank, rep.error_type, rep.message, rep.traceback, bad_input=rep.bad_input)
