"""A run's summary as typed records (what ``conveyor.train`` returns and ``summary.json`` holds), and the run
folder every kind of run makes and writes the same way."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conveyor.errors import InputError
from conveyor.gaia import EstimatePilot
from conveyor.job._report import plot_accuracy
from conveyor.processes import under_torchrun

__all__ = [
    "Divergence",
    "ElasticSummary",
    "RunPrediction",
    "RunSummary",
    "Summary",
    "check_checkpoint_path",
    "discarded_unless_trained",
    "open_run_folder",
    "steady_rate",
    "write_run_folder",
]


@dataclass(frozen=True, kw_only=True)
class RunPrediction:
    """The training throughput a run predicted from what it measured at start-up, and how far off it was."""

    samples_per_s: float  # predicted training samples per second, once warm
    error: float  # the measured steady rate (RunSummary.steady_samples_per_s) / predicted - 1
    measured_at_start: dict[str, Any]  # the start-up measurements the prediction rests on (plan file's)


RATIO_STEP = 2.0  # a run moves a layout's measured-over-simulated ratio by at most this factor
TRUSTED_ERROR = 0.15  # kept start-up figures are planned from while runs land within this (or their spread)


def steady_rate(epoch_seconds: Sequence[float], samples: int) -> float:
    """Samples per second over the epochs after the first (each of ``samples`` samples, trained in its
    ``epoch_seconds``), or the one epoch's where there is no other. The first warms up (the allocator, the kernels'
    first calls, the optimizer's state): a prediction is of the steady rate, as nothing it rests on counts warm-up."""
    warm = epoch_seconds[1:] or epoch_seconds
    return samples * len(warm) / sum(warm)


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """Where the training loss stopped being finite: the epoch and its step (both from 1), and the last finite
    loss of a step before it (``None``: there was none)."""

    epoch: int
    step: int
    last_finite_loss: float | None

    def __str__(self) -> str:
        before = "" if self.last_finite_loss is None else f" (the step before: {self.last_finite_loss:.4g})"
        return f"the training loss stopped being finite at epoch {self.epoch}, step {self.step}{before}"


@dataclass(frozen=True, kw_only=True)
class Summary:
    """What every run reports: per epoch its test ``accuracy``, training ``loss`` and ``epoch_seconds`` (the wall
    clock at the end of each epoch's evaluation); ``epochs`` run, ``seconds`` in all, and its ``run_dir``."""

    run_dir: str
    epochs: int
    accuracy: list[float]
    loss: list[float]
    seconds: float
    epoch_seconds: list[float]

    def to_dict(self) -> dict[str, Any]:
        """The summary as ``summary.json`` has it (JSON-ready)."""
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


