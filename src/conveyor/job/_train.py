"""The main job: profile, plan, train and report, on bundled data or the user's model.

``conveyor train`` runs :func:`train`: the first worker profiles the model and plans it for the
job's worker count (unless a layout or a plan file is given), every worker builds its stage, and the
pipeline trains epoch by epoch (each epoch one run of the schedule), evaluating on held-out data after
each. The run folder gets ``plan.json``, ``metrics.jsonl`` (one line per epoch), ``checkpoint.pt``,
``summary.json`` and ``accuracy.png`` (accuracy against wall-clock time, and against energy when it was measured);
with ``--resources-every``, ``resources.jsonl`` (:mod:`conveyor.job._resources`).
Energy (``--energy-meter``): each worker's meter (:func:`conveyor.energy.open_meter`) measures each epoch's training
and evaluation, and the workers' joules are summed; with no meter the energy is null, never estimated.

A lease (``--lease FILE``, JSON ``{"until": UNIX_SECONDS}``) bounds a run in time, as a cluster scheduler's
rounds do: after each epoch worker 0 re-reads the file, and when another epoch as long as the last would end
past ``until`` the job stops there, saves its checkpoint and exits normally (``stopped_by_lease`` in the
summary); the scheduler extends the lease by rewriting the file, and restarts a stopped job with ``--resume``.
"""

from __future__ import annotations

import copy
import itertools
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

import conveyor.job._data as datasets
from conveyor.config import TrainConfig
from conveyor.emulate import Emulation, launch_emulated
from conveyor.energy import Meter, MeterStatus, describe_meters, open_meter
from conveyor.errors import InputError
from conveyor.gaia import EstimatePilot
from conveyor.job._config import (
    RunState,
    job_devices,
    loss_and_optimizer,
)
from conveyor.job._energy import (
    EpochKnobs,
    KnobsSummary,
    finish_recurrence,
    guarded_power_limits,
    start_recurrence,
)
from conveyor.job._estimate import checkpoint_extras, estimate_from_checkpoint, resolve_estimate
from conveyor.job._layout import Layout
from conveyor.job._lease import read_lease
from conveyor.job._loader import EpochBatches
from conveyor.job._loop import EpochLoop, LoopOutcome, whole_history
from conveyor.job._measured import correct_layout, forget_costs
from conveyor.job._model import model_and_data
from conveyor.job._planning import measure_and_plan
from conveyor.job._report import continued, energy_summary
from conveyor.job._resources import ResourceLog
from conveyor.job._summary import (
    RunPrediction,
    RunSummary,
    check_checkpoint_path,
    discarded_unless_trained,
    open_run_folder,
    steady_rate,
    write_run_folder,
)
from conveyor.job._trainers import chunks_of, trainer
from conveyor.job._warmstart import prepare_warm_start, register_model
from conveyor.runtime import (
    CoreShare,
    Pipeline,
    default_device,
    keep_first,
    load_checkpoint,
    to_device,
)
from conveyor.stragglers import FlexiblePipeline

__all__ = ["train"]


