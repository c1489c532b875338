"""``conveyor bench stragglers``: FlexRR's modes under injected stragglers, against the ideal.

Each case is a model and a layout on the emulated cluster with equal device quotas: data parallelism
(``resnet:4``) or a pipeline whose first stage is replicated (``vgg:2-1``, where the stragglers are among
the first stage's replicas, the workers whose work can move). Each straggler pattern has a fixed seed
(:mod:`conveyor.emulate._faults`), and each mode of ``conveyor train --stragglers`` runs it:

- ``slow-worker``: every period a random replica (never the previous one) runs at a third of its cores;
- ``disrupted-machine``: every period a server's workers share their cores with a competing load (a random
  server; a pipeline's first, which holds its replicas);
- ``power-law``: every period every replica pauses (cgroup freezer) for a Pareto-distributed time;
- ``none``: no jitter.

Beside the modes of ``conveyor train --stragglers``, ``ddp`` runs PyTorch's own ``DistributedDataParallel``
on the same emulated devices, network and faults (data-parallel cases only): the peer a user would pick.
Every pattern touches the worker processes (there are no others): a slowed worker's cgroup has a third of its
cores, a disrupted machine's workers share theirs with a busy process, a paused worker's cgroup is frozen.

Per run: the wall-clock seconds of a fixed number of epochs (evaluation included), the final accuracy, the
samples replicas took from peers, and the ratio to the **ideal**: the case's fastest no-jitter time scaled by
the capacity the pattern left, ``ideal = T_none x C / mean C(t)``, where ``C(t)`` sums the workers' cores at
time ``t`` (a slowed worker counts its reduced cores, a loaded one half, a paused one none), averaged over the
run from the run's own fault log, so a slowdown that removes capacity is not counted against a mode. Each
(case, pattern, mode) runs ``repeats`` times, the repeats in turn (a slow spell of the machine falls on
several modes, not on every run of one), and its row has the median and the spread
(:mod:`conveyor.bench._stragglers_report`).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conveyor.bench._checks import require_known
from conveyor.bench._run import run_job
from conveyor.bench._stragglers_report import aggregate, goals, plot
from conveyor.bench.ddp import train_ddp
from conveyor.config import DEFAULT_MODE, MODES, Chunks, TrainConfig, check_chunks
from conveyor.errors import InputError
from conveyor.job import read_jsonl
from conveyor.plan import Topology
from conveyor.runtime import WorkerError
from conveyor.schedule import parse_replicas
from conveyor.stragglers import flexible_layout

__all__ = ["BENCH_MODES", "PATTERNS", "Case", "StragglersConfig", "mean_capacity", "run"]

PATTERNS = {
    "slow-worker": "rotating-slow:factor=0.333,period={period},seed={seed},cores={cores},among={among}",
    "disrupted-machine": "disrupted:for={period},period={period},seed={seed},among={among}",
    "power-law": "power-law:alpha=1.5,scale={pause},period={period},seed={seed},among={among}",
    "none": "",
}
BENCH_MODES = (*MODES, "ddp")  # the trainer's modes, and PyTorch's DistributedDataParallel (data parallelism)


@dataclass(frozen=True)
class Case:
    """A model and a layout whose first stage alone is replicated, and its batch size."""

    model: str
    layout: str  # replicas per stage, "4" or "2-1"
    replicas: tuple[int, ...]
    batch_size: int

    @classmethod
    def parse(cls, text: str, batch_size: int) -> Case:
        """Read ``model:replicas[:batch size]``.

        Example:
            >>> Case.parse("vgg:2-1:64", 256)
            Case(model='vgg', layout='2-1', replicas=(2, 1), batch_size=64)
        """
        model, layout, *rest = [*text.split(":"), ""] if ":" not in text else text.split(":")
        if not model or not layout or len(rest) > 1 or (rest and not rest[0].isdigit()):
            raise InputError(f"case {text!r} is not model:replicas[:batch size], e.g. resnet:4 or vgg:2-1:64")
        replicas = tuple(parse_replicas(layout))
        if not flexible_layout(replicas):
            raise InputError(f"case {text!r}: replicate the first stage alone (e.g. 4 or 2-1): its work moves")
        return cls(model, layout, replicas, int(rest[0]) if rest else batch_size)

    @property
    def workers(self) -> int:
        return sum(self.replicas)


@dataclass(frozen=True)
class StragglersConfig:
    """What ``conveyor bench stragglers`` runs."""

    # model:replicas per stage (one count: data parallelism)[:batch size, default batch_size]
    cases: tuple[str, ...] = ("resnet:4", "vgg:2-1:64")
    repeats: int = 2  # runs of each case, pattern and mode, in turn
    cores: float = 0.45  # each worker's device
    network: str = "2:1.25e9,2:1.25e8"  # 2 servers of 2 workers
    epochs: int = 20
    batch_size: int = 256
    lr: float = 0.05
    chunks: Chunks = 2  # or "auto"
    slack: int = 1  # flexrr's and slack's (at 2 the vgg pipeline diverged)
    stale_correction: bool = True  # slack's weight prediction
    equal_shares: bool = False  # shares not weighted by measured speed
    cpu_slice: float = 0.005  # a slowed device runs 5 ms between stops: slowed within a step, not stopped
    period: float = 1.0  # seconds between the patterns' events
    pause: float = 0.1  # power-law: the shortest pause
    seed: int = 0
    patterns: tuple[str, ...] = tuple(PATTERNS)
    modes: tuple[str, ...] = ("live", "flexrr", "backup", "off", "ddp")  # slack and reassign: --modes
    default_mode: str = field(default=DEFAULT_MODE, init=False)  # conveyor train --stragglers' default

    def __post_init__(self) -> None:
        for case in self.cases:
            Case.parse(case, self.batch_size)
        check_chunks(self.chunks)
        require_known("patterns", self.patterns, PATTERNS)
        require_known("modes", self.modes, BENCH_MODES)
        if self.repeats < 1:
            raise InputError(f"--repeats must be at least 1, got {self.repeats}")
        if "none" not in self.patterns:
            raise InputError("the patterns must include none: the ideal is scaled from the no-jitter time")


def mean_capacity(events: list[dict[str, Any]], cores: float, workers: int, start: float, end: float) -> float:
    """The workers' summed cores averaged over ``[start, end]`` (wall-clock), from a ``faults.jsonl`` log.

    Faults that overlap on one worker each count their loss (the built-in patterns never overlap).

    Example:
        >>> slow = {"kind": "slow", "workers": [1], "at": 1.0, "cores": 0.25}
        >>> events = [{"event": "begin", "wall": 10.0, **slow}, {"event": "end", "wall": 12.0, **slow}]
        >>> mean_capacity(events, 1.0, 2, 10.0, 14.0)  # worker 1 at a quarter for half the time
        1.625
    """
    factors: dict[tuple[Any, ...], tuple[float, float, list[int], float]] = {}  # fault -> (from, to, workers, x)
    for e in events:
        if e.get("kind") not in ("slow", "load", "pause") or e["event"] not in ("begin", "end"):
            continue
        key = (e["kind"], tuple(e["workers"]), e["at"])
        if e["event"] == "begin":
            x = e["cores"] / cores if e["kind"] == "slow" else 0.5 if e["kind"] == "load" else 0.0
            factors[key] = (e["wall"], end, e["workers"], x)
        elif key in factors:
            began, _, ranks, x = factors[key]
            factors[key] = (began, e["wall"], ranks, x)
    lost = 0.0
    for began, ended, ranks, x in factors.values():
        overlap = max(0.0, min(ended, end) - max(began, start))
        lost += overlap * len(ranks) * cores * (1 - x)
    return workers * cores - lost / (end - start)


def _train_config(cfg: StragglersConfig, case: Case, pattern: str, mode: str, run_dir: Path) -> TrainConfig:
    faults = PATTERNS[pattern].format(
        period=cfg.period, seed=cfg.seed, cores=cfg.cores, pause=cfg.pause, among=case.replicas[0]
    )
    return TrainConfig.from_options(
        model=case.model,
        workers=case.workers,
        stages=len(case.replicas),
        replicas=case.layout,
        schedule="flush",
        epochs=cfg.epochs,
        batch_size=case.batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
        network=_network(cfg, case.workers),
        devices=f"{cfg.cores:g}",
        cpu_slice=cfg.cpu_slice,
        faults=faults or None,
        stragglers=mode,
        slack=cfg.slack,
        stale_correction=cfg.stale_correction,
        equal_shares=cfg.equal_shares,
        chunks=cfg.chunks,
        run_dir=str(run_dir),
    )


def _network(cfg: StragglersConfig, workers: int) -> str:
    """``cfg.network`` where it has ``workers`` workers; else each worker its own server, joined by its
    outermost link (so a disrupted machine holds one replica).

    Example:
        >>> _network(StragglersConfig(), 3)
        '1:1.25e9,3:1.25e8'
    """
    topology = Topology.parse(cfg.network)
    if topology.workers == workers:
        return cfg.network
    inner, outer = cfg.network.split(",")[0], cfg.network.split(",")[-1]
    return f"1:{inner.partition(':')[2]},{workers}:{outer.partition(':')[2]}"


def _run_one(cfg: StragglersConfig, case: Case, pattern: str, mode: str, run_dir: Path) -> dict[str, Any]:
    if mode == "ddp":
        summary = train_ddp(_train_config(cfg, case, pattern, "off", run_dir), case.workers, run_dir)
        start, seconds, accuracy = summary["started_at"], summary["seconds"], summary["accuracy"][-1]
        chunks, steps = None, []
    else:
        job = run_job(_train_config(cfg, case, pattern, mode, run_dir))
        start, seconds, accuracy = job.started_at, job.seconds, job.accuracy[-1]
        chunks, steps = job.chunks["per_replica"] if job.chunks else None, read_jsonl(run_dir / "stragglers.jsonl")
    events = read_jsonl(run_dir / "faults.jsonl")
    replicas = [s for s in steps if s["stage"] == 0]
    return {
        "model": case.model,
        "layout": case.layout,
        "batch_size": case.batch_size,
        "pattern": pattern,
        "mode": mode,
        "seconds": seconds,
        "final_accuracy": accuracy,
        "chunks": chunks,
        "samples_moved": sum(s["taken"] for s in replicas),
        "samples_backed_up": sum(s["backups"] for s in replicas),
        "samples_dropped": sum(s["dropped"] for s in replicas),
        "wait_s": sum(s["wait_s"] for s in replicas) / case.replicas[0] if steps else None,  # per replica
        "mean_capacity_cores": mean_capacity(events, cfg.cores, case.workers, start, start + seconds),
        "workers": case.workers,
    }


def run(cfg: StragglersConfig, plot_path: str | None = None, keep: str | None = None) -> dict[str, Any]:
    """Run every case with every pattern and mode, ``cfg.repeats`` times in turn; return the JSON-ready report
    (and write the plot).

    A run whose worker fails is listed under ``failed`` with its one-line error; the others still run. A case
    whose no-jitter runs all failed has no ideal, and its rows are left out. ``ddp`` runs on data-parallel
    cases only.

    ``keep``: a folder to keep every run's folder in (default: a temporary one, removed).
    """
    runs: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="conveyor-stragglers-") as tmp:
        root = Path(keep or tmp)
        for repeat in range(1, cfg.repeats + 1):
            for text in cfg.cases:
                case = Case.parse(text, cfg.batch_size)
                for pattern in cfg.patterns:
                    for mode in (m for m in cfg.modes if m != "ddp" or len(case.replicas) == 1):
                        folder = root / f"{case.model}-{case.layout}-{pattern}-{mode}-{repeat}"
                        try:
                            runs.append(_run_one(cfg, case, pattern, mode, folder))
                        except WorkerError as exc:  # one failed run is reported, and the others still run
                            where = {"model": case.model, "layout": case.layout, "pattern": pattern, "mode": mode}
                            failed.append({**where, "repeat": repeat, "error": str(exc).splitlines()[0]})
    rows = aggregate(runs, cfg.cores)
    if plot_path:
        plot(rows, plot_path, cfg.cores)
    return {"config": asdict(cfg), "results": rows, "failed": failed, "goals": goals(rows)}