@dataclass(frozen=True, kw_only=True)
class RunSummary(Summary):
    """A run of fixed workers (``conveyor train``). ``epochs`` counts this run's epochs (with ``--resume``,
    ``epochs_before`` those the checkpoint had trained). Energy figures are ``None`` where no meter read; the
    recurrence, power-limit, warm-start and model-store fields where their options were not given."""

    epochs_before: int
    stopped_by_lease: bool  # the lease ended the run before its epochs
    interrupted: bool  # a Ctrl-C or SIGTERM did (the workers finished their epoch and saved)
    train_seconds: float
    samples_per_s: float  # training samples per second of training
    steady_samples_per_s: float  # the same over the epochs after the first (steady_rate): what was predicted
    bytes_between_servers: int | None  # while training, on an emulated network
    samples: int
    started_at: float  # time.time() when training began (fault logs' "wall" is on this clock)
    peak_rss_bytes: list[int]  # per worker
    layout: dict[str, Any]  # the layout run, with its plan file
    checkpoint: str  # where the model was saved
    prediction: RunPrediction
    energy_j: float | None  # all workers, all epochs
    epoch_energy_j: list[float | None]
    energy_meter: str | None  # what measured it
    energy_note: str | None  # why nothing or not every worker did
    time_to_accuracy_s: float | None = None  # once --target-accuracy is reached
    energy_to_accuracy_j: float | None = None
    stopped_by_cost: bool = False  # --batch-size auto: the recurrence passed beta x the least cost
    cost: float | None = None  # --batch-size auto: the recurrence's cost
    recurrence: dict[str, Any] | None = None  # --batch-size auto: the job, its number, phase, batch and outcome
    power_limit_w: float | None = None  # --power-limit: the limit chosen
    power_profile: list[dict[str, Any]] | None = None  # --power-limit auto: each limit's measured cost
    power_limit_note: str | None = None  # --power-limit auto: why no limit was chosen
    warm_start: dict[str, Any] | None = None  # --warm-start: the parent, its match, coverage and seconds
    registered: str | None = None  # --register: the model store's id of the final model
    chunks: dict[str, Any] | None = None  # --stragglers: per_replica, and step_s per count where --chunks auto chose
    wan_estimate: dict[str, Any] | None = None  # --wan-estimate auto: the pilot that chose (gaia.EstimatePilot)
    diverged: Divergence | None = None  # the loss stopped being finite: the run stopped, its checkpoint unwritten
    history_before: list[dict[str, Any]] = field(default_factory=list)  # --resume: the checkpoint's epochs

    def notes(self) -> list[str]:
        """What a user should know after the run: how the prediction fared, and whether one worker would have
        been faster."""
        measured, predicted = self.steady_samples_per_s, self.prediction.samples_per_s
        single = self.prediction.measured_at_start["single_worker_samples_per_s"]
        workers = sum(self.layout["replicas"])  # that ran (the planner may have used fewer than started)
        notes = [
            f"predicted {predicted:.0f} training samples/s, measured {measured:.0f}"
            f"{' after the first epoch' if self.epochs > 1 else ''} ({self.prediction.error:+.0%})"
        ]
        if self.kept_figures_missed():
            notes.append(
                f"the start-up figures this run planned from were {self.prediction.measured_at_start['source']}; it "
                f"missed them by more than {self.trust_bound():.0%}, so they are removed and the next run measures "
                "afresh (a machine faster or slower than when they were measured)"
            )
        if (ratio := self.layout_missed()) is not None:
            notes.append(
                f"it missed the prediction by more than {self.trust_bound():.0%}: the next plan from the same "
                f"start-up figures predicts this layout at {ratio:.2f} times its simulated rate, as measured here"
            )
        if single is not None and workers > 1 and min(measured, predicted) < single:
            slower = (
                "measured and predicted"
                if max(measured, predicted) < single
                else ("measured" if measured < single else "predicted")
            )
            notes.append(
                f"one worker alone does {single:.0f} samples/s (a plain PyTorch loop measured at start-up): this run "
                f"on {workers} workers is {slower} slower; the model is too small for its transfers and per-step "
                "costs to pay off here (--workers 1, or a larger model or batch)"
            )
        if self.wan_estimate is not None:
            notes.append(EstimatePilot(**self.wan_estimate).describe())
        return notes

    def trust_bound(self) -> float:
        """How far a run may land from the prediction before the kept figures behind it are measured again: the
        larger of :data:`TRUSTED_ERROR` and the start-up loop's spread (a run within its own noise confirms
        them)."""
        return max(TRUSTED_ERROR, float(self.prediction.measured_at_start.get("spread", 0.0)))

    def _missed(self) -> bool:
        """Whether the steady rate (after a first epoch) landed further from the prediction than
        :meth:`trust_bound`."""
        return self.epochs > 1 and abs(self.prediction.error) > self.trust_bound()

    def kept_figures_missed(self) -> bool:
        """Whether this run, of one worker, planned from kept figures and :meth:`_missed` their prediction: what
        they hold of one worker (the plain loop, the batch alone) is off, so the next run measures afresh."""
        kept = self.prediction.measured_at_start.get("kept_at") is not None
        return kept and sum(self.layout["replicas"]) == 1 and self._missed()

    def layout_key(self) -> str:
        """The layout run, as the planner looked it up (:func:`~conveyor.plan.layout_key`; a schedule planned as
        another, ``pipedream-vs``, under that one's name): what its plan file says."""
        return str(self.layout["plan_file"]["predicted"]["layout_key"])

    def layout_missed(self) -> float | None:
        """Where this run, of more than one worker, :meth:`_missed` its prediction from kept figures (its start-up
        ones are kept too), the rate it measured over its layout's simulated one (the prediction's ratio to it
        included): what the figures' next plan predicts the layout at. ``None`` elsewhere."""
        if sum(self.layout["replicas"]) == 1 or self.prediction.measured_at_start.get("key") is None:
            return None
        if not self._missed():
            return None
        before = float(self.layout["plan_file"]["predicted"]["measured_over_simulated"])
        # At most halved or doubled by one run: a run on a machine busy for a while should not bury a layout that
        # then never runs again to say otherwise.
        return before * min(RATIO_STEP, max(1 / RATIO_STEP, 1 + self.prediction.error))


