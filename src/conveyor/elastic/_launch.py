"""Start an elastic job's workers on this machine (or on an emulated cluster), where losing one is no failure.

Worker 0 (reliable) hosts the job's c10d store on a free port and writes ``HOST:PORT`` to ``store.txt`` in
the log folder; the others read it there. A worker killed (revoked) is not an error: the others go on
without it. A worker that *raises* is, and stops the job, as with :func:`conveyor.runtime.launch`. On an
emulated cluster the fault plan's additions start a new worker in the added machine's slot.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.elastic._membership import connect, listen_for_notice
from conveyor.emulate import Cluster, Emulation, address
from conveyor.emulate.parts import FaultDriver
from conveyor.processes import (
    LauncherOutput,
    WorkerReport,
    become_worker,
    failure_report,
    launcher_environment,
    report_and_exit,
    set_parent_death_signal,
    stop_workers,
    wait_for_exit,
    worker_context,
)
from conveyor.runtime import WorkerError

__all__ = ["launch_elastic", "store_address"]

_WAIT_S = 0.1  # how often the launcher looks for additions while its workers run
_FINISH_S = 10.0  # how long the others may take to exit once worker 0 has


def store_address(folder: Path, timeout_s: float = 120.0) -> tuple[str, int]:
    """The ``HOST:PORT`` worker 0 wrote to ``folder/store.txt`` (waiting for it)."""
    path, deadline = folder / "store.txt", time.monotonic() + timeout_s
    while not path.exists() or not path.read_text().endswith("\n"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker 0 did not publish the job's store in {timeout_s:g} s ({path})")
        time.sleep(0.05)
    host, port = path.read_text().strip().rsplit(":", 1)
    return host, int(port)


@dataclass(frozen=True, kw_only=True)
class _ElasticJob:
    """What every worker process of an elastic job is given."""

    host: str  # where worker 0 serves the store
    folder: Path
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    setup: Callable[[int], None] | None
    threads: int
    environment: dict[str, str]  # the launcher's, as it launches (the worker server's may be older)
    output: LauncherOutput


def _worker(slot: int, worker: int | None, job: _ElasticJob) -> None:
    set_parent_death_signal()
    become_worker(job.environment, job.output)
    import torch

    host, folder, fn, args, setup = job.host, job.folder, job.fn, job.args, job.setup
    torch.set_num_threads(job.threads)
    server = None
    try:
        if setup is not None:
            setup(slot)
        listen_for_notice()  # from now on a SIGTERM is a revocation notice
        if worker == 0:
            server = connect(host, 0, is_leader=True)  # lives as long as worker 0: the reliable tier's store
            (folder / "store.txt").write_text(f"{host}:{server.port}\n")
            port = server.port
        else:
            host, port = store_address(folder)
        report = WorkerReport(ok=True, value=fn(worker, host, port, *args))
    except BaseException as exc:  # every error goes to the launcher, as the runtime's launcher does
        report = failure_report(exc)
    report_and_exit(folder / f"report-{os.getpid()}.pkl", report)


def launch_elastic(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int,
    folder: Path,
    emulation: Emulation | None = None,
    timeout_s: float | None = None,
) -> dict[int, Any]:
    """Run ``fn(worker, host, port, *args)`` on ``nprocs`` local workers (ids ``0 .. nprocs-1``) and on every
    worker the emulated cluster adds (id ``None``: it takes the next free id from the store).

    Args:
        fn: the worker function (picklable, module level).
        nprocs: workers at the start; worker 0 is reliable and hosts the store.
        folder: the run folder (``store.txt``, the reports, the fault log).
        emulation: the network, devices and faults (revocations and additions) to emulate.
        timeout_s: wall-clock limit for the whole job.

    Returns:
        ``{pid: fn's return value}`` for every worker that returned (revoked ones did not).

    Raises:
        WorkerError: a worker raised (the first error is reported; its slot stands for its rank).
        TimeoutError: the job ran past ``timeout_s``.

    Example:
        >>> launch_elastic(work, nprocs=4, folder=Path("run"))  # doctest: +SKIP
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "store.txt").unlink(missing_ok=True)
    emulation = emulation or Emulation()
    if not emulation.active:
        return _run(fn, args, nprocs=nprocs, folder=folder, cluster=None, host="127.0.0.1", timeout_s=timeout_s)
    with Cluster(emulation, nprocs, folder) as cluster:
        host = address(0) if cluster.network is not None else "127.0.0.1"
        return _run(fn, args, nprocs=nprocs, folder=folder, cluster=cluster, host=host, timeout_s=timeout_s)


