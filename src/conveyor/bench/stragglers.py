"""``conveyor bench stragglers``: FlexRR's modes under injected stragglers, against the ideal.

Data parallelism on the emulated cluster, equal device quotas, each straggler pattern with a fixed seed
(:mod:`conveyor.emulate._faults`) and each mode of ``conveyor train --stragglers``:

- ``slow-worker``: every period a random worker (never the previous one) runs at a third of its cores;
- ``disrupted-machine``: every period a random server's workers share their cores with a competing load;
- ``power-law``: every period every worker pauses (cgroup freezer) for a Pareto-distributed time;
- ``none``: no jitter.

Per run: the wall-clock seconds of a fixed number of epochs (evaluation included), the final accuracy, the
samples replicas took from peers, and the ratio to the **ideal**: the fastest no-jitter time scaled by the
capacity the pattern left, ``ideal = T_none x C / mean C(t)``, where ``C(t)`` sums the workers' cores at
time ``t`` (a slowed worker counts its reduced cores, a loaded one half, a paused one none), averaged over
the run from the run's own fault log, so a slowdown that removes capacity is not counted against a mode.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.job import TrainConfig, train
from conveyor.stragglers import MODES

__all__ = ["PATTERNS", "StragglersConfig", "mean_capacity", "run"]

PATTERNS = {
    "slow-worker": "rotating-slow:factor=0.333,period={period},seed={seed},cores={cores}",
    "disrupted-machine": "disrupted:for={period},period={period},seed={seed}",
    "power-law": "power-law:alpha=1.5,scale={pause},period={period},seed={seed}",
    "none": "",
}
GOALS = {"flexrr_ratio_to_ideal": 1.10, "off_ratio_to_ideal_at_least": 1.4, "accuracy_points": 1.0}


@dataclass(frozen=True)
class StragglersConfig:
    """What ``conveyor bench stragglers`` runs."""

    model: str = "resnet"
    workers: int = 4
    cores: float = 0.45  # each worker's device
    network: str = "2:1.25e9,2:1.25e8"  # 2 servers of 2 workers
    epochs: int = 6
    batch_size: int = 128
    lr: float = 0.05
    chunks: int = 4
    slack: int = 1
    period: float = 2.0  # seconds between the patterns' events
    pause: float = 0.1  # power-law: the shortest pause
    seed: int = 0
    patterns: tuple[str, ...] = tuple(PATTERNS)
    modes: tuple[str, ...] = MODES

    def __post_init__(self) -> None:
        if unknown := set(self.patterns) - set(PATTERNS):
            raise ValueError(f"unknown patterns {sorted(unknown)}: choose from {', '.join(PATTERNS)}")
        if unknown := set(self.modes) - set(MODES):
            raise ValueError(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
        if "none" not in self.patterns:
            raise ValueError("the patterns must include none: the ideal is scaled from the no-jitter time")


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


def _train_config(cfg: StragglersConfig, pattern: str, mode: str, run_dir: Path) -> TrainConfig:
    faults = PATTERNS[pattern].format(period=cfg.period, seed=cfg.seed, cores=cfg.cores, pause=cfg.pause) or None
    return TrainConfig(
        model=cfg.model, workers=cfg.workers, stages=1, replicas=str(cfg.workers), schedule="flush",
        epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr, seed=cfg.seed, network=cfg.network,
        devices=f"{cfg.cores:g}", faults=faults, stragglers=mode, slack=cfg.slack, chunks=cfg.chunks,
        run_dir=str(run_dir),
    )  # fmt: skip


def _run_one(cfg: StragglersConfig, pattern: str, mode: str, run_dir: Path) -> dict[str, Any]:
    summary = train(_train_config(cfg, pattern, mode, run_dir))
    start = summary["started_at"]
    end = start + summary["seconds"]
    events, steps = _read_jsonl(run_dir / "faults.jsonl"), _read_jsonl(run_dir / "stragglers.jsonl")
    return {
        "model": cfg.model,
        "pattern": pattern,
        "mode": mode,
        "seconds": summary["seconds"],
        "final_accuracy": summary["accuracy"][-1],
        "samples_moved": sum(s["taken"] for s in steps),
        "wait_s": sum(s["wait_s"] for s in steps) / cfg.workers if steps else None,  # per replica
        "mean_capacity_cores": mean_capacity(events, cfg.cores, cfg.workers, start, end),
    }


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A run folder's JSON-lines log (empty if the run wrote none: no faults, or no flexible replicas)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _ideal(results: list[dict[str, Any]], cfg: StragglersConfig) -> None:
    """Add each run's ideal seconds and its ratio to them, and each run's accuracy drop from its mode's
    no-jitter run."""
    fastest = min(r["seconds"] for r in results if r["pattern"] == "none")
    calm = {r["mode"]: r["final_accuracy"] for r in results if r["pattern"] == "none"}
    for r in results:
        r["ideal_seconds"] = fastest * cfg.workers * cfg.cores / r["mean_capacity_cores"]
        r["ratio_to_ideal"] = r["seconds"] / r["ideal_seconds"]
        r["accuracy_points_below_no_jitter"] = 100 * (calm[r["mode"]] - r["final_accuracy"])


def _goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    def ratio(pattern: str, mode: str) -> float | None:
        return next((r["ratio_to_ideal"] for r in results if r["pattern"] == pattern and r["mode"] == mode), None)

    flexrr = {r["pattern"]: r["ratio_to_ideal"] for r in results if r["mode"] == "flexrr"}
    off = {p: ratio(p, "off") for p in ("slow-worker", "disrupted-machine")}
    return {
        "targets": GOALS,
        "flexrr_ratio_to_ideal": flexrr,
        "flexrr_met": bool(flexrr) and max(flexrr.values()) <= GOALS["flexrr_ratio_to_ideal"],
        "off_ratio_to_ideal": off,
        "off_met": all(v is not None and v >= GOALS["off_ratio_to_ideal_at_least"] for v in off.values()),
        "worst_accuracy_points_below_no_jitter": max(r["accuracy_points_below_no_jitter"] for r in results),
    }


def plot(results: list[dict[str, Any]], path: str | Path, title: str) -> None:
    """Bars of each mode's ratio to the ideal, grouped by pattern, with the 1.10 goal."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    patterns = list(dict.fromkeys(r["pattern"] for r in results))
    modes = list(dict.fromkeys(r["mode"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ratios = [next((r["ratio_to_ideal"] for r in results if r["pattern"] == p and r["mode"] == mode), 0.0)
                  for p in patterns]  # fmt: skip
        ax.bar([j + i * width for j in range(len(patterns))], ratios, width, label=mode)
    ax.axhline(GOALS["flexrr_ratio_to_ideal"], color="black", linestyle="--", linewidth=1, label="goal 1.10")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(patterns))], patterns)
    ax.set_ylabel("wall time / ideal")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: StragglersConfig, plot_path: str | None = None, keep: str | None = None) -> dict[str, Any]:
    """Run every pattern with every mode; return the JSON-ready report (and write the plot).

    ``keep``: a folder to keep every run's folder in (default: a temporary one, removed).
    """
    results = []
    with tempfile.TemporaryDirectory(prefix="conveyor-stragglers-") as tmp:
        root = Path(keep or tmp)
        for pattern in cfg.patterns:
            for mode in cfg.modes:
                results.append(_run_one(cfg, pattern, mode, root / f"{pattern}-{mode}"))
    _ideal(results, cfg)
    if plot_path:
        title = f"{cfg.model}, {cfg.workers} data-parallel workers of {cfg.cores:g} cores: time over the ideal"
        plot(results, plot_path, title)
    return {"config": asdict(cfg), "results": results, "goals": _goals(results)}
