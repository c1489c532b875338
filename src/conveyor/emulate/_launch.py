"""Run a job's workers on an emulated cluster: the runtime's launcher, with each worker placed in it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.emulate._cluster import Cluster, Emulation
from conveyor.emulate._driver import FaultDriver
from conveyor.emulate._privileges import EmulationError
from conveyor.processes import job_folder
from conveyor.runtime import WorkerError, launch, under_torchrun

__all__ = ["WorkerRevoked", "launch_emulated"]


class WorkerRevoked(WorkerError):
    """A worker was revoked by the emulated cluster, and the job could not go on without it."""


def launch_emulated(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int,
    emulation: Emulation | None = None,
    log_dir: Path | str | None = None,
    **kwargs: Any,
) -> dict[int, Any]:
    """:func:`conveyor.runtime.launch`, on the cluster ``emulation`` describes (plain local workers without one).

    Faults are applied from the moment the workers start and logged to ``log_dir/faults.jsonl``.

    Args:
        fn, args, nprocs, kwargs: as for :func:`conveyor.runtime.launch`.
        emulation: the network, devices and faults to emulate.
        log_dir: where the fault log goes (a temporary folder when not given).

    Raises:
        WorkerRevoked: a revoked worker took the job down.
        EmulationError, ValueError: the emulation cannot be set up; one line says why.

    Example:
        >>> launch_emulated(fn, nprocs=4, emulation=Emulation(network="2:1.25e9,2:1.25e7"))  # doctest: +SKIP
    """
    if emulation is None or not emulation.active:
        return launch(fn, *args, nprocs=nprocs, **kwargs)
    if under_torchrun():
        raise EmulationError("--network, --devices and --faults emulate a cluster on one machine: run without torchrun")
    with job_folder("emulate") as tmp:
        folder = Path(log_dir) if log_dir is not None else tmp
        with Cluster(emulation, nprocs, folder) as cluster:
            driver = FaultDriver(cluster, emulation.fault_list(nprocs)).start()
            try:
                return launch(fn, *args, nprocs=nprocs, setup=cluster.worker_setup, **kwargs)
            except WorkerError as exc:
                if exc.rank in driver.revoked:
                    notice, killed = driver.revoked[exc.rank]
                    raise WorkerRevoked(
                        exc.rank,
                        "WorkerRevoked",
                        f"worker {exc.rank} was revoked by the emulated cluster (notice at {notice:.1f} s, killed at "
                        f"{killed:.1f} s); a fixed-size job cannot go on without it",
                        exc.remote_traceback,
                    ) from None
                raise
            finally:
                driver.stop()
