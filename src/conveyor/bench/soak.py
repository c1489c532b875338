"""``conveyor bench soak``: whether long runs hold steady, on the emulated cluster (needs root).

Two jobs of ``conveyor train`` each run for ``--minutes`` (a lease ends them at an epoch's end), their
workers sampling what they hold every ``--every`` seconds (``--resources-every``):

- **data-parallel**: ``--workers`` emulated devices of ``--cores`` cores, ``--stragglers`` on, and FlexRR's
  slow-worker pattern (a random worker at a third of its cores, a new one every second); each epoch's
  batches are fed as the run goes and its length announced through the store;
- **elastic**: ``--reliable 1`` over ``--workers`` slots, a transient worker revoked without notice or one
  added every ``--change-every`` seconds (a seeded pattern: :func:`membership_changes`), beside ``--busy``
  processes that each want a whole core.

Judged per worker process that lives through the run (an elastic job's re-added workers are new processes,
plotted, not judged): each series (resident memory, open descriptors, threads, the store's keys) must grow
less than ``GOALS["growth"]`` from the first samples after ``--warmup`` minutes to the last, each end taken
as its window's peak bar one sample (:func:`ends`, :func:`growth`), so a series that swings without a trend
passes and a leak does not; each window's floor is reported beside: a peak that grew over a
floor that did not is a spike that came back more often, not something kept.
And the elastic job must lose no committed step (:func:`conveyor.bench.elastic.committed_steps_lost`) and
declare no live worker lost (:func:`false_losses`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.bench._checks import require_known
from conveyor.bench.elastic import committed_steps_lost
from conveyor.config import MODES, TrainConfig
from conveyor.elastic import JobFailed
from conveyor.emulate import Emulation
from conveyor.emulate.parts import BUSY_LOOP
from conveyor.errors import InputError
from conveyor.job import read_jsonl, train, train_elastic, write_lease
from conveyor.processes import set_parent_death_signal
from conveyor.runtime import WorkerError

__all__ = [
    "GOALS",
    "JOBS",
    "SERIES",
    "SoakConfig",
    "ends",
    "false_losses",
    "growth",
    "judge",
    "membership_changes",
    "run",
]

JOBS = ("data-parallel", "elastic")
SERIES = ("rss_bytes", "fds", "threads", "store_keys")
GOALS = {"growth": 0.05, "committed_steps_lost": 0, "false_losses": 0}
_EPOCHS = 10**7  # more than any soak runs: the lease ends it


@dataclass(frozen=True)
class SoakConfig:
    """What ``conveyor bench soak`` runs; each field is an option of the same name."""

    minutes: float = 20.0  # each job's
    jobs: tuple[str, ...] = JOBS
    workers: int = 3
    every: float = 10.0  # seconds between a worker's samples
    warmup: float = 2.0  # minutes not judged: allocators, caches and the first generations settle
    cores: float = 0.45  # data-parallel: each worker's device
    stragglers: str = "flexrr"  # data-parallel: the mode
    change_every: float = 15.0  # elastic: seconds between revocations and additions
    busy: int = 2  # elastic: processes beside it that each want a core
    seed: int = 0

    def __post_init__(self) -> None:
        require_known("jobs", self.jobs, JOBS)
        if not self.minutes > self.warmup >= 0:
            raise InputError(f"--minutes {self.minutes:g} must exceed --warmup {self.warmup:g}: nothing else is judged")
        if self.workers < 2 or self.busy < 0 or not (self.every > 0 and self.change_every > 0 and self.cores > 0):
            raise InputError("--workers is at least 2, --busy at least 0, --every, --change-every and --cores above 0")
        if self.stragglers not in MODES or self.stragglers == "off":
            raise InputError(f"--stragglers {self.stragglers!r}: one of {', '.join(m for m in MODES if m != 'off')}")


def membership_changes(workers: int, minutes: float, every: float, seed: int) -> str:
    """A ``--faults`` spec: every ``every`` seconds one transient worker (1 .. ``workers``-1) revoked without
    notice or one added back, each drawn alike from the changes possible then.

    Example:
        >>> membership_changes(3, 1.0, 15.0, seed=0)
        'revoke:worker=2,at=15;add:worker=2,at=30;revoke:worker=2,at=45'
    """
    rng = np.random.default_rng(seed)
    present, items = set(range(1, workers)), []
    for i in range(1, int(minutes * 60 / every - 1e-9) + 1):
        choices = [("revoke", w) for w in sorted(present)] + [("add", w) for w in range(1, workers) if w not in present]
        kind, w = choices[int(rng.integers(len(choices)))]
        present ^= {w}
        items.append(f"{kind}:worker={w},at={i * every:g}")
    return ";".join(items)


def false_losses(folder: Path) -> int:
    """Live workers an elastic run declared lost: each such worker learns it at its next membership change and
    says so in ``elastic.jsonl`` (``"declared lost"``) before it exits; a revoked one is dead and cannot.

    The losses a run decides name workers, not the machines the fault plan revokes (a re-added machine's
    worker is a new one), so the live worker's own word is what tells a false loss from a true one.
    """
    return sum(e["event"] == "declared lost" for e in read_jsonl(folder / "elastic.jsonl"))


def ends(
    points: list[tuple[float, float]], *, warm_s: float, end_s: float
) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """A series' peaks and floors over its first window after the warm-up and over its last, each window the
    shorter of 2 minutes and half the judged time (``None``: fewer than 2 samples in either window).

    Each peak is the window's second-highest sample: a state that recurs (all members present) counts, one
    sample's spike (descriptors opened for a moment) does not. Each floor is the second-lowest: what the
    process holds at its least, which a leak raises and a recurring spike (a file open while a checkpoint is
    written) does not.

    Example:
        >>> ends([(t, 100 + (t > 400) + 5 * (t % 60 == 0)) for t in range(0, 600, 10)], warm_s=120, end_s=590)
        ((105, 106), (100, 101))
    """
    span = min(120.0, (end_s - warm_s) / 2)
    first = sorted(v for t, v in points if warm_s <= t < warm_s + span)
    last = sorted(v for t, v in points if t >= end_s - span)
    return ((first[-2], last[-2]), (first[1], last[1])) if len(first) > 1 and len(last) > 1 else None


def growth(first: float, last: float) -> float | None:
    """How much a series grew from its first peak to its last (``None``: from 0).

    Example:
        >>> growth(100, 101)
        0.01
    """
    return round(last / first - 1, 4) if first > 0 else None


def _train_config(cfg: SoakConfig, job: str, folder: Path) -> TrainConfig:
    """``job``'s ``conveyor train`` options: its run folder ``folder/run``, its lease ``folder/lease.json``."""
    common = {
        "workers": cfg.workers,
        "epochs": _EPOCHS,
        "seed": cfg.seed,
        "run_dir": str(folder / "run"),
        "lease": str(folder / "lease.json"),
        "resources_every": cfg.every,
    }
    if job == "elastic":
        faults = membership_changes(cfg.workers, cfg.minutes, cfg.change_every, cfg.seed)
        return TrainConfig.from_options(reliable=1, faults=faults, **common)
    slow = f"rotating-slow:factor=0.333,period=1,seed={cfg.seed},cores={cfg.cores:g},until={cfg.minutes * 60:g}"
    return TrainConfig.from_options(
        devices=f"{cfg.cores:g}",
        network=f"{cfg.workers}:1.25e9",
        faults=slow,
        stragglers=cfg.stragglers,
        stages=1,
        replicas=str(cfg.workers),
        schedule="flush",
        **common,
    )