def _worker(cfg: TrainConfig, state: RunState, run_dir: str) -> WorkerResult | None:
    device = default_device()  # the one its launcher gave this worker
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    cores = CoreShare(local_workers) if device.type == "cpu" else None  # threads to match the cores others leave
    model, data = model_and_data(cfg, state.warm_start_plan)  # the same initial weights on every worker
    folder = Path(run_dir)
    loss_fn, make_optimizer = loss_and_optimizer(cfg.optimizer, data.sequence)
    steps = -(-data.samples // cfg.optimizer.batch_size)  # batches per epoch, the last one maybe short
    # Before the trials, which then build what will run.
    cfg, pilot = resolve_estimate(cfg, model, data, loss_fn=loss_fn, make_optimizer=make_optimizer, device=device)
    layout = measure_and_plan(
        cfg,
        model,
        data=data,
        loss_fn=loss_fn,
        make_optimizer=make_optimizer,
        folder=folder,
        steps=steps,
        cores=cores,
        # A trial's pipeline is made of a copy: the model trains from its first weights.
        build=lambda tried: trainer(
            cfg, copy.deepcopy(model), layout=tried, loss_fn=loss_fn, make_optimizer=make_optimizer, device=device
        ),
    )
    if not keep_first(sum(layout.replicas)):  # planned for fewer workers than started: this one is not needed
        return None
    if cores is not None and dist.get_world_size() < local_workers:  # the cores shared among fewer workers
        cores = CoreShare(dist.get_world_size())
    torch.manual_seed(cfg.run.seed + 1 + dist.get_rank())  # then its own random stream (dropout masks) per worker
    pipe = trainer(cfg, model, layout=layout, loss_fn=loss_fn, make_optimizer=make_optimizer, device=device)
    if cfg.run.resume:
        pipe.load(cfg.run.resume)  # every worker reads it before any writes it (the end may save to the same path)
    done = pipe.steps // steps  # epochs the checkpoint has trained: the data order goes on from there
    checkpoint = cfg.run.checkpoint or str(folder / "checkpoint.pt")
    loop, meter, knobs = _epoch_loop(
        cfg,
        state,
        pipe,
        data,
        layout=layout,
        steps=steps,
        done=done,
        folder=folder,
        checkpoint=checkpoint,
        device=device,
        cores=cores,
    )
    # Every worker ready before the first epoch's clock starts: a worker still setting up (local rank 0 opens the
    # host's energy meter, an import of 1.7 s) would count in the others' first epoch, as waiting for it.
    dist.barrier()
    started_at = time.time()
    store, every_s = dist.distributed_c10d._get_default_store(), cfg.run.resources_every
    holdings = ResourceLog(folder / "resources.jsonl", worker=dist.get_rank(), every_s=every_s, store=store)
    with meter, knobs, holdings:
        outcome = loop.run()
    chunks = chunks_of(pipe)
    statuses: list[MeterStatus | None] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, meter.status())  # what every worker's meter read, for the run's note
    energy_meter, energy_note = describe_meters([s for s in statuses if s is not None])
    if outcome.diverged is None:  # a model whose weights went non-finite would replace a good checkpoint
        pipe.save(checkpoint, checkpoint_extras(cfg, whole_history(state.history_before, outcome, pipe.is_output)))
    return WorkerResult(
        outcome=outcome,
        layout=layout,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
        started_at=started_at,
        epochs_before=done,
        energy_meter=energy_meter,
        energy_note=energy_note,
        chunks=chunks,
        knobs=knobs.summary(),
        estimate_pilot=pilot,
    )


def _epoch_loop(
    cfg: TrainConfig,
    state: RunState,
    pipe: Pipeline | FlexiblePipeline,
    data: datasets.Dataset,
    *,
    layout: Layout,
    steps: int,
    done: int,
    folder: Path,
    checkpoint: str,
    device: torch.device,
    cores: CoreShare | None,
) -> tuple[EpochLoop, Meter, EpochKnobs]:
    """This worker's epochs over ``pipe`` from epoch ``done`` on (``steps`` batches each, records in ``folder``), its
    energy meter and its knobs (the power limit, the recurring batch size, the stop above a cost)."""
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))  # the local launcher's workers share one host
    batches = None
    if pipe.is_first or pipe.is_last:  # the data moves to the device here, once
        batches = EpochBatches(
            data.train_x if pipe.is_first else None,
            data.train_y if pipe.is_last else None,
            cfg.optimizer.batch_size,
            cfg.run.seed,
            device=device,
            loader_workers=cfg.run.loader_workers,
        )
    updates = steps  # this worker's updates per epoch
    if isinstance(pipe, Pipeline):
        updates = pipe.kind.updates(steps, layout.microbatches, pipe.replicas[pipe.stage])
    owns_gpu = device.type == "cuda" and local_rank < torch.cuda.device_count()  # GPU shared: the first meters it
    meter = open_meter(
        cfg.energy.meter,
        gpu_index=device.index if owns_gpu else None,
        measure_host=local_rank == 0,
        rank=dist.get_rank(),
    )
    equal_steps = cfg.stragglers is None and len(set(layout.replicas)) == 1  # every worker: as many updates
    gpu_index = device.index if device.type == "cuda" else None
    knobs = EpochKnobs(cfg.energy, gpu_index, equal_steps, updates, stop_above=state.stop_above)
    loop = EpochLoop(
        cfg=cfg,
        trainer=pipe,
        batches=batches,
        test_x=to_device(data.test_x, device) if pipe.worker == 0 else None,
        test_y=data.test_y.to(device) if pipe.is_output else None,
        test_samples=len(data.test_y),
        train_samples=data.samples,
        updates=updates,
        first_epoch=done,
        folder=folder,
        checkpoint=checkpoint,
        device=device,
        meter=meter,
        knobs=knobs,
        cores=cores,
        history_before=state.history_before,
    )
    return loop, meter, knobs


