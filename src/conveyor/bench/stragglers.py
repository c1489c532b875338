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

Per run: the wall-clock seconds of a fixed number of epochs (evaluation included), the final accuracy (and
its drop from the case's synchronous no-jitter run), the samples replicas took from peers, and the ratio
to the **ideal**: the case's fastest no-jitter time scaled by the capacity the pattern left,
``ideal = T_none x C / mean C(t)``, where ``C(t)`` sums the workers' cores at time ``t`` (a slowed worker
counts its reduced cores, a loaded one half, a paused one none), averaged over the run from the run's own
fault log, so a slowdown that removes capacity is not counted against a mode.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.bench._checks import require_known
from conveyor.bench._run import run_job
from conveyor.errors import InputError
from conveyor.job import TrainConfig, read_jsonl
from conveyor.plan import Topology
from conveyor.runtime import WorkerError
from conveyor.schedule import parse_replicas
from conveyor.stragglers import MODES, Chunks, check_chunks, flexible_layout

__all__ = ["PATTERNS", "Case", "StragglersConfig", "mean_capacity", "run"]

PATTERNS = {
    "slow-worker": "rotating-slow:factor=0.333,period={period},seed={seed},cores={cores},among={among}",
    "disrupted-machine": "disrupted:for={period},period={period},seed={seed},among={among}",
    "power-law": "power-law:alpha=1.5,scale={pause},period={period},seed={seed},among={among}",
    "none": "",
}
# The time goal of a mode per pattern, its accuracy goal (points below the synchronous no-jitter run), and how
# much the patterns must slow the synchronous mode for the goals to mean anything.
GOALS: dict[str, Any] = {
    "ratio_to_ideal": {"slow-worker": 1.10, "disrupted-machine": 1.10, "power-law": 1.25},
    "accuracy_points": 1.0,
    "off_ratio_to_ideal_at_least": 1.4,
}


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
    modes: tuple[str, ...] = MODES

    def __post_init__(self) -> None:
        for case in self.cases:
            Case.parse(case, self.batch_size)
        check_chunks(self.chunks)
        require_known("patterns", self.patterns, PATTERNS)
        require_known("modes", self.modes, MODES)
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
    summary = run_job(_train_config(cfg, case, pattern, mode, run_dir))
    start = summary.started_at
    end = start + summary.seconds
    events, steps = read_jsonl(run_dir / "faults.jsonl"), read_jsonl(run_dir / "stragglers.jsonl")
    replicas = [s for s in steps if s["stage"] == 0]
    return {
        "model": case.model,
        "layout": case.layout,
        "batch_size": case.batch_size,
        "pattern": pattern,
        "mode": mode,
        "seconds": summary.seconds,
        "final_accuracy": summary.accuracy[-1],
        "chunks": summary.chunks["per_replica"] if summary.chunks else None,
        "samples_moved": sum(s["taken"] for s in replicas),
        "samples_backed_up": sum(s["backups"] for s in replicas),
        "samples_dropped": sum(s["dropped"] for s in replicas),
        "wait_s": sum(s["wait_s"] for s in replicas) / case.replicas[0] if steps else None,  # per replica
        "mean_capacity_cores": mean_capacity(events, cfg.cores, case.workers, start, end),
        "workers": case.workers,
    }


def _ideal(results: list[dict[str, Any]], cfg: StragglersConfig) -> None:
    """Add each run's ideal seconds and its ratio to them, and each run's accuracy drop from the case's
    no-jitter run: the synchronous one (``off``) where it ran, else the same mode's."""
    for case in {(r["model"], r["layout"]) for r in results}:
        runs = [r for r in results if (r["model"], r["layout"]) == case]
        calm_runs = [r["seconds"] for r in runs if r["pattern"] == "none"]
        if not calm_runs:
            results[:] = [r for r in results if (r["model"], r["layout"]) != case]
            continue
        fastest = min(calm_runs)
        calm = {r["mode"]: r["final_accuracy"] for r in runs if r["pattern"] == "none"}
        baseline = calm.get("off")  # the synchronous no-jitter run's accuracy, where it ran
        for r in runs:
            r["ideal_seconds"] = fastest * r["workers"] * cfg.cores / r["mean_capacity_cores"]
            r["ratio_to_ideal"] = r["seconds"] / r["ideal_seconds"]
            reference = baseline if baseline is not None else calm.get(r["mode"])
            drop = None if reference is None else reference - r["final_accuracy"]
            r["accuracy_points_below_no_jitter"] = None if drop is None else 100 * drop


