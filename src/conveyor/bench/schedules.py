"""``conveyor bench schedules``: pipeline efficiency of every schedule on fixed-latency stages.

Each stage's forward sleeps ``t_f`` and its backward ``t_b``, so compute costs the same whatever the core
count, and what is measured is the schedule and the runtime: bubbles, transfers, Python overhead. Every
schedule, Conveyor's and ``torch.distributed.pipelining``'s, trains on the same ``steps`` batches of
``m`` microbatches in one job, after an untimed warm-up each, in ``repeats`` interleaved rounds; the
report gives the median round.

efficiency = microbatches x (t_f + t_b) / wall time: 1.0 would be a pipeline with no bubble. A flush
schedule's ideal is ``m / (m + p - 1)`` (a fill and a drain per step); an asynchronous one fills and
drains once for all ``N = steps x m`` microbatches: ``N / (N + p - 1)``. ``conveyor/dp`` is data
parallelism on the same ``p`` workers, each running all ``p`` stages on its share of every batch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from conveyor.bench.latency import FixedLatencyStage, mse, set_timer_slack_1us
from conveyor.emulate import Emulation, launch_emulated
from conveyor.errors import InputError
from conveyor.runtime import Pipeline
from conveyor.schedule import KINDS, make_schedule, simulate, twobw_min_microbatches

__all__ = ["BenchConfig", "run"]


@dataclass(frozen=True)
class BenchConfig:
    """What ``conveyor bench schedules`` runs."""

    stages: int = 4
    microbatches: int = 8
    steps: int = 20
    forward_ms: float = 10.0
    backward_ms: float = 20.0
    microbatch_size: int = 1
    features: int = 16
    repeats: int = 3
    network: str | None = None  # run on this emulated network (conveyor.emulate)
    devices: str | None = None  # emulated devices: CPU cores per worker

    def __post_init__(self) -> None:
        if min(self.stages, self.microbatches, self.steps, self.microbatch_size, self.features, self.repeats) < 1:
            raise InputError("stages, microbatches, steps, microbatch size, features and repeats must be at least 1")
        if self.forward_ms < 0 or self.backward_ms < 0 or self.forward_ms + self.backward_ms <= 0:
            raise InputError("--forward-ms and --backward-ms must be >= 0 and not both 0: they set the stage cost")


def _timed(run: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - start


def _repeat(step: Callable[[], Any], times: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(times):
            step()

    return run


def _torch_step(schedule: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    rank, last = dist.get_rank(), dist.get_world_size() - 1

    def step() -> None:
        if rank == 0:
            schedule.step(x, target=y if last == 0 else None)
        elif rank == last:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()

    return step


def _worker(cfg: BenchConfig) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    set_timer_slack_1us()
    rank, p = dist.get_rank(), cfg.stages
    stages = [FixedLatencyStage(cfg.forward_ms / 1e3, cfg.backward_ms / 1e3) for _ in range(p)]
    batch = cfg.microbatches * cfg.microbatch_size
    x, y = torch.randn(batch, cfg.features), torch.zeros(batch, cfg.features)
    sgd = partial(torch.optim.SGD, lr=1e-6)
    runs: dict[str, Callable[[], Any]] = {}
    warmups: list[Callable[[], Any]] = []
    pipes = {}
    for name in _conveyor_schedules(cfg):
        if name == "dp":
            pipe = Pipeline(
                stages, [p], microbatches=cfg.microbatches, loss_fn=mse, optimizer=sgd, schedule="flush", replicas=[p]
            )
        else:
            pipe = Pipeline(stages, [1] * p, microbatches=cfg.microbatches, loss_fn=mse, optimizer=sgd, schedule=name)
        pipes[f"conveyor/{name}"] = pipe
        if name != "dp" and not KINDS[name].synchronous:  # one run over all batches: one fill, one drain
            runs[f"conveyor/{name}"] = partial(pipe.train, [(x, y)] * cfg.steps)
            warmups.append(partial(pipe.train, [(x, y)] * 2))
        else:
            runs[f"conveyor/{name}"] = _repeat(partial(pipe.train_step, x, y), cfg.steps)
            warmups.append(partial(pipe.train_step, x, y))
    for name, cls in (("torch/gpipe", ScheduleGPipe), ("torch/1f1b", Schedule1F1B)):
        stage = PipelineStage(stages[rank], rank, p, torch.device("cpu"))
        step = _torch_step(cls(stage, cfg.microbatches, loss_fn=mse), sgd(stages[rank].parameters()), x, y)
        runs[name] = _repeat(step, cfg.steps)
        warmups.append(step)
    for warmup in warmups:
        warmup()  # untimed: first-message metadata, allocator, autograd caches
    # Rounds interleave the schedules, so a slow spell of the machine does not land on one schedule only.
    walls: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(cfg.repeats):
        for name, run in runs.items():
            walls[name].append(_timed(run))
    peaks = {name: (pipe.peak_stashed, pipe.peak_versions) for name, pipe in pipes.items()}
    all_peaks: list[Any] = [None] * p
    dist.all_gather_object(all_peaks, peaks)
    return {"walls": walls, "peaks": all_peaks}


def _conveyor_schedules(cfg: BenchConfig) -> list[str]:
    """Conveyor's schedules this configuration can run (2BW needs enough microbatches), and data parallelism
    when every worker gets the same share of a batch (so its ideal is no bubble at all)."""
    enough = cfg.microbatches >= twobw_min_microbatches([1] * cfg.stages)
    names = [n for n in KINDS if n != "2bw" or enough]
    return [*names, "dp"] if cfg.microbatches % cfg.stages == 0 else names


def _schedule_of(name: str, cfg: BenchConfig) -> Any:
    if name == "dp":
        return make_schedule("flush", 1, cfg.microbatches, cfg.steps, [cfg.stages])
    return make_schedule(name, cfg.stages, cfg.microbatches, cfg.steps)


def _flush_theory(stages: int, microbatches: int) -> float:
    """Ideal efficiency of a schedule that flushes every step, on equal stages: m / (m + p - 1)."""
    return microbatches / (microbatches + stages - 1)


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark on ``cfg.stages`` local processes and return its JSON-ready report."""
    emulation = Emulation(network=cfg.network, devices=cfg.devices)
    out = launch_emulated(_worker, cfg, nprocs=cfg.stages, emulation=emulation, timeout_s=900)[0]
    microbatches = cfg.steps * cfg.microbatches
    work_s = (cfg.forward_ms + cfg.backward_ms) / 1e3
    ideal_s = microbatches * work_s
    results = {}
    for name, walls in out["walls"].items():
        wall = statistics.median(walls)
        kind = name.split("/")[1]
        if kind == "dp":
            theory = 1.0  # no bubble; its cost is the gradient all-reduce, which the stages here make tiny
        elif kind in KINDS and not KINDS[kind].synchronous:
            theory = _flush_theory(cfg.stages, microbatches)
        else:
            theory = _flush_theory(cfg.stages, cfg.microbatches)
        entry = {
            "efficiency": ideal_s / wall,
            "theory": theory,
            "efficiency_vs_theory": ideal_s / wall / theory,
            "samples_per_s": microbatches * cfg.microbatch_size / wall,
            "wall_s": wall,
            "wall_s_per_repeat": walls,
        }
        if name.startswith("conveyor/"):
            sched = _schedule_of(kind, cfg)
            layers = cfg.stages if kind == "dp" else 1  # a data-parallel worker runs every stage
            sim = simulate(sched, layers * cfg.forward_ms / 1e3, layers * cfg.backward_ms / 1e3)
            entry["simulated_efficiency"] = ideal_s / sim.step_s
            entry["peak_stashed_per_worker"] = [p[name][0] for p in out["peaks"]]
            entry["simulated_peak_stashed_per_worker"] = sim.peak_stashed
            entry["peak_weight_versions_per_worker"] = [p[name][1] for p in out["peaks"]]
            entry["schedule_peak_weight_versions_per_worker"] = sched.peak_versions()
        results[name] = entry
    torch_1f1b = results["torch/1f1b"]["samples_per_s"]
    for entry in results.values():
        entry["speedup_vs_torch_1f1b"] = entry["samples_per_s"] / torch_1f1b
    return {"config": asdict(cfg), "results": results}
