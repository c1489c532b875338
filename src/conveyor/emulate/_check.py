"""``conveyor emulate check``: measure every emulated link and device and set each beside its spec."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from conveyor.emulate._cluster import Emulation
from conveyor.emulate._launch import launch_emulated
from conveyor.plan import Topology

__all__ = ["check_cluster", "cpu_loop", "cpu_loop_seconds", "link_pairs"]

_PINGS = 30
_LOOP_SIZE = 192  # a matmul a core does in about a millisecond


def link_pairs(topology: Topology) -> list[tuple[int, int]]:
    """Worker pairs whose transfers cross every emulated link: each worker to the next one of its server
    (its own link), and the first worker of each group to the first of the next group, at every level.

    Example:
        >>> link_pairs(Topology.parse("2:1e9,2:1e8"))
        [(0, 1), (1, 0), (2, 3), (3, 2), (0, 2), (2, 0)]
    """
    pairs: list[tuple[int, int]] = []
    span = 1
    for level in topology.levels:
        inner, span = span, span * level.count
        for a in range(0, topology.workers, inner):
            b = a // span * span + (a + inner) % span  # the next group of the same parent, round the ring
            if a != b:
                pairs.append((a, b))
    return pairs


def cpu_loop(iterations: int) -> tuple[float, float]:
    """Wall-clock and CPU seconds of a fixed single-threaded CPU loop (the same work on every worker).

    The CPU seconds are the time the process ran: neither a quota's stops, nor other processes' turns, nor
    time a hypervisor took (steal) count, so they measure the work itself.
    """
    a, threads = torch.ones(_LOOP_SIZE, _LOOP_SIZE), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(iterations):
            torch.mm(a, a)
        return time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        torch.set_num_threads(threads)


def cpu_loop_seconds(iterations: int) -> float:
    """Wall-clock seconds of :func:`cpu_loop`."""
    return cpu_loop(iterations)[0]


def _measure(pairs: list[tuple[int, int]], sizes: list[int], iterations: int) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {"links": [], "alone_s": 0.0, "alone_cpu_s": 0.0, "all_busy_s": 0.0}
    small = torch.zeros(1)
    for a, b in pairs:  # a first message between two workers opens their connection: not part of the timing
        dist.barrier()
        if rank == a:
            dist.send(small, b)
        elif rank == b:
            dist.recv(small, a)
    for (a, b), size in zip(pairs, sizes, strict=True):
        dist.barrier()
        if rank not in (a, b):
            continue
        peer, big = b if rank == a else a, torch.zeros(size // 4)
        rtts = []
        for _ in range(_PINGS):
            start = time.perf_counter()
            if rank == a:
                dist.send(small, peer)
                dist.recv(small, peer)
            else:
                dist.recv(small, peer)
                dist.send(small, peer)
            rtts.append(time.perf_counter() - start)
        start = time.perf_counter()
        if rank == a:
            dist.send(big, peer)
            dist.recv(small, peer)  # the receiver's word that it has all of it
        else:
            dist.recv(big, peer)
            dist.send(small, peer)
        if rank == a:
            latency = statistics.median(rtts[5:]) / 2  # the first few pings still warm up
            out["links"].append(
                {
                    "from": a,
                    "to": b,
                    "bytes": size,
                    "latency_s": latency,
                    "seconds": time.perf_counter() - start - latency,
                }
            )
    if not iterations:  # the links only
        return out
    for worker in range(dist.get_world_size()):  # one at a time: its own speed, nobody competing
        dist.barrier()
        if worker == rank:
            out["alone_s"], out["alone_cpu_s"] = cpu_loop(iterations)
    dist.barrier()
    out["all_busy_s"] = cpu_loop_seconds(iterations)  # all at once: what the machine's cores allow
    return out


def check_cluster(
    emulation: Emulation, workers: int, seconds_per_link: float = 1.0, *, speeds: bool = True
) -> dict[str, Any]:
    """Measure the links and devices of ``emulation`` for ``workers`` workers; return the JSON report (without
    ``speeds``, the links only: its ``devices`` are empty, and the 3-4 s of loops that measure them are saved).

    Each link's transfer is sized to take ``seconds_per_link`` at its specified rate (1 MiB to 256 MiB);
    each worker's speed is the CPU time this process needs for a fixed loop (the work, in seconds of a whole
    core) over the worker's wall-clock time for it. The work is measured in CPU time, not wall-clock time,
    because on a virtual machine the hypervisor takes turns (steal) that slow a whole-core loop's wall clock
    but not a quota-limited one's (a quota counts only the time a process ran). A worker's share is its CPU
    time over its wall-clock time for the loop: the quota itself, exact whatever the host does, where the
    speed also counts the work each stop costs (cold caches) and the host's noise.
    """
    topology = emulation.topology(workers)
    devices = emulation.device_list(workers)
    specs = {(a, b): _spec(topology, a, b) for a, b in link_pairs(topology)} if topology else {}
    pairs = list(specs)
    sizes = [int(min(max(bw * seconds_per_link, 1 << 20), 1 << 28)) // 4 * 4 for bw, _ in specs.values()]
    iterations, reference = 0, 0.0
    if speeds:
        cpu_loop_seconds(50)  # warm-up
        iterations = max(1, round(0.5 / (cpu_loop_seconds(200) / 200)))  # half a second on a whole core
        reference = min(cpu_loop(iterations)[1] for _ in range(3))
    per_rank = launch_emulated(_measure, pairs, sizes, iterations, nprocs=workers, emulation=emulation, timeout_s=600)
    measured = sorted(
        (m for r in per_rank for m in per_rank[r]["links"]), key=lambda m: pairs.index((m["from"], m["to"]))
    )
    links = []
    for m in measured:
        bandwidth, latency = specs[m["from"], m["to"]]
        links.append(
            {
                "from": m["from"],
                "to": m["to"],
                "spec_bytes_per_s": bandwidth,
                "measured_bytes_per_s": m["bytes"] / m["seconds"],
                "spec_latency_s": latency,
                "measured_latency_s": m["latency_s"],
                "bytes": m["bytes"],
            }
        )
    device_rows = [
        {
            "worker": r,
            "device": devices[r].name if devices else "unlimited",
            "spec_cores": devices[r].cores if devices else None,
            "measured_cores": reference / per_rank[r]["alone_s"],
            "measured_share": per_rank[r]["alone_cpu_s"] / per_rank[r]["alone_s"],
            "measured_cores_all_busy": reference / per_rank[r]["all_busy_s"],
        }
        for r in range(workers if speeds else 0)
    ]
    return {
        "network": emulation.network,
        "devices_spec": emulation.devices,
        "machine_cores": len(os.sched_getaffinity(0)),
        "reference_loop_cpu_s": reference,
        "links": links,
        "devices": device_rows,
    }


def _spec(topology: Topology, a: int, b: int) -> tuple[float, float]:
    """The rate (the slowest level crossed) and latency of a message from ``a`` to ``b``."""
    return topology.bandwidth_between(a, b), topology.level_between(a, b).latency