def _soak(cfg: SoakConfig, job: str, train_cfg: TrainConfig, folder: Path) -> None:
    """Run ``job`` for ``cfg.minutes``; a failure is written to ``folder/error.txt`` (and the soak goes on)."""
    loads = range(cfg.busy if job == "elastic" else 0)  # each dies with this process, however it ends
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=set_parent_death_signal) for _ in loads]
    write_lease(folder / "lease.json", time.time() + cfg.minutes * 60)
    try:
        train_elastic(train_cfg) if job == "elastic" else train(train_cfg)
    except (WorkerError, JobFailed) as exc:
        (folder / "error.txt").write_text(str(exc).splitlines()[0])
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def _outcome(job: str, folder: Path) -> dict[str, Any]:
    """A soaked job's outcome, from its folder: its run's summary, or why it has none."""
    error = (folder / "error.txt").read_text() if (folder / "error.txt").exists() else None
    summary_path = folder / "run" / "summary.json"
    if error is not None or not summary_path.exists():
        return {"job": job, "seconds": None, "epochs": None, "final_accuracy": None, "error": error or "no summary"}
    summary = json.loads(summary_path.read_text())
    outcome = {
        "job": job,
        "seconds": summary["seconds"],
        "epochs": summary["epochs"],
        "final_accuracy": summary["accuracy"][-1],
        "error": None,
    }
    if job == "elastic":
        outcome |= {
            "committed_steps_lost": committed_steps_lost(folder / "run"),
            "false_losses": false_losses(folder / "run"),
        }
    return outcome


def _series(job: str, folder: Path) -> list[dict[str, Any]]:
    """The samples of a job's workers, timed from its first (the JSON report's ``series``)."""
    samples = read_jsonl(folder / "resources.jsonl")  # (judge() has refused a folder without one)
    start = min((s["wall"] for s in samples), default=0.0)
    keys = ("worker", "pid", *SERIES)
    return [{"job": job, "t_s": round(s["wall"] - start, 1), **{k: s[k] for k in keys}} for s in samples]


