"""``conveyor bench elastic``: revocations and additions on the emulated cluster, against torchrun's restart.

One job (``--model``, ``--workers`` of which ``--reliable`` are reliable) runs three ways, on the same
machine and the same data:

- **uninterrupted**: ``conveyor train --reliable`` with no fault (``--elastic-layout``: data parallelism, or
  a pipeline the planner re-plans at every change; the report then lists each generation's layout);
- **conveyor**: the same with faults from the emulated cluster (cgroups): the ``--revoke`` transient workers
  revoked at once without notice at 10% of the uninterrupted run's training time, added back at 20%,
  revoked again with a notice (``--grace`` seconds from SIGTERM to SIGKILL) at 60%, added back at 72%;
- **torchrun**: :mod:`conveyor.bench._restart` (the same update) under ``torchrun --max-restarts``, its
  workers killed at the same moments (SIGTERM then SIGKILL for the notice; it has no use for one), resuming
  from the checkpoint rank 0 writes every ``--checkpoint-every`` steps (default: once an epoch).

Every time is counted from the training start (worker 0's first step, not the processes' start). Per event:
``recovery_s``, from the revocation (or addition) to the next completed step after the job's response to
it (conveyor: the generation that includes the change; torchrun: the restart), and ``steps_redone``.
``committed_steps_lost`` checks conveyor's rule: a step is *committed* once the reliable tier holds it, and
no recovery may resume before a step committed before the fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.config import TrainConfig
from conveyor.job import model_and_data, read_jsonl, train_elastic

__all__ = ["GOALS", "ElasticBenchConfig", "committed_steps_lost", "run"]

GOALS = {"recovery_s": 10.0, "speedup_vs_torchrun": 5.0, "committed_steps_lost": 0, "accuracy_points": 1.0}
# (kind, with notice, share of the uninterrupted run's training time): each phase done before the next begins
# (a worker added takes seconds to start; one revoked before it has joined would see no notice).
PHASES = (("revoke", False, 0.10), ("add", False, 0.20), ("revoke", True, 0.60), ("add", True, 0.72))


@dataclass(frozen=True)
class ElasticBenchConfig:
    """What ``conveyor bench elastic`` runs; each field is an option of the same name."""

    model: str = "vgg16"
    workers: int = 6
    reliable: int = 1
    revoke: int = 3  # transient workers revoked at once, the last ones
    grace: float = 5.0  # seconds from the notice to the kill
    epochs: int = 24
    batch_size: int = 64
    lr: float = 0.05
    seed: int = 0
    checkpoint_every: int | None = None  # torchrun's checkpoints, in steps (default: one epoch)
    max_restarts: int = 5
    stage_workers: tuple[int, ...] = ()  # measure each AgileML stage's throughput at these worker counts
    stage_epochs: int = 3
    elastic_layout: str = "data"  # conveyor's (and the uninterrupted run's): data parallelism or a pipeline


def _train_config(cfg: ElasticBenchConfig, folder: Path, faults: str | None) -> TrainConfig:
    return TrainConfig.from_options(
        model=cfg.model,
        workers=cfg.workers,
        reliable=cfg.reliable,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
        run_dir=str(folder),
        faults=faults,
        elastic_layout=cfg.elastic_layout,
    )


def _faults(cfg: ElasticBenchConfig, train_s: float) -> tuple[str, list[tuple[str, bool, float]]]:
    victims = list(range(cfg.workers - cfg.revoke, cfg.workers))
    items, events = [], []
    for kind, notice, share in PHASES:
        at = round(share * train_s, 2)
        grace = f",grace={cfg.grace:g}" if kind == "revoke" and notice else ""
        items += [f"{kind}:worker={w},at={at}{grace}" for w in victims]
        events.append((kind, notice, at))
    return ";".join(items), events


def _conveyor_events(folder: Path, phases: list[tuple[str, bool, float]], victims: list[int]) -> list[dict[str, Any]]:
    """Per phase: the time from its fault to the next step after the generation that took the change in."""
    faults = [f for f in read_jsonl(folder / "faults.jsonl") if f["event"] == "begin"]
    log = read_jsonl(folder / "elastic.jsonl")
    gens = {e["gen"]: e for e in log if e["event"] == "generation"}  # the generations that completed
    decided = [e for e in log if e["event"] == "decided" and e["gen"] in gens]
    resumed = [e for e in log if e["event"] == "resumed"]
    events = []
    for kind, notice, at in phases:
        wall = next((f["wall"] for f in faults if f["kind"] == kind and f["at"] == at), None)
        if wall is None:  # the run ended before this phase's fault (it ran faster than the uninterrupted one)
            events.append(
                {
                    "kind": kind,
                    "workers": victims,
                    "notice": notice and kind == "revoke",
                    "recovery_s": None,
                    "steps_redone": 0,
                    "missed": "the run ended first",
                }
            )
            continue
        answer = next((d for d in decided if d["wall"] >= wall and ("joined" in d["reason"]) == (kind == "add")), None)
        after = next((r for r in resumed if answer is not None and r["gen"] >= answer["gen"]), None)
        span = [g for g in gens.values() if g["wall"] >= wall and (after is None or g["gen"] <= after["gen"])]
        events.append(
            {
                "kind": kind,
                "workers": victims,
                "notice": notice and kind == "revoke",
                "recovery_s": None if after is None else round(after["wall"] - wall, 3),
                "steps_redone": sum(g["steps_redone"] for g in span),
            }
        )
    return events


def committed_steps_lost(folder: Path) -> int:
    """Steps committed (held by the reliable tier) before a recovery that resumed before them: must be 0."""
    gens = [e for e in read_jsonl(folder / "elastic.jsonl") if e["event"] == "generation"]
    return sum(max(0, g["committed"] - g["resume_step"]) for g in gens)


def _torchrun(cfg: ElasticBenchConfig, folder: Path, events: list[tuple[str, bool, float]]) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    _, data = model_and_data(TrainConfig.from_options(model=cfg.model, seed=cfg.seed))
    per_epoch = -(-data.samples // cfg.batch_size)
    every = cfg.checkpoint_every or per_epoch
    job = TrainConfig.from_options(
        model=cfg.model, epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr, seed=cfg.seed
    )
    config = json.dumps(job.options())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.workers}",
        f"--max-restarts={cfg.max_restarts}",
        "--monitor-interval=0.1",
        "-m",
        "conveyor.bench._restart",
        "--config",
        config,
        "--folder",
        str(folder),
        "--checkpoint-every",
        str(every),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    began = time.time()
    log = (folder / "torchrun.log").open("w")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    kills: list[tuple[str, bool, float]] = []

    def revoke() -> None:  # at the same training-relative times as the emulated cluster's faults
        while not (folder / "training-started").exists() and proc.poll() is None:
            time.sleep(0.05)
        start = time.time()
        for kind, notice, at in events:
            time.sleep(max(0.0, start + at - time.time()))
            if kind != "revoke" or proc.poll() is not None:
                kills.append((kind, notice, time.time()))
                continue
            pids = [int((folder / f"pid-{r}").read_text()) for r in range(cfg.workers - cfg.revoke, cfg.workers)]
            for pid in pids:  # its workers die of a SIGTERM at once: they have no use for a notice
                _signal(pid, signal.SIGTERM if notice else signal.SIGKILL)
            kills.append((kind, notice, time.time()))

    thread = threading.Thread(target=revoke, daemon=True)
    thread.start()
    proc.wait(timeout=1800)
    log.close()
    thread.join(5)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun baseline failed ({proc.returncode}): see {folder / 'torchrun.log'}")
    steps = read_jsonl(folder / "steps.jsonl")
    out = []
    for kind, notice, wall in kills:
        if kind == "add":  # torchrun restarted every worker already: an addition changes nothing
            out.append({"kind": kind, "workers": [], "notice": False, "recovery_s": 0.0, "steps_redone": 0})
            continue
        before = [s for s in steps if s["wall"] <= wall]
        restart = before[-1]["restart"] if before else 0
        after = next((s for s in steps if s["restart"] > restart), None)
        redone = (before[-1]["step"] - after["step"] + 1) if before and after else 0
        recovery = None if after is None else round(after["wall"] - wall, 3)
        out.append(
            {
                "kind": kind,
                "workers": list(range(cfg.workers - cfg.revoke, cfg.workers)),
                "notice": notice,
                "recovery_s": recovery,
                "steps_redone": redone,
            }
        )
    metrics = read_jsonl(folder / "metrics.jsonl")
    return {
        "events": out,
        "final_accuracy": metrics[-1]["accuracy"] if metrics else None,
        "seconds": round((steps[-1]["wall"] if steps else time.time()) - began, 3),
    }


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already
        os.kill(pid, sig)


# Each stage forced through the thresholds: (sync_max, backup_only_min).
_FORCED = {1: (1e9, 1e9), 2: (0.0, 1e9), 3: (0.0, 0.0)}


def measure_stages(cfg: ElasticBenchConfig, folder: Path) -> list[dict[str, Any]]:
    """Training samples/s of each AgileML stage, forced, for each worker count of ``cfg.stage_workers`` (the
    reliable ones included): what the stage thresholds' defaults rest on. The first epoch (start-up) is left
    out."""
    rows = []
    _, data = model_and_data(TrainConfig.from_options(model=cfg.model, seed=cfg.seed))
    for workers in cfg.stage_workers:
        for stage, (sync_max, backup_only_min) in _FORCED.items():
            run_dir = folder / f"stage{stage}-{workers}"
            job = TrainConfig.from_options(
                model=cfg.model,
                workers=workers,
                reliable=cfg.reliable,
                epochs=cfg.stage_epochs,
                batch_size=cfg.batch_size,
                lr=cfg.lr,
                seed=cfg.seed,
                run_dir=str(run_dir),
                sync_max=sync_max,
                backup_only_min=backup_only_min,
            )
            summary = train_elastic(job)
            seconds = summary.epoch_seconds[-1] - summary.epoch_seconds[0]
            samples = data.samples * (len(summary.epoch_seconds) - 1)
            rows.append(
                {
                    "workers": workers,
                    "transient_per_reliable": (workers - cfg.reliable) / cfg.reliable,
                    "stage": stage,
                    "samples_per_s": round(samples / seconds, 1),
                }
            )
    return rows


def run(cfg: ElasticBenchConfig, folder: Path) -> dict[str, Any]:
    """Run the three jobs in ``folder`` (one run folder each); return the report (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    if cfg.stage_workers and not cfg.epochs:
        return {"config": asdict(cfg), "stages": measure_stages(cfg, folder)}
    base = train_elastic(_train_config(cfg, folder / "uninterrupted", None))
    train_s = base.seconds
    faults, events = _faults(cfg, train_s)
    elastic = train_elastic(_train_config(cfg, folder / "conveyor", faults))
    victims = list(range(cfg.workers - cfg.revoke, cfg.workers))
    conveyor_events, lost = (
        _conveyor_events(folder / "conveyor", events, victims),
        committed_steps_lost(folder / "conveyor"),
    )
    torchrun = _torchrun(cfg, folder / "torchrun", events)
    keep = ("gen", "reason", "compute", "layout", "from", "steps_redone")
    generations = [{k: g[k] for k in keep} for g in elastic.generations]
    report: dict[str, Any] = {
        "config": {**asdict(cfg), "faults": faults},
        "uninterrupted": {"final_accuracy": base.accuracy[-1], "seconds": base.seconds},
        "conveyor": {
            "events": conveyor_events,
            "committed_steps_lost": lost,
            "final_accuracy": elastic.accuracy[-1] if elastic.accuracy else None,
            "seconds": elastic.seconds,
            "generations": generations,
        },
        "torchrun": torchrun,
    }
    report["goals"] = _goals(report)
    if cfg.stage_workers:
        report["stages"] = measure_stages(cfg, folder)
    return report


def _goals(report: dict[str, Any]) -> dict[str, Any]:
    ours = [e for e in report["conveyor"]["events"] if e["kind"] == "revoke"]
    theirs = [e for e in report["torchrun"]["events"] if e["kind"] == "revoke"]
    missed = [e["kind"] for e in report["conveyor"]["events"] if "missed" in e]  # faults the run ended before
    worst = max((e["recovery_s"] for e in ours if e["recovery_s"] is not None), default=None)
    pairs = [
        (a["recovery_s"], b["recovery_s"])
        for a, b in zip(ours, theirs, strict=False)
        if a["recovery_s"] and b["recovery_s"]
    ]
    speedup = min((b / a for a, b in pairs), default=None)
    acc, base = report["conveyor"]["final_accuracy"], report["uninterrupted"]["final_accuracy"]
    points = None if acc is None else round(100 * (base - acc), 2)
    return {
        "phases_missed": missed,
        "worst_recovery_s": worst,
        "recovery_met": worst is not None and worst <= GOALS["recovery_s"] and "revoke" not in missed,
        "min_speedup_vs_torchrun": None if speedup is None else round(speedup, 2),
        "speedup_met": speedup is not None and speedup >= GOALS["speedup_vs_torchrun"],
        "committed_steps_lost_met": report["conveyor"]["committed_steps_lost"] == 0,
        "accuracy_points_below_uninterrupted": points,
        "accuracy_met": points is not None and points <= GOALS["accuracy_points"],
    }