@dataclass(frozen=True, kw_only=True)
class WorkerResult:
    """What each worker of :func:`train` hands back: the epochs' outcome (the records on the output worker
    alone), the layout it ran, and what the run's summary takes from it."""

    outcome: LoopOutcome
    layout: Layout
    peak_rss_bytes: int
    started_at: float  # time.time() when training began
    epochs_before: int  # epochs the --resume checkpoint had trained
    energy_meter: str | None  # what measured the energy (every worker's meters described)
    energy_note: str | None
    chunks: dict[str, Any] | None  # --stragglers: chunks per replica and, with --chunks auto, the times chosen from
    knobs: KnobsSummary
    estimate_pilot: EstimatePilot | None  # --wan-estimate auto: the pilot (workers 0 and 1) that decided it


def _say_stopping() -> None:
    Console(stderr=True).print(
        "\nstopping at the end of this epoch, then saving the checkpoint, summary and plot (Ctrl-C again: stop now, "
        "losing this epoch)",
        highlight=False,
    )


def train(cfg: TrainConfig) -> RunSummary | None:
    """Run ``cfg`` on local workers (or as one worker of a torchrun job); return the run's summary, which its run
    folder's ``summary.json`` holds too (``None`` in a torchrun worker other than the one with the output).

    Raises:
        InputError: an elastic job (run by :func:`~conveyor.job.train_elastic`), or the lease file (``--lease``)
            cannot be read.
    """
    if cfg.elastic is not None:
        raise InputError("an elastic job (--reliable or --join) runs with conveyor.job.train_elastic or join_elastic")
    if cfg.run.lease:
        read_lease(cfg.run.lease)  # fail here, with one line, rather than in worker 0
    device, backend, nprocs = job_devices(cfg)  # so do a device, a backend or a worker count this machine lacks
    if cfg.run.checkpoint:
        check_checkpoint_path(cfg.run.checkpoint)
    run_dir = open_run_folder(
        cfg.run.run_dir,
        cfg.model.name,
        ("metrics.jsonl", "stragglers.jsonl", "resources.jsonl"),
        cfg.to_toml(),
        overwrite=cfg.run.overwrite,
    )
    with discarded_unless_trained(run_dir):
        cfg, recurring, stop_above = start_recurrence(cfg, lambda: model_and_data(cfg)[1].samples, nprocs)
        plan, warm = prepare_warm_start(cfg, run_dir, lambda: model_and_data(cfg)[0])
        # The epochs the checkpoint trained (mapped: its weights are read by the workers, not here).
        saved = load_checkpoint(cfg.run.resume, mapped=True) if cfg.run.resume else {}
        before = tuple(saved.get("history", ()))
        cfg = estimate_from_checkpoint(cfg, saved)  # a resumed run keeps the choice --wan-estimate auto made
        state = RunState(stop_above=stop_above, warm_start_plan=plan, history_before=before)
        try:
            with guarded_power_limits(cfg.energy):
                per_rank = launch_emulated(
                    _worker,
                    cfg,
                    state,
                    str(run_dir),
                    nprocs=nprocs,
                    emulation=Emulation.of(cfg.emulation),
                    log_dir=run_dir,
                    device=device,
                    backend=backend,
                    on_interrupt=_say_stopping,
                )
        except BaseException as exc:
            if recurring is not None:  # an error counts as a missed target; an interruption as nothing
                recurring.fail(interrupted=isinstance(exc, KeyboardInterrupt | SystemExit))
            raise
    results: dict[int, WorkerResult] = {r: result for r, result in per_rank.items() if result is not None}
    out = next((r for r in results.values() if r.outcome.history), None)
    if out is None:  # under torchrun, only the output worker's process has the history
        return None
    history = [asdict(h) for h in out.outcome.history]
    summary = _summary(cfg, run_dir, out, results, history=history, before=before, warm=warm)
    start = summary.prediction.measured_at_start
    if summary.kept_figures_missed():
        forget_costs(start["kept_at"])
    elif (ratio := summary.layout_missed()) is not None:
        correct_layout(start["key"], summary.layout_key(), ratio)
    if summary.interrupted or summary.diverged:  # no outcome to learn from, nor a finished model to keep
        if recurring is not None:
            recurring.fail(interrupted=summary.interrupted)
    else:
        summary = finish_recurrence(recurring, summary, cfg)
        summary = register_model(cfg, summary, lambda: model_and_data(cfg)[0])
    whole = continued(before, history)  # a resumed run's plot shows the epochs before too
    write_run_folder(summary, whole, model=cfg.model.name, title=f"{cfg.model.name}: test accuracy")
    return summary