def _goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode, its ratio to the ideal per case and pattern and whether it met every goal; per case and
    pattern, the best mode; whether the patterns slowed the synchronous mode enough to mean anything."""

    def key(r: dict[str, Any]) -> str:
        return f"{r['model']}:{r['layout']}/{r['pattern']}"

    jittered = [r for r in results if r["pattern"] in GOALS["ratio_to_ideal"]]
    modes = list(dict.fromkeys(r["mode"] for r in results))
    ratios = {m: {key(r): r["ratio_to_ideal"] for r in jittered if r["mode"] == m} for m in modes}
    met = {
        m: bool(ratios[m])
        and all(r["ratio_to_ideal"] <= GOALS["ratio_to_ideal"][r["pattern"]] for r in jittered if r["mode"] == m)
        and all(_accurate(r) for r in results if r["mode"] == m)
        for m in modes
    }
    best = {}
    for k in dict.fromkeys(key(r) for r in jittered):
        winner = min((r for r in jittered if key(r) == k), key=lambda r: r["ratio_to_ideal"])
        best[k] = {"mode": winner["mode"], "ratio_to_ideal": winner["ratio_to_ideal"]}
    off = {k: v for k, v in ratios.get("off", {}).items() if k.endswith(("/slow-worker", "/disrupted-machine"))}
    return {
        "targets": GOALS,
        "ratio_to_ideal": ratios,
        "met": met,
        "best_mode": best,
        "off_met": bool(off) and min(off.values()) >= GOALS["off_ratio_to_ideal_at_least"],
        "worst_accuracy_points_below_no_jitter": max(
            (r["accuracy_points_below_no_jitter"] for r in results if r["accuracy_points_below_no_jitter"] is not None),
            default=None,
        ),
    }


def _accurate(run: dict[str, Any]) -> bool:
    """Whether a run's final accuracy is within the goal's points of the synchronous no-jitter run's."""
    drop = run["accuracy_points_below_no_jitter"]
    return drop is not None and drop <= GOALS["accuracy_points"]


def plot(results: list[dict[str, Any]], path: str | Path, cores: float) -> None:
    """One panel per case: bars of each mode's ratio to the ideal, grouped by pattern, each with its goal."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["model"], r["layout"]) for r in results))
    fig, axes = plt.subplots(1, len(cases), figsize=(7 * len(cases), 4), squeeze=False)
    for ax, (model, layout) in zip(axes[0], cases, strict=True):
        runs = [r for r in results if (r["model"], r["layout"]) == (model, layout)]
        patterns = list(dict.fromkeys(r["pattern"] for r in runs))
        modes = list(dict.fromkeys(r["mode"] for r in runs))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            ratios = [
                next((r["ratio_to_ideal"] for r in runs if r["pattern"] == p and r["mode"] == mode), 0.0)
                for p in patterns
            ]
            ax.bar([j + i * width for j in range(len(patterns))], ratios, width, label=mode)
        for j, pattern in enumerate(patterns):  # each pattern's goal, across its group of bars
            goal = GOALS["ratio_to_ideal"].get(pattern, 1.0)
            ax.hlines(goal, j - width / 2, j + 0.8 - width / 2, color="black", linestyle="--", linewidth=1)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(patterns))], patterns)
        ax.set_ylabel("wall time / ideal")
        what = "data-parallel workers" if "-" not in layout else "pipeline"
        ax.set_title(f"{model}, {layout} {what} of {cores:g} cores")
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: StragglersConfig, plot_path: str | None = None, keep: str | None = None) -> dict[str, Any]:
    """Run every case with every pattern and mode; return the JSON-ready report (and write the plot).

    A run whose worker fails is listed under ``failed`` with its one-line error; the others still run. A case
    whose no-jitter runs all failed has no ideal, and its runs are left out of the results.

    ``keep``: a folder to keep every run's folder in (default: a temporary one, removed).
    """
    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="conveyor-stragglers-") as tmp:
        root = Path(keep or tmp)
        for text in cfg.cases:
            case = Case.parse(text, cfg.batch_size)
            for pattern in cfg.patterns:
                for mode in cfg.modes:
                    folder = root / f"{case.model}-{case.layout}-{pattern}-{mode}"
                    try:
                        results.append(_run_one(cfg, case, pattern, mode, folder))
                    except WorkerError as exc:  # one failed run is reported, and the others still run
                        failed.append(
                            {
                                "model": case.model,
                                "layout": case.layout,
                                "pattern": pattern,
                                "mode": mode,
                                "error": str(exc).splitlines()[0],
                            }
                        )
    _ideal(results, cfg)
    if plot_path:
        plot(results, plot_path, cfg.cores)
    return {"config": asdict(cfg), "results": results, "failed": failed, "goals": _goals(results)}