def _growths(cfg: SoakConfig, series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each series' growth, per process that lives through its job's judged time."""
    out = []
    for job in cfg.jobs:
        mine = [s for s in series if s["job"] == job]
        end_s, warm_s = max((s["t_s"] for s in mine), default=0.0), cfg.warmup * 60
        for worker, pid in sorted({(s["worker"], s["pid"]) for s in mine}):
            points = [s for s in mine if s["pid"] == pid]
            if points[0]["t_s"] > warm_s:  # started after the warm-up: a re-added worker, plotted, not judged
                continue
            for name in SERIES:
                both = ends([(s["t_s"], s[name]) for s in points if s[name] is not None], warm_s=warm_s, end_s=end_s)
                g = None if both is None else growth(*both[0])
                if both is not None and g is not None:
                    (first, last), (floor_first, floor_last) = both
                    out.append(
                        {"job": job, "worker": worker, "pid": pid, "series": name, "first": first, "last": last}
                        | {"growth": g, "floor_first": floor_first, "floor_last": floor_last}
                    )
    return out


def run(cfg: SoakConfig, plot_path: str | None = None, keep: str | None = None) -> dict[str, Any]:
    """Run each job of ``cfg`` in turn; return the JSON-ready report (and write the plot)."""
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-soak-") as tmp:
        root = Path(keep or tmp)
        configs = {job: _train_config(cfg, job, root / job) for job in cfg.jobs}
        for job, train_cfg in configs.items():
            Emulation.of(train_cfg.emulation).check(cfg.workers)  # no privileges, no namespaces: fail before any run
            (root / job).mkdir(parents=True, exist_ok=True)
            (root / job / "error.txt").unlink(missing_ok=True)
        for job in cfg.jobs:
            _soak(cfg, job, configs[job], root / job)
        return judge(cfg, root, plot_path)


def judge(cfg: SoakConfig, root: Path, plot_path: str | None = None) -> dict[str, Any]:
    """The report on the soak whose jobs' folders are in ``root`` (``conveyor bench soak --judge``: again, say
    with another ``--warmup``, from the folders ``--keep`` kept)."""
    for job in cfg.jobs:
        if not (root / job / "run" / "resources.jsonl").exists():
            raise InputError(f"{root / job / 'run'} holds no resources.jsonl: give the --keep folder of a soak")
    runs = [_outcome(job, root / job) for job in cfg.jobs]
    series = [s for job in cfg.jobs for s in _series(job, root / job / "run")]
    growths = _growths(cfg, series)
    elastic = next((r for r in runs if r["job"] == "elastic"), {})
    report = {
        "config": asdict(cfg),
        "runs": runs,
        "series": series,
        "growth": growths,
        "committed_steps_lost": elastic.get("committed_steps_lost"),
        "false_losses": elastic.get("false_losses"),
    }
    met = all(g["growth"] < GOALS["growth"] for g in growths) and all(r["error"] is None for r in runs)
    met = met and all(report[k] in (None, 0) for k in ("committed_steps_lost", "false_losses"))
    report["goals"] = {"targets": GOALS, "met": met}
    if plot_path:
        plot(report, plot_path)
    return report


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Each series over time, a line per worker process (thin grey: processes that did not live through)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    judged = {(g["job"], g["pid"]) for g in report["growth"]}
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    scale = {"rss_bytes": ("resident memory (MB)", 1e-6), "fds": ("open descriptors", 1), "threads": ("threads", 1)}
    scale["store_keys"] = ("store keys", 1)
    maps = {"data-parallel": plt.get_cmap("Blues"), "elastic": plt.get_cmap("Oranges")}  # a shade per worker
    for ax, name in zip(axes.flat, SERIES, strict=True):
        label, factor = scale[name]
        for job, worker, pid in sorted({(s["job"], s["worker"], s["pid"]) for s in report["series"]}):
            points = [
                (s["t_s"] / 60, s[name] * factor) for s in report["series"] if s["pid"] == pid and s[name] is not None
            ]
            if not points:
                continue
            kept = (job, pid) in judged
            shade = maps[job](0.9 - 0.25 * (worker % 3))
            style = {"color": shade, "lw": 1.5} if kept else {"color": "0.75", "lw": 0.6}
            ax.plot(*zip(*points, strict=True), **style, label=f"{job} worker {worker}" if kept else None)
        ax.axvline(report["config"]["warmup"], color="0.4", ls="--", lw=0.8)
        ax.set_ylabel(label)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)
