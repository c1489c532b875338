"""``conveyor bench costs``: the planner's cost terms against measurements on the emulated cluster.

Two terms are measured, each by the same calls the runtime makes, on real processes whose links the
kernel shapes (:mod:`conveyor.emulate`; needs root):

- **all-reduce**: ``dist.all_reduce`` of one flat float32 tensor (what a ``REDUCE`` sends) of 1, 10 and
  100 MB among 2, 4 and 8 workers on one level at two bandwidths, and among 4 workers across two servers
  (the ring then crosses the servers' uplinks). Model: :func:`~conveyor.plan.allreduce_s` at the ring's
  bandwidth (:meth:`Topology.bandwidth_between` of its first and last worker) with the latency of a small
  message measured on the same cluster (the software's own: the topology sets none).
- **activation transfers**: a cut between stages of ``r1`` and ``r2`` replicas, microbatch ``k`` sent from
  replica ``k mod r1`` to ``k mod r2`` with its gradient coming back, and a middle stage that receives and
  sends both; every transfer in flight at once, so the links set the pace. Model: the slowest stage's link
  term of :func:`~conveyor.plan._cost_model.stage_seconds` (``(C_in + C_out) / (r B)``) times the microbatches.
- **overlap**: a worker computes a fixed amount of work per microbatch (as long as the microbatch's
  transfer at the link's rate) while its asynchronous sends go out, as a stage's sends do. The model
  overlaps them (the larger of the compute alone and the transfers); the report also gives their sum.

Goal: each within 10% of its model. Each case runs ``repeats`` times; the report keeps every run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from rich.progress import Progress

from conveyor.emulate import Emulation, launch_emulated
from conveyor.emulate.parts import cpu_loop_seconds
from conveyor.errors import InputError
from conveyor.plan import Topology, allreduce_s
from conveyor.plan.parts import stage_seconds

__all__ = ["CostsBenchConfig", "run"]

_PINGS = 40


@dataclass(frozen=True)
class CostsBenchConfig:
    """What ``conveyor bench costs`` measures."""

    bandwidths: tuple[float, ...] = (1.25e7, 1.25e8)
    replicas: tuple[int, ...] = (2, 4, 8)
    sizes_mb: tuple[float, ...] = (1.0, 10.0, 100.0)
    transfer_mb: float = 2.0
    microbatches: int = 12
    layouts: tuple[str, ...] = ("1-1", "2-1", "1-2", "2-2", "1-1-1")  # replicas per stage, for the transfers
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.microbatches < 1 or min(self.replicas) < 2 or min(self.bandwidths) <= 0:
            raise InputError("repeats and microbatches must be >= 1, replicas >= 2, bandwidths > 0")


def _latency() -> float:
    """Half the median round trip of a small message between workers 0 and 1 (others wait)."""
    rank, small, rtts = dist.get_rank(), torch.zeros(1), []
    for _ in range(_PINGS):
        start = time.perf_counter()
        if rank == 0:
            dist.send(small, 1)
            dist.recv(small, 1)
        elif rank == 1:
            dist.recv(small, 0)
            dist.send(small, 0)
        rtts.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(rtts[5:]) / 2


def _allreduces(sizes: list[int], repeats: int) -> dict[str, Any]:
    """Each size ``repeats`` times: the slowest worker's seconds, from a barrier to its all-reduce's end."""
    latency = _latency()
    dist.all_reduce(torch.zeros(1024))  # the ring's connections, opened outside the timing
    times = []
    for size in sizes:
        flat = torch.ones(size // 4)
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(float(took))
    return {"latency_s": latency, "seconds": times}


def _transfers(stages: list[int], nbytes: int, microbatches: int, repeats: int) -> list[float]:
    """Stages of ``stages[s]`` replicas on consecutive ranks; every microbatch's activation goes forward
    through every cut (replica ``k mod r``) and its gradient back, all posted at once. Seconds per run."""
    rank, first = dist.get_rank(), [sum(stages[:s]) for s in range(len(stages))]
    owner = [[first[s] + k % r for s, r in enumerate(stages)] for k in range(microbatches)]
    buf = torch.zeros(nbytes // 4)
    runs = []
    for repeat in range(repeats + 1):  # the first run opens the connections
        dist.barrier()
        start, ops = time.perf_counter(), []
        for k in range(microbatches):
            for s in range(len(stages) - 1):
                a, b = owner[k][s], owner[k][s + 1]
                if rank == a:
                    ops += [dist.P2POp(dist.isend, buf, b), dist.P2POp(dist.irecv, torch.empty_like(buf), b)]
                elif rank == b:
                    ops += [dist.P2POp(dist.irecv, torch.empty_like(buf), a), dist.P2POp(dist.isend, buf, a)]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if repeat:
            runs.append(float(took))
    return runs


def _overlap(nbytes: int, microbatches: int, iterations: int, repeats: int) -> dict[str, list[float]]:
    """Worker 0 sends ``microbatches`` messages asynchronously, computing ``iterations`` matmuls after each;
    worker 1 receives them. Seconds of the compute alone, and of both, per run."""
    rank, buf, small = dist.get_rank(), torch.zeros(nbytes // 4), torch.zeros(1)
    out: dict[str, list[float]] = {"alone_s": [], "both_s": []}
    for _ in range(repeats + 1):  # the first run opens the connection
        if rank == 0:
            out["alone_s"].append(cpu_loop_seconds(iterations * microbatches))
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            works = []
            for _ in range(microbatches):
                works.append(dist.isend(buf, 1))
                cpu_loop_seconds(iterations)
            for work in works:
                assert work is not None  # None only for a rank outside the group
                work.wait()
            dist.recv(small, 1)  # the receiver's word that it has everything
        else:
            for _ in range(microbatches):
                dist.recv(torch.empty_like(buf), 0)
            dist.send(small, 0)
        out["both_s"].append(time.perf_counter() - start)
    return {key: values[1:] for key, values in out.items()}


def _allreduce_rows(cfg: CostsBenchConfig, network: str, workers: int) -> list[dict[str, Any]]:
    topology = Topology.parse(network)
    sizes = [int(mb * 1e6) // 4 * 4 for mb in cfg.sizes_mb]
    out = launch_emulated(_allreduces, sizes, cfg.repeats, nprocs=workers, emulation=Emulation(network=network))[0]
    bandwidth, rows = topology.bandwidth_between(0, workers - 1), []
    for i, size in enumerate(sizes):
        model = allreduce_s(size, workers, out["latency_s"], bandwidth)
        for repeat, seconds in enumerate(out["seconds"][i * cfg.repeats : (i + 1) * cfg.repeats]):
            rows.append(
                {
                    "network": network,
                    "workers": workers,
                    "bytes": size,
                    "repeat": repeat,
                    "latency_s": out["latency_s"],
                    "model_s": model,
                    "measured_s": seconds,
                    "error": seconds / model - 1,
                }
            )
    return rows


def _transfer_rows(cfg: CostsBenchConfig, bandwidth: float, stages: list[int]) -> list[dict[str, Any]]:
    workers, nbytes = sum(stages), int(cfg.transfer_mb * 1e6) // 4 * 4
    network = f"{workers}:{bandwidth:g}"
    topology = Topology.parse(network)
    runs = launch_emulated(
        _transfers, stages, nbytes, cfg.microbatches, cfg.repeats, nprocs=workers, emulation=Emulation(network=network)
    )[0]
    cuts = [0, *[nbytes] * (len(stages) - 1), 0]
    per_minibatch = max(
        float(
            stage_seconds(
                "physical", topology, k=0, inner=0.0, weights=0.0, cut_in=cuts[s], cut_out=cuts[s + 1], units=r
            )
        )
        for s, r in enumerate(stages)
    )
    model = per_minibatch * cfg.microbatches
    return [
        {
            "network": network,
            "stages": "-".join(map(str, stages)),
            "bytes": nbytes,
            "microbatches": cfg.microbatches,
            "repeat": repeat,
            "model_s": model,
            "measured_s": seconds,
            "error": seconds / model - 1,
        }
        for repeat, seconds in enumerate(runs)
    ]


def _overlap_rows(cfg: CostsBenchConfig, bandwidth: float) -> list[dict[str, Any]]:
    nbytes, network = int(cfg.transfer_mb * 1e6) // 4 * 4, f"2:{bandwidth:g}"
    transfer = cfg.microbatches * nbytes / bandwidth  # the stage's link term: it sends, and receives nothing
    per_loop = cpu_loop_seconds(200) / 200
    iterations = max(1, round(transfer / cfg.microbatches / per_loop))  # compute as long as the transfer
    out = launch_emulated(
        _overlap, nbytes, cfg.microbatches, iterations, cfg.repeats, nprocs=2, emulation=Emulation(network=network)
    )[0]
    rows = []
    for repeat, (alone, both) in enumerate(zip(out["alone_s"], out["both_s"], strict=True)):
        model = max(alone, transfer)
        rows.append(
            {
                "network": network,
                "bytes": nbytes,
                "microbatches": cfg.microbatches,
                "repeat": repeat,
                "compute_s": alone,
                "transfer_s": transfer,
                "model_s": model,
                "summed_s": alone + transfer,
                "measured_s": both,
                "error": both / model - 1,
            }
        )
    return rows


def run(cfg: CostsBenchConfig) -> dict[str, Any]:
    """Measure every case; return the JSON-ready report."""
    allreduce_cases = [(f"{r}:{bw:g}", r) for bw in cfg.bandwidths for r in cfg.replicas]
    slow = min(cfg.bandwidths)
    allreduce_cases.append((f"2:{10 * slow:g},2:{slow:g}", 4))  # a ring across two servers' uplinks
    transfer_cases = [(bw, [int(r) for r in layout.split("-")]) for bw in cfg.bandwidths for layout in cfg.layouts]
    allreduces, transfers, overlap = [], [], []
    with Progress(transient=True) as progress:
        task = progress.add_task("measuring", total=len(allreduce_cases) + len(transfer_cases) + len(cfg.bandwidths))
        for network, workers in allreduce_cases:
            allreduces += _allreduce_rows(cfg, network, workers)
            progress.advance(task)
        for bandwidth, stages in transfer_cases:
            transfers += _transfer_rows(cfg, bandwidth, stages)
            progress.advance(task)
        for bandwidth in cfg.bandwidths:
            overlap += _overlap_rows(cfg, bandwidth)
            progress.advance(task)
    errors = [abs(row["error"]) for row in allreduces + transfers + overlap]
    within = sum(e <= 0.1 for e in errors)
    return {
        "config": asdict(cfg),
        "allreduce": allreduces,
        "transfers": transfers,
        "overlap": overlap,
        "worst_error": max(errors),
        "within_10_percent": within,
        "cases": len(errors),
    }
