"""``conveyor bench plan-vs-run``: does the runtime deliver the throughput the planner predicts?

For a few plans of one synthetic profile (a straight pipeline, and the optimizer's replicated plans on
two worker counts), each planned stage becomes a fixed-latency stage whose forward and backward sleep
for the sum of its layers' profiled times. The plan runs in the runtime with the PipeDream schedule on
that many local processes, and the measured samples/s is compared with two predictions: the planner's
steady state (one minibatch per slowest-stage time) and the simulator's, which runs the very action
lists the executor runs and so includes the pipeline's fill and drain.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from conveyor.bench.latency import FixedLatencyStage, mse, set_timer_slack_1us
from conveyor.emulate import Emulation, launch_emulated
from conveyor.errors import InputError
from conveyor.plan import Profile, Topology, optimize
from conveyor.plan.parts import stage_times
from conveyor.runtime import Pipeline
from conveyor.schedule import make_schedule, simulate

__all__ = ["CASES", "PlanVsRunConfig", "profile", "run"]

# (name, topology, straight)
CASES = (
    ("straight, 4 workers", "4:1e9", True),
    ("planned, 4 workers", "4:1e9", False),
    ("planned, 6 workers", "6:1e9", False),
)


@dataclass(frozen=True)
class PlanVsRunConfig:
    """What ``conveyor bench plan-vs-run`` runs."""

    minibatches: int = 60
    repeats: int = 3
    batch_size: int = 1
    features: int = 16
    network: str | None = None  # run on this emulated network (conveyor.emulate)
    devices: str | None = None  # emulated devices: CPU cores per worker

    def __post_init__(self) -> None:
        if min(self.minibatches, self.repeats, self.batch_size, self.features) < 1:
            raise InputError("minibatches, repeats, batch size and features must be at least 1")


def profile() -> Profile:
    """Five layers: a heavy first one (worth replicating: few weights) and a last one with 400 MB of weights
    (too costly to all-reduce over 1 GB/s links), like VGG's convolutions and fully connected layers."""
    forward = [12e-3, 3e-3, 3e-3, 3e-3, 3e-3]
    return Profile.chain(
        "plan-vs-run",
        forward_s=forward,
        backward_s=[2 * f for f in forward],
        output_bytes=[4096] * 5,
        param_bytes=[4, 4, 4, 4, 400_000_000],
        batch_size=1,
    )


def _worker(cfg: PlanVsRunConfig, forward_s: list[float], backward_s: list[float], replicas: list[int]) -> list[float]:
    set_timer_slack_1us()
    stages = [FixedLatencyStage(f, b) for f, b in zip(forward_s, backward_s, strict=True)]
    pipe = Pipeline(
        stages,
        [1] * len(stages),
        microbatches=1,
        loss_fn=mse,
        optimizer=partial(torch.optim.SGD, lr=1e-6),
        schedule="pipedream",
        replicas=replicas,
    )
    x, y = torch.randn(cfg.batch_size, cfg.features), torch.zeros(cfg.batch_size, cfg.features)
    pipe.train([(x, y)] * 2 * math.lcm(*replicas))  # warm-up, untimed
    walls = []
    for _ in range(cfg.repeats):
        dist.barrier()
        start = time.perf_counter()
        pipe.train([(x, y)] * cfg.minibatches)
        dist.barrier()
        walls.append(time.perf_counter() - start)
    return walls


def run(cfg: PlanVsRunConfig) -> dict[str, Any]:
    """Plan, predict, run and measure every case; return the JSON-ready report."""
    prof = profile()
    results = []
    for name, topology, straight in CASES:
        plan = optimize(prof, Topology.parse(topology), straight=straight)
        forward_s, backward_s = stage_times(plan, prof)
        replicas = [st.replicas for st in plan.stages]
        schedule = make_schedule("pipedream", len(replicas), 1, cfg.minibatches, replicas)
        simulated_s = simulate(schedule, forward_s, backward_s).step_s
        emulation = Emulation(network=cfg.network, devices=cfg.devices)
        walls = launch_emulated(
            _worker, cfg, forward_s, backward_s, replicas, nprocs=plan.workers, emulation=emulation, timeout_s=600
        )[0]
        wall = statistics.median(walls)
        samples = cfg.minibatches * cfg.batch_size
        measured, simulated = samples / wall, samples / simulated_s
        planned = cfg.batch_size / plan.seconds_per_minibatch
        results.append(
            {
                "case": name,
                "topology": topology,
                "config": plan.config,
                "stages": [[st.first_layer, st.last_layer] for st in plan.stages],
                "measured_samples_per_s": measured,
                "simulated_samples_per_s": simulated,
                "planner_samples_per_s": planned,
                "error_vs_simulated": measured / simulated - 1,
                "error_vs_planner": measured / planned - 1,
                "wall_s_per_repeat": walls,
            }
        )
    return {"config": asdict(cfg), "profile": json.loads(prof.to_json()), "results": results}
