"""An emulated shared cluster for one job: its network, its workers' cgroups, and how a worker joins them."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import FrameType, TracebackType

from conveyor.config import EmulationConfig
from conveyor.emulate._cgroups import (
    MAX_PERIOD_US,
    MIN_RUN_US,
    WorkerCgroup,
    job_name,
    remove_job,
    remove_stale_jobs,
)
from conveyor.emulate._devices import EmulatedDevice, parse_devices
from conveyor.emulate._faults import Fault, parse_faults
from conveyor.emulate._janitor import start_janitor
from conveyor.emulate._netns import enter_namespace
from conveyor.emulate._network import FABRIC_ENV, INTERFACE, Network
from conveyor.emulate._privileges import require_cgroups, require_netem, require_network
from conveyor.errors import InputError
from conveyor.plan import Topology, TopologyError

__all__ = ["Cluster", "Emulation", "WorkerSetup"]

_jobs = itertools.count()


@dataclass(frozen=True, kw_only=True)
class Emulation(EmulationConfig):
    """What to emulate, the fields of ``conveyor train``'s emulation section (:class:`~conveyor.config.
    EmulationConfig`): ``network`` (a topology string), ``devices`` (cores per worker) and ``faults`` (a fault
    spec), each ``None`` when not wanted; ``cpu_slice``, the seconds a device's quota lets it run before each stop.

    Example:
        >>> Emulation(network="2:1.25e9,2:1.25e7").topology(4).levels[1].bandwidth
        12500000.0
    """

    @classmethod
    def of(cls, section: EmulationConfig) -> Emulation:
        """The emulation a config section describes."""
        return cls(**{f.name: getattr(section, f.name) for f in fields(section)})

    @property
    def active(self) -> bool:
        return any((self.network, self.devices, self.faults))

    def topology(self, workers: int) -> Topology | None:
        """The emulated network's topology, checked against the job's worker count."""
        if not self.network:
            return None
        try:
            topology = Topology.parse(self.network)
        except TopologyError as exc:
            raise InputError(f"--network: {exc}") from None
        if topology.workers != workers:
            raise InputError(f"--network {self.network} has {topology.workers} workers but the job has {workers}")
        return topology

    def device_list(self, workers: int) -> tuple[EmulatedDevice, ...] | None:
        return parse_devices(self.devices, workers) if self.devices else None

    def fault_list(self, workers: int) -> list[Fault]:
        topology = self.topology(workers)
        per_server = topology.levels[0].count if topology else 1
        faults = parse_faults(self.faults or "", workers, per_server)
        if any(f.kind == "link-down" for f in faults) and (topology is None or len(topology.levels) < 2):
            raise InputError("a link-down fault needs --network with at least two levels (servers and what joins them)")
        return faults

    def check(self, workers: int) -> None:
        """Every input and privilege this needs, checked with one line each before any worker starts."""
        topology = self.topology(workers)
        self.device_list(workers)
        if not MIN_RUN_US / 1e6 <= self.cpu_slice <= MAX_PERIOD_US / 1e6:
            raise InputError(f"--cpu-slice is 0.001 to 1 second (the kernel's quota), got {self.cpu_slice:g}")
        faults = self.fault_list(workers)
        if topology is not None:
            require_network()
            if any(level.latency > 0 for level in topology.levels):
                require_netem()
        if self.devices or faults:
            require_cgroups()


@dataclass(frozen=True)
class WorkerSetup:
    """Run first in every worker (picklable): enter its namespace and cgroups, use the emulated interface."""

    namespaces: tuple[str, ...] = ()
    fabric: str = ""  # the fabric namespace, whose link counters a worker may read
    job: str = ""
    cores: tuple[float, ...] = ()
    folder: str = ""  # where each worker says it has started (started-R) and finds a revocation notice (revoke-R)

    def __call__(self, rank: int) -> None:
        if self.job:
            WorkerCgroup(self.job, f"w{rank}", create=False).join(os.getpid())
        if self.namespaces:
            enter_namespace(self.namespaces[rank])
            os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE
            os.environ[FABRIC_ENV] = self.fabric
        if self.cores and self.cores[rank] != float("inf"):
            import torch  # only a worker needs it

            torch.set_num_threads(max(1, int(self.cores[rank])))
        notice = Path(self.folder) / f"revoke-{rank}"

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            if notice.exists():  # a revocation notice: say so and work on until killed, as on a spot machine
                print(f"worker {rank}: revocation notice: {notice.read_text().strip()}", file=sys.stderr, flush=True)
                return
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # any other SIGTERM stops the worker as usual
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)
        (Path(self.folder) / f"started-{rank}").touch()


@dataclass
class Cluster:
    """The emulated cluster of a job of ``workers`` workers, set up on ``with`` and gone after it.

    Nothing outlives the job: namespaces die with their last process, and a watcher removes the cgroups if
    this process is killed before it can.
    """

    emulation: Emulation
    workers: int
    log_dir: Path
    network: Network | None = None
    cgroups: list[WorkerCgroup] = field(default_factory=list)
    devices: tuple[EmulatedDevice, ...] | None = None
    job: str = ""
    _janitor: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Cluster:
        self.emulation.check(self.workers)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._remove_markers()
        remove_stale_jobs()
        try:
            topology = self.emulation.topology(self.workers)
            if topology is not None:
                self.network = Network(topology)
            self.devices = self.emulation.device_list(self.workers)
            if self.devices or self.emulation.faults:
                self.job = job_name(next(_jobs))
                self._janitor = start_janitor(self.job)
                run_us = round(self.emulation.cpu_slice * 1e6)
                for rank in range(self.workers):
                    self.cgroups.append(WorkerCgroup(self.job, f"w{rank}", run_us=run_us))
                    self.cgroups[-1].set_cores(self.base_cores(rank))
        except BaseException:
            self.close()
            raise
        return self

    def base_cores(self, rank: int) -> float:
        """Worker ``rank``'s own speed in cores (``inf``: unlimited)."""
        return self.devices[rank].cores if self.devices else float("inf")

    @property
    def worker_setup(self) -> WorkerSetup:
        return WorkerSetup(
            namespaces=tuple(ns.path for ns in self.network.workers) if self.network else (),
            fabric=self.network.fabric.path if self.network else "",
            job=self.job,
            cores=tuple(self.base_cores(r) for r in range(self.workers)),
            folder=str(self.log_dir),
        )

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Tear everything down (also what a failed set-up made)."""
        if self.network is not None:
            self.network.close()
        if self.job:
            remove_job(self.job)
        if self._janitor is not None:
            self._janitor.terminate()
            self._janitor.wait()
        self._remove_markers()

    def _remove_markers(self) -> None:
        """The files workers and faults leave in the log folder to signal each other (not a record)."""
        for marker in [*self.log_dir.glob("started-*"), *self.log_dir.glob("revoke-*")]:
            marker.unlink(missing_ok=True)
