"""``conveyor train --reliable K``: the main job as elastic data parallelism, or an elastic pipeline
(``--elastic-layout pipeline``), that survives revocations.

The first ``K`` workers are reliable (worker 0 hosts the store and coordinates), the rest transient: an
emulated revocation (``--faults revoke:...``, ``trace:...``) or a real SIGTERM/SIGKILL takes workers away,
and the others go on (:mod:`conveyor.elastic`); an emulated addition, or ``conveyor train --join HOST:PORT``
on any machine that reaches worker 0, adds one. The run folder gets ``metrics.jsonl`` (per epoch, from the
worker that evaluates), ``elastic.jsonl`` (every generation: why, AgileML's stage, who owns what, the step
it resumed from, the steps redone, the seconds it took; and when each resumed), ``checkpoint.pt``,
``summary.json`` and ``accuracy.png``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from conveyor.config import ElasticConfig, TrainConfig
from conveyor.elastic import ElasticJob, ElasticOptions, ElasticTrainer, WorkerOutcome, launch_elastic, planned_layouts
from conveyor.elastic.parts import StageLayout, agreed_layouts, connect
from conveyor.emulate import Emulation
from conveyor.errors import InputError
from conveyor.job._config import loss_and_optimizer
from conveyor.job._layout import PIPELINE_MICROBATCHES
from conveyor.job._lease import lease_expires, read_lease
from conveyor.job._model import model_and_data
from conveyor.job._report import read_jsonl
from conveyor.job._resources import ResourceLog
from conveyor.job._summary import ElasticSummary, discarded_unless_trained, open_run_folder, write_run_folder
from conveyor.plan import Profile
from conveyor.runtime import profile, resolve_device

__all__ = ["join_elastic", "train_elastic"]

DEFAULT_BANDWIDTH = 1e9  # bytes/s a pipeline is planned for without an emulated network


def _section(cfg: TrainConfig) -> tuple[ElasticConfig, int]:
    """The elastic section of a job that starts here, and its reliable workers."""
    assert cfg.elastic is not None and cfg.elastic.reliable is not None  # train() sends only such jobs here
    return cfg.elastic, cfg.elastic.reliable


def _options(elastic: ElasticConfig, reliable: int) -> ElasticOptions:
    return ElasticOptions(
        reliable=reliable,
        lost_s=elastic.lost_s,
        backup_every=elastic.backup_every,
        sync_max=elastic.sync_max,
        backup_only_min=elastic.backup_only_min,
    )


def check_faults(emulation: Emulation, reliable: int, workers: int) -> None:
    """Refuse, in one line, a fault plan that revokes a reliable worker."""
    if not 1 <= reliable <= workers:
        raise InputError(f"--reliable {reliable}: give 1 to {workers} (the job's workers)")
    for fault in emulation.fault_list(workers) if emulation.faults else []:
        if fault.kind == "revoke" and min(fault.workers) < reliable:
            raise InputError(
                f"--faults revokes worker {min(fault.workers)}, which is reliable (--reliable {reliable}): "
                f"revoke transient workers ({reliable} to {workers - 1}) only"
            )


def _layouts(
    cfg: TrainConfig,
    model: nn.Sequential,
    *,
    example: torch.Tensor,
    worker: int | None,
    host: str,
    port: int,
    workers: int,
) -> Callable[[int], StageLayout] | None:
    """``--elastic-layout pipeline``: the planner's layouts from worker 0's profile of the model at the
    microbatch size (every worker plans from the same one, through the store), on the emulated network's
    slowest link, else on 1 GB/s (gloo on one machine's loopback)."""
    if _section(cfg)[0].layout == "data":
        return None
    store = connect(host, port, is_leader=False)
    microbatches = cfg.layout.microbatches or PIPELINE_MICROBATCHES
    if worker == 0:
        microbatch = example[: max(1, cfg.optimizer.batch_size // microbatches)]
        device = resolve_device(cfg.run.device)  # where the job computes
        measured = profile(copy.deepcopy(model), microbatch, name=cfg.model.name, device=device, repeats=3, warmup=1)
        topology = Emulation.of(cfg.emulation).topology(workers)
        bandwidth = min(level.bandwidth for level in topology.levels) if topology is not None else DEFAULT_BANDWIDTH
        store.set("bandwidth", repr(bandwidth))
        store.set("profile", measured.to_json())  # (a copy: profiling moves BatchNorm's running statistics)
    prof = Profile.from_json(store.get("profile").decode(), "the job's profile")
    return agreed_layouts(planned_layouts(prof, float(store.get("bandwidth")), microbatches), store)


def _lease_stop(lease: str | None) -> Callable[[float], bool] | None:
    """``--lease FILE``, re-read after each epoch by the worker that evaluates: whether one more epoch of the
    run's mean length would end past it."""
    if lease is None:
        return None
    return lambda epoch_s: lease_expires(read_lease(lease), epoch_s, time.time())


def _worker(worker: int | None, host: str, port: int, cfg: TrainConfig, run_dir: str, workers: int) -> WorkerOutcome:
    model, data = model_and_data(cfg)
    train_x, test_x = data.tensor_inputs("an elastic job")
    loss_fn, make_optimizer = loss_and_optimizer(cfg.optimizer, data.sequence)
    layout = _layouts(cfg, model, example=train_x, worker=worker, host=host, port=port, workers=workers)
    trainer = ElasticTrainer(
        model,
        loss_fn=loss_fn,
        make_optimizer=make_optimizer,
        worker=worker,
        host=host,
        port=port,
        options=_options(*_section(cfg)),
        workers=workers,
        log_dir=Path(run_dir),
        layout=layout,
        microbatches=cfg.layout.microbatches or PIPELINE_MICROBATCHES,
        device=resolve_device(cfg.run.device),
    )
    if worker == 0:
        trainer.store.set("config", json.dumps(cfg.options()))  # what a worker joining by hand needs
        where = (
            f"{host}:{port}" if host != "127.0.0.1" else f"127.0.0.1:{port} here, ADDRESS:{port} from another machine"
        )
        Console().print(
            f"elastic job: workers 0-{_section(cfg)[1] - 1} reliable; add one with conveyor train --join {where} "
            "(across machines, GLOO_SOCKET_IFNAME set to the interface that reaches the other, on both)",
            highlight=False,
        )
    job = ElasticJob(
        train_x,
        data.train_y,
        test_x,
        data.test_y,
        cfg.optimizer.batch_size,
        cfg.run.epochs,
        cfg.run.seed,
        cfg.run.target_accuracy,
        stop_after=_lease_stop(cfg.run.lease),
    )
    steps = cfg.run.epochs * -(-data.samples // cfg.optimizer.batch_size)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}"),
        TimeElapsedColumn(),
        disable=worker != 0,
    ) as bar:
        task = bar.add_task("training", total=steps)
        holdings = ResourceLog(
            Path(run_dir) / "resources.jsonl",
            worker=trainer.worker,
            every_s=cfg.run.resources_every,
            store=trainer.store,
        )
        with holdings:
            outcome = trainer.fit(job, lambda t: bar.update(task, completed=t + 1))
    return dataclasses.replace(outcome, weights=None)  # the launcher needs none of them


def train_elastic(cfg: TrainConfig) -> ElasticSummary:
    """Run ``cfg`` as an elastic job on local workers (or the emulated cluster); return the run's summary."""
    run_dir = open_run_folder(
        cfg.run.run_dir,
        cfg.model.name,
        ("metrics.jsonl", "elastic.jsonl", "resources.jsonl"),
        cfg.to_toml(),
        overwrite=cfg.run.overwrite,
    )
    if cfg.run.lease:
        read_lease(cfg.run.lease)  # fail here, with one line, rather than in the worker that evaluates
    workers = cfg.layout.workers or 4
    emulation = Emulation.of(cfg.emulation)
    check_faults(emulation, _section(cfg)[1], workers)
    with discarded_unless_trained(run_dir):
        launch_elastic(_worker, cfg, str(run_dir), workers, nprocs=workers, folder=run_dir, emulation=emulation)
    history = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "elastic.jsonl")
    summary = ElasticSummary(
        run_dir=str(run_dir),
        epochs=len(history),
        accuracy=[h["accuracy"] for h in history],
        loss=[h["loss"] for h in history],
        seconds=history[-1]["seconds"] if history else 0.0,
        epoch_seconds=[h["seconds"] for h in history],
        generations=[e for e in events if e["event"] == "generation"],
    )
    write_run_folder(summary, history, model=cfg.model.name, title=f"{cfg.model.name}: test accuracy (elastic)")
    return summary


def join_elastic(address: str, run_dir: str | None = None) -> WorkerOutcome:
    """Join the elastic job whose store is at ``HOST:PORT`` from this process, with that job's configuration."""
    host, _, port_text = address.rpartition(":")
    if not host or not port_text.isdigit():
        raise InputError(f"--join {address!r}: give HOST:PORT, as the job's worker 0 printed it")
    store = connect(host, int(port_text), is_leader=False, timeout_s=30)
    cfg = TrainConfig.from_options(**{**json.loads(store.get("config")), "join": None})
    folder = open_run_folder(run_dir, "join", ())
    return _worker(None, host, int(port_text), cfg, str(folder), 0)