def _summary(
    cfg: TrainConfig,
    run_dir: Path,
    out: WorkerResult,
    results: dict[int, WorkerResult],
    *,
    history: list[dict[str, Any]],
    before: tuple[Any, ...],
    warm: dict[str, Any] | None,
) -> RunSummary:
    """The run's summary from the output worker's result ``out`` (its epochs' ``history``) and every worker's."""
    predicted = out.layout.predicted_samples_per_s
    last = history[-1]
    trained = [0.0] + [h["train_seconds"] for h in history]  # cumulative, per epoch
    steady = steady_rate([b - a for a, b in itertools.pairwise(trained)], history[0]["samples"])
    return RunSummary(
        run_dir=str(run_dir),
        epochs=len(history),
        accuracy=[h["accuracy"] for h in history],
        loss=[h["loss"] for h in history],
        seconds=last["seconds"],
        epoch_seconds=[h["seconds"] for h in history],
        epochs_before=out.epochs_before,
        stopped_by_lease=out.outcome.stopped_by_lease,
        stopped_by_cost=out.outcome.stopped_by_cost,
        interrupted=out.outcome.interrupted,
        train_seconds=last["train_seconds"],
        samples_per_s=last["samples_per_s"],
        steady_samples_per_s=steady,
        bytes_between_servers=last["bytes_between_servers"],
        samples=last["samples"],
        started_at=out.started_at,
        peak_rss_bytes=[results[r].peak_rss_bytes for r in sorted(results)],
        layout=asdict(out.layout),
        checkpoint=cfg.run.checkpoint or str(run_dir / "checkpoint.pt"),
        prediction=RunPrediction(
            samples_per_s=predicted,
            error=steady / predicted - 1,  # measured against predicted
            measured_at_start=out.layout.plan_file["measured_at_start"],
        ),
        warm_start=warm,
        chunks=out.chunks,
        wan_estimate=asdict(out.estimate_pilot) if out.estimate_pilot is not None else None,
        diverged=out.outcome.diverged,
        history_before=list(before),
        **asdict(out.knobs),
        **energy_summary(history, out.energy_meter, out.energy_note, cfg.run.target_accuracy),
    )
