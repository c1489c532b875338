"""An emulated shared cluster on one machine: shaped links between namespaces, CPU quotas, faults.

Every worker runs in its own network namespace; the workers of a server meet on a bridge and servers meet
through links shaped by ``tc`` to the bandwidth (and latency) of each level of a planner topology. Each
worker's speed is a CPU quota in a cgroup. Faults (stragglers, revocations, link failures) are applied at
their times and logged. All of it is real kernel machinery, and none of it outlives the job.

Example:
    >>> from conveyor.emulate import Emulation, launch_emulated
    >>> emulation = Emulation(network="2:1.25e9,2:1.25e7", devices="0.5")
    >>> launch_emulated(fn, nprocs=4, emulation=emulation)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.emulate._cgroups import CgroupError, WorkerCgroup, remove_stale_jobs
    from conveyor.emulate._check import check_cluster, cpu_loop, link_pairs
    from conveyor.emulate._cluster import Cluster, Emulation, WorkerSetup
    from conveyor.emulate._devices import EmulatedDevice, parse_devices
    from conveyor.emulate._faults import Fault, parse_faults
    from conveyor.emulate._launch import WorkerRevoked, launch_emulated
    from conveyor.emulate._network import (
        EmulatedLink,
        Network,
        address,
        links_of,
        sent_bytes,
    )
    from conveyor.emulate._privileges import EmulationError
    from conveyor.emulate._traces import count_events, read_counts, replay_trace

# Imported on first use: the janitor process and fault planning need none of torch.
_HOME = {
    "_cgroups": ("CgroupError", "WorkerCgroup", "remove_stale_jobs"),
    "_check": ("check_cluster", "cpu_loop", "link_pairs"),
    "_cluster": ("Cluster", "Emulation", "WorkerSetup"),
    "_devices": ("EmulatedDevice", "parse_devices"),
    "_faults": ("Fault", "parse_faults"),
    "_launch": ("WorkerRevoked", "launch_emulated"),
    "_network": ("EmulatedLink", "Network", "address", "links_of", "sent_bytes"),
    "_privileges": ("EmulationError",),
    "_traces": ("count_events", "read_counts", "replay_trace"),
}
_WHERE = {name: module for module, names in _HOME.items() for name in names}
__all__ = [
    "CgroupError",
    "Cluster",
    "EmulatedDevice",
    "EmulatedLink",
    "Emulation",
    "EmulationError",
    "Fault",
    "Network",
    "WorkerCgroup",
    "WorkerRevoked",
    "WorkerSetup",
    "address",
    "check_cluster",
    "count_events",
    "cpu_loop",
    "launch_emulated",
    "link_pairs",
    "links_of",
    "parse_devices",
    "parse_faults",
    "read_counts",
    "remove_stale_jobs",
    "replay_trace",
    "sent_bytes",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'conveyor.emulate' has no attribute {name!r}")
    return getattr(importlib.import_module(f"conveyor.emulate.{_WHERE[name]}"), name)