def _run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    nprocs: int,
    folder: Path,
    cluster: Cluster | None,
    host: str,
    timeout_s: float | None,
) -> dict[int, Any]:
    ctx = worker_context()
    job = _ElasticJob(
        host=host,
        folder=folder,
        fn=fn,
        args=args,
        setup=cluster.worker_setup if cluster is not None else None,
        threads=max(1, len(os.sched_getaffinity(0)) // nprocs),
        environment=launcher_environment(),
        output=LauncherOutput(),
    )
    procs: dict[int, Any] = {}  # slot -> its latest process
    everyone: list[Any] = []
    slots: dict[int, int] = {}  # pid -> slot
    joiners: set[int] = set()
    added: queue.Queue[int] = queue.Queue()

    def start(slot: int, worker: int | None) -> None:
        proc = ctx.Process(target=_worker, args=(slot, worker, job))
        proc.start()
        assert proc.pid is not None
        procs[slot], slots[proc.pid] = proc, slot
        everyone.append(proc)

    def on_add(slot: int) -> str:
        added.put(slot)
        return f"starts a worker in slot {slot}"

    driver = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        for slot in range(nprocs):
            start(slot, slot)
        if cluster is not None:
            clock = folder / "training-started"  # worker 0 makes it: faults count from training, not start-up
            clock.unlink(missing_ok=True)
            driver = FaultDriver(cluster, cluster.emulation.fault_list(nprocs), on_add=on_add, clock=clock).start()
        results: dict[int, Any] = {}
        while procs[0].exitcode != 0 and (any(p.exitcode is None for p in everyone) or not added.empty()):
            waiting = []
            while not added.empty():
                slot = added.get()
                if procs[0].exitcode is not None:
                    continue  # the job is over
                if slot in procs and procs[slot].exitcode is None:
                    waiting.append(slot)  # the slot's revoked worker is not gone yet (a busy machine): soon
                    continue
                start(slot, None)
                joiners.add(everyone[-1].pid)
            for slot in waiting:
                added.put(slot)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"elastic job of {nprocs} workers ran past its {timeout_s} s limit")
            multiprocessing.connection.wait([p.sentinel for p in everyone if p.exitcode is None], timeout=_WAIT_S)
            for proc in everyone:
                if proc.exitcode is not None and proc.pid not in results:
                    results[proc.pid] = _outcome(proc, folder, slots[proc.pid], proc.pid in joiners and procs[0])
        wait_for_exit(everyone, _FINISH_S)  # worker 0 finished last: the others are on their way out
        for proc in everyone:
            if proc.pid not in results:
                results[proc.pid] = _outcome(proc, folder, slots[proc.pid], proc.pid in joiners and procs[0])
        if procs[0].exitcode != 0:  # killed without a report (the others' errors would have been raised)
            raise WorkerError(
                0,
                "WorkerDied",
                f"worker 0 (reliable, the job's store) exited with code "
                f"{procs[0].exitcode}: the reliable tier must outlive the job",
                "",
            )
        return {pid: r.value for pid, r in results.items() if r is not None and r.ok}
    finally:
        if driver is not None:
            driver.stop()
        stop_workers(everyone)


def _outcome(proc: Any, folder: Path, slot: int, leader: Any) -> WorkerReport | None:
    """A finished worker's report (``None``: killed without one, i.e. revoked); a raised error stops the job,
    unless the worker joined and the job had ended well before it could (``leader``: worker 0's process)."""
    path = folder / f"report-{proc.pid}.pkl"
    if not path.exists():
        return None
    with open(path, "rb") as fh:
        report: WorkerReport = pickle.load(fh)
    path.unlink()
    if not report.ok and leader and leader.exitcode == 0:
        return None
    if not report.ok:
        raise WorkerError(slot, report.error_type, report.message, report.traceback, bad_input=report.bad_input)
    return report