@dataclass(frozen=True, kw_only=True)
class ElasticSummary(Summary):
    """An elastic job (``conveyor train --reliable``): its generations, each a membership the job ran with (why
    it began, the workers, the layout, the step it resumed at, the steps redone and the seconds recovery took)."""

    generations: list[dict[str, Any]]


def open_run_folder(
    run_dir: str | None, model: str, logs: Sequence[str], config: str | None = None, *, overwrite: bool = False
) -> Path:
    """The run folder: ``run_dir``, else a new ``runs/MODEL-TIME`` (``-2``, ``-3``, ... after it for runs started
    in the same second); its ``logs`` are started afresh; ``config``, the run's whole configuration as TOML, goes
    to ``config.toml`` before anything runs (``conveyor train --config`` reruns it). Under torchrun every worker
    names the same folder; worker 0 checks it and writes the config, each machine's first worker starts its logs.

    Raises:
        InputError: ``run_dir`` holds a run (its summary, metrics, config or checkpoint) and not ``overwrite``.
    """
    if under_torchrun():  # every worker names the folder alike (no suffix); worker 0 checks it and writes the config
        folder = Path(run_dir or _timestamped(model))
        if os.environ["RANK"] != "0":  # on a shared file system worker 0's config.toml may be there already
            folder.mkdir(parents=True, exist_ok=True)
            if os.environ.get("LOCAL_RANK", "0") == "0":  # another machine's disk: its logs start afresh too
                for log in logs:
                    (folder / log).unlink(missing_ok=True)
            return folder
    else:
        folder = Path(run_dir) if run_dir else _new_folder(model)
    held = [name for name in _RUN_FILES if (folder / name).exists()]
    if held and not overwrite:
        raise InputError(
            f"--run-dir {folder} holds a run ({', '.join(held)}): give a new folder, or --overwrite to replace it"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for log in logs:
        (folder / log).unlink(missing_ok=True)
    if config is not None:
        (folder / "config.toml").write_text(config)
    return folder


_RUN_FILES = ("summary.json", "metrics.jsonl", "elastic.jsonl", "config.toml", "checkpoint.pt")


def _timestamped(model: str) -> str:
    return f"runs/{model.replace(':', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"


def _new_folder(model: str) -> Path:
    """A folder no other run has: made here, so that of runs started together each gets its own."""
    base, n = _timestamped(model), 1
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    while True:
        folder = Path(base if n == 1 else f"{base}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            n += 1


def check_checkpoint_path(path: str) -> None:
    """Make ``--checkpoint``'s folder and write a file there, before anything runs: a path that cannot be
    written fails now, not after the training it would lose.

    Raises:
        InputError: the path is a folder, or its folder cannot be made or written in (one line).
    """
    file = Path(path)
    if file.is_dir():
        raise InputError(f"--checkpoint {path} is a folder: give a file's path, e.g. {file / 'checkpoint.pt'}")
    blocking = next((p for p in file.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise InputError(f"--checkpoint {path}: {blocking} is a file, not a folder")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=file.parent):
            pass
    except OSError as exc:
        raise InputError(f"--checkpoint {path}: cannot write in {file.parent} ({exc.strerror or exc})") from None


@contextlib.contextmanager
def discarded_unless_trained(folder: Path) -> Iterator[None]:
    """Within it, a failure or a stop removes the run folder where no epoch ended in it: where it holds only what
    the run wrote on starting, its config and empty logs."""
    try:
        yield
    except BaseException:
        files = list(folder.iterdir()) if folder.is_dir() else []
        if all(f.name == "config.toml" or (f.suffix == ".jsonl" and f.stat().st_size == 0) for f in files):
            shutil.rmtree(folder, ignore_errors=True)
        raise


def write_run_folder(summary: Summary, history: Sequence[Mapping[str, Any]], *, model: str, title: str) -> None:
    """``summary.json`` and, where an epoch ended, ``accuracy.png`` (the epochs of ``metrics.jsonl``) in the
    summary's run folder."""
    run_dir = Path(summary.run_dir)
    (run_dir / "summary.json").write_text(summary.to_json())
    if history:
        plot_accuracy({model: history}, run_dir / "accuracy.png", title=title)
