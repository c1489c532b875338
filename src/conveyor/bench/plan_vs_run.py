"""``conveyor bench plan-vs-run``: does the runtime deliver the throughput the planner predicts?

For a few plans of one synthetic profile (a straight pipeline, and the optimizer's replicated plans on
two worker counts), each planned stage becomes a fixed-latency stage whose forward and backward sleep
for the sum of its layers' profiled times. The plan runs in the runtime with the PipeDream schedule on
that many local processes, and the measured samples/s is compared with two predictions: the planner's
steady state (one minibatch per slowest-stage time) and the simulator's, which runs the very action
lists the executor runs and so includes the pipeline's fill and drain.

Then the planner's own choice: the shortlist (:func:`~conveyor.plan.shortlist`) of the same profile on 1 to
:attr:`PlanVsRunConfig.up_to` workers, its ``candidates`` fastest simulated layouts each run and measured the same
way. The report says whether the one chosen (the first) was the fastest measured, within the repeats' spread.
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
from conveyor.plan import Plan, Profile, Topology, optimize, shortlist
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
    up_to: int = 6  # the shortlist's workers: 1 to this many
    candidates: int = 4  # its fastest simulated layouts, each run

    def __post_init__(self) -> None:
        if min(self.minibatches, self.repeats, self.batch_size, self.features, self.up_to, self.candidates) < 1:
            raise InputError("minibatches, repeats, batch size, features, up_to and candidates must be at least 1")


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
    """Plan, predict, run and measure every case and the shortlist's candidates; return the JSON-ready report."""
    prof = profile()
    results = [
        _measured(cfg, prof, optimize(prof, Topology.parse(topology), straight=straight), case=name, topology=topology)
        for name, topology, straight in CASES
    ]
    simulated = shortlist(
        prof,
        Topology.parse(f"{cfg.up_to}:1e9"),
        schedules=["pipedream"],
        microbatches=lambda workers: 1,
        batches=cfg.minibatches,
        worker_counts=range(1, cfg.up_to + 1),
    )
    candidates = [
        _measured(cfg, prof, s.plan, case=f"candidate {i + 1}", topology=str(s.topology))
        for i, s in enumerate(simulated[: cfg.candidates])
    ]
    fastest = max(candidates, key=lambda r: r["measured_samples_per_s"])
    spread = max(_spread(r["wall_s_per_repeat"]) for r in candidates)
    return {
        "config": asdict(cfg),
        "profile": json.loads(prof.to_json()),
        "results": results,
        "candidates": candidates,
        "chosen": {
            "config": candidates[0]["config"],
            "fastest_measured": fastest["config"],
            "shortfall": 1 - candidates[0]["measured_samples_per_s"] / fastest["measured_samples_per_s"],
            "spread": spread,
            "is_fastest": fastest is candidates[0]
            or candidates[0]["measured_samples_per_s"] >= fastest["measured_samples_per_s"] * (1 - spread),
        },
    }


def _spread(walls: list[float]) -> float:
    """How much a plan's timed runs varied: their range over the median."""
    return (max(walls) - min(walls)) / statistics.median(walls)


def _measured(cfg: PlanVsRunConfig, prof: Profile, plan: Plan, *, case: str, topology: str) -> dict[str, Any]:
    """``plan`` run on its workers and simulated: its record in the report."""
    forward_s, backward_s = stage_times(plan, prof)
    replicas = plan.replicas
    schedule = make_schedule("pipedream", len(replicas), 1, cfg.minibatches, replicas)
    simulated_s = simulate(schedule, forward_s, backward_s).step_s
    emulation = Emulation(network=cfg.network, devices=cfg.devices)
    walls = launch_emulated(
        _worker, cfg, forward_s, backward_s, replicas, nprocs=plan.workers, emulation=emulation, timeout_s=600
    )[0]
    samples = cfg.minibatches * cfg.batch_size
    measured, simulated = samples / statistics.median(walls), samples / simulated_s
    planned = cfg.batch_size / plan.seconds_per_minibatch
    return {
        "case": case,
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
