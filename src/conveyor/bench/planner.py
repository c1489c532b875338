"""``conveyor bench planner``: how long the partitioning optimizer takes on growing models and clusters.

Synthetic chains of 32 and 128 layers (times, activation and weight sizes drawn from a fixed seed) are
planned on 16, 64 and 512 workers, 8 per server: ``8:12e9,N:1.25e9``, once without a memory limit and once
with :data:`MEMORY` bytes per worker under the PipeDream schedule (the memory check's own cost).
"""

from __future__ import annotations

import random
import time
from typing import Any

from conveyor.plan import Profile, Topology, optimize

__all__ = ["MEMORY", "run", "synthetic_chain"]

MEMORY = 2e9  # bytes per worker: binds for the synthetic chains (up to 50 MB of weights, 10 MB out per layer)


def synthetic_chain(layers: int, seed: int = 0) -> Profile:
    """A chain of ``layers`` layers with plausible, reproducible times and sizes."""
    rng = random.Random(seed)
    return Profile.chain(
        f"synthetic-{layers}",
        forward_s=[rng.uniform(1e-3, 5e-3) for _ in range(layers)],
        backward_s=[rng.uniform(2e-3, 1e-2) for _ in range(layers)],
        output_bytes=[rng.randint(10**5, 10**7) for _ in range(layers)],
        param_bytes=[rng.randint(0, 5 * 10**7) for _ in range(layers)],
    )


def run(layer_counts: tuple[int, ...] = (32, 128), worker_counts: tuple[int, ...] = (16, 64, 512)) -> dict[str, Any]:
    """Time one plan per (layers, workers) pair and return the JSON-ready report."""
    results = []
    for layers in layer_counts:
        profile = synthetic_chain(layers)
        for workers in worker_counts:
            topology = Topology.parse(f"8:12e9,{workers // 8}:1.25e9")
            start = time.perf_counter()
            plan = optimize(profile, topology)
            seconds = time.perf_counter() - start
            start = time.perf_counter()
            limited = optimize(profile, topology, memory=MEMORY)
            limited_seconds = time.perf_counter() - start
            results.append(
                {
                    "layers": layers,
                    "workers": workers,
                    "topology": str(topology),
                    "seconds": seconds,
                    "config": plan.config,
                    "seconds_with_memory_limit": limited_seconds,
                    "config_with_memory_limit": limited.config,
                    "peak_memory_bytes_with_limit": max(s.memory_bytes for s in limited.stages),
                }
            )
    config = {"layer_counts": list(layer_counts), "worker_counts": list(worker_counts), "memory_bytes": MEMORY}
    return {"config": config, "results": results}
