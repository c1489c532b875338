"""``conveyor bench warmstart``: time to accuracy of new model variants trained from scratch and warm-started
from the store's most similar trained model (ModelKeeper, NSDI'23, §6).

For each zoo family (mlp, vgg, resnet, gpt), a few variants (widths and depths) are trained first, as a
shared cluster's earlier jobs, and registered in a fresh model store. Then each new variant (another width or
depth, never stored) trains twice for the same epochs from the same seed: from its default initialisation,
and with ``--warm-start auto``, which picks the parent by similarity and accuracy and transforms its weights.

Per run: seconds and epochs to the family's target test accuracy (the first epoch end at or above it; for a
warm start the launcher's matching and transformation are added, as a user waits for them), the final
accuracy (the goal's), its mean over the last three epochs (less noisy), and the share of the child's
parameters the parent set (``coverage``). Per child: the speedup of time to target (scratch's seconds over the
warm start's; a lower bound where scratch never reached the target, its whole run standing for its time; none
where the warm start never did, which counts as 0 in the family's median, a failure). Per family: the median
speedup. ``match_1000_s``: matching a new model against 1,000 stored graphs (:func:`measure_matching`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress

from conveyor.bench._checks import require_known
from conveyor.bench._run import run_job
from conveyor.config import TrainConfig
from conveyor.errors import InputError
from conveyor.job import RunSummary, gpt, mlp, resnet, vgg
from conveyor.warmstart import ModelIndex, ModelStore, op_graph

__all__ = ["FAMILIES", "GOALS", "Family", "WarmStartBenchConfig", "measure_matching", "plot", "report", "run"]

# The paper reports 1.3x-4.3x faster training completion with no accuracy loss (ModelKeeper, abstract).
GOALS = {"median_speedup": 1.3, "accuracy_points": 1.0, "match_1000_s": 1.0}


@dataclass(frozen=True)
class Family:
    """A zoo family: the variants stored first (``parents``) and the new ones (``children``), as (width, depth);
    each child trains ``epochs`` epochs with ``optimizer`` at ``lr``; parents train ``parent_epochs``."""

    model: str
    parents: tuple[tuple[int, int], ...]
    children: tuple[tuple[int, int], ...]
    target: float
    epochs: int
    parent_epochs: int
    lr: float
    optimizer: str = "sgd"
    batch_size: int = 64


# Learning rates and budgets are the ones at which every variant trains from scratch to the target on this data
# (a VGG of depth 3, pooled to 1x1 without normalisation, does not: it is not a child here).
FAMILIES = {
    "mlp": Family("mlp", ((64, 2), (128, 1)), ((128, 2), (96, 3), (32, 2)), 0.95, 10, 10, 0.05),
    "vgg": Family("vgg", ((8, 2), (16, 1)), ((16, 2), (12, 2), (24, 1)), 0.95, 12, 12, 0.05),
    "resnet": Family("resnet", ((8, 2), (16, 1)), ((16, 2), (12, 2), (8, 3)), 0.98, 8, 8, 0.02),
    "gpt": Family("gpt", ((32, 2), (64, 1)), ((64, 2), (48, 2), (32, 3)), 0.38, 8, 8, 3e-3, "adam"),
}


@dataclass(frozen=True)
class WarmStartBenchConfig:
    """What ``conveyor bench warmstart`` runs: ``families`` (names of :data:`FAMILIES`), one worker per run, from
    ``seeds`` seeds (``seed``, ``seed + 1``, ...), each into a store of its own."""

    families: tuple[str, ...] = tuple(FAMILIES)
    seed: int = 0
    seeds: int = 1
    specs: dict[str, Family] = field(default_factory=lambda: dict(FAMILIES))

    def __post_init__(self) -> None:
        require_known("families", self.families, self.specs)
        if not self.families or len(set(self.families)) < len(self.families):
            raise InputError(f"give each family once, at least one: got {list(self.families)}")
        if self.seeds < 1:
            raise InputError(f"--seeds must be at least 1, got {self.seeds}")


def _config(
    family: Family, *, width: int, depth: int, epochs: int, store: Path, run_dir: Path, seed: int, **extra: Any
) -> TrainConfig:
    return TrainConfig.from_options(
        model=family.model,
        width=width,
        depth=depth,
        workers=1,
        epochs=epochs,
        lr=family.lr,
        optimizer=family.optimizer,
        batch_size=family.batch_size,
        seed=seed,
        store=str(store),
        run_dir=str(run_dir),
        energy_meter="off",
        **extra,
    )


def _row(name: str, *, family: Family, width: int, depth: int, warm: bool, summary: RunSummary) -> dict[str, Any]:
    """One run's figures: time and epochs to the target (None if never reached), the final accuracy."""
    info = summary.warm_start or {}
    prepare = info.get("seconds", 0.0)
    reached = next((i for i, a in enumerate(summary.accuracy) if a >= family.target), None)
    return {
        "family": name,
        "model": f"{family.model} w{width} d{depth}",
        "width": width,
        "depth": depth,
        "warm_start": warm,
        "parent": info.get("parent"),
        "parent_model": None,
        "similarity": info.get("similarity"),
        "seconds_to_target": None if reached is None else summary.epoch_seconds[reached] + prepare,
        "epochs_to_target": None if reached is None else reached + 1,
        "final_accuracy": summary.accuracy[-1],
        "last3_accuracy": sum(summary.accuracy[-3:]) / len(summary.accuracy[-3:]),
        "coverage": info.get("coverage", 0.0),
        "prepare_s": prepare,
        "accuracy": summary.accuracy,
        "epoch_seconds": [s + prepare for s in summary.epoch_seconds],
    }


def run(cfg: WarmStartBenchConfig, keep: Path | None = None) -> list[dict[str, Any]]:
    """For each seed, train every family's parents into a fresh store, then each child from scratch and
    warm-started (a seed's runs in ``seed-N`` under ``keep`` where there are several)."""
    if keep is not None and (keep / "store").exists():
        raise InputError(f"{keep / 'store'} exists: give --keep a new folder (the benchmark starts with no models)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Progress() as bar:
        root = keep or Path(tmp)
        per_seed = sum(len(cfg.specs[f].parents) + 2 * len(cfg.specs[f].children) for f in cfg.families)
        task = bar.add_task("warm-start runs", total=per_seed * cfg.seeds)
        for seed in _seeds(cfg):
            folder = root if cfg.seeds == 1 else root / f"seed-{seed}"
            rows += _one_seed(cfg, seed, folder, lambda: bar.advance(task))
    return rows


def _one_seed(cfg: WarmStartBenchConfig, seed: int, root: Path, advance: Callable[[], None]) -> list[dict[str, Any]]:
    """One seed's parents into ``root/store``, then its children's rows (each with its ``seed``)."""
    rows = []
    store = root / "store"
    for name in cfg.families:
        family = cfg.specs[name]
        for width, depth in family.parents:
            run_dir = root / f"{name}-w{width}-d{depth}-stored"
            run_job(
                _config(
                    family,
                    width=width,
                    depth=depth,
                    epochs=family.parent_epochs,
                    store=store,
                    run_dir=run_dir,
                    seed=seed,
                    register=True,
                )
            )
            advance()
        for width, depth in family.children:
            for warm in (False, True):
                run_dir = root / f"{name}-w{width}-d{depth}-{'warm' if warm else 'scratch'}"
                extra = {"warm_start": "auto"} if warm else {}
                summary = run_job(
                    _config(
                        family,
                        width=width,
                        depth=depth,
                        epochs=family.epochs,
                        store=store,
                        run_dir=run_dir,
                        seed=seed,
                        **extra,
                    )
                )
                rows.append(
                    _row(name, family=family, width=width, depth=depth, warm=warm, summary=summary) | {"seed": seed}
                )
                if rows[-1]["parent"]:
                    parent = ModelStore(store).get(rows[-1]["parent"])
                    rows[-1]["parent_model"] = f"{parent.name} w{parent.info['width']} d{parent.info['depth']}"
                advance()
    return rows


def report(cfg: WarmStartBenchConfig, rows: list[dict[str, Any]], match_1000_s: float) -> dict[str, Any]:
    """The JSON report: rows, each child's speedup and accuracy change (over several seeds: their medians, each
    seed's in ``per_seed``), per-family medians and the goals."""
    by = {(r["family"], r["model"], r["seed"], r["warm_start"]): r for r in rows}
    children = []
    for family, model in dict.fromkeys((r["family"], r["model"]) for r in rows):
        runs = [_child(by[(family, model, seed, False)], by[(family, model, seed, True)]) for seed in _seeds(cfg)]
        children.append(runs[0] if len(runs) == 1 else _over_seeds(runs))
    families = {}
    for name in dict.fromkeys(c["family"] for c in children):
        mine = [c for c in children if c["family"] == name]
        speedups = [c["speedup"] if c["speedup"] is not None else 0.0 for c in mine]
        families[name] = {
            "median_speedup": statistics.median(speedups),
            "worst_accuracy_change": min(c["accuracy_change"] for c in mine),
            "worst_last3_accuracy_change": min(c["last3_accuracy_change"] for c in mine),
        }
    points = GOALS["accuracy_points"] / 100
    goals = {
        "median_speedup_per_family": all(f["median_speedup"] >= GOALS["median_speedup"] for f in families.values()),
        "accuracy_within_one_point": all(f["worst_accuracy_change"] >= -points for f in families.values()),
        "match_1000_under_1s": match_1000_s < GOALS["match_1000_s"],
    }
    config = {**asdict(cfg), "specs": {k: asdict(v) for k, v in cfg.specs.items() if k in cfg.families}}
    return {
        "config": config,
        "results": rows,
        "children": children,
        "families": families,
        "match_1000_s": match_1000_s,
        "goals": goals,
        "paper": {"speedup_range": [1.3, 4.3]},
    }


def _seeds(cfg: WarmStartBenchConfig) -> range:
    return range(cfg.seed, cfg.seed + cfg.seeds)


def _child(scratch: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    """One seed's child: its warm start's speedup to the target and change of accuracy against scratch."""
    s, w = scratch["seconds_to_target"], warm["seconds_to_target"]
    return {
        "family": warm["family"],
        "model": warm["model"],
        "parent": warm["parent"],
        "coverage": warm["coverage"],
        # a scratch run that never reached the target: its whole run bounds the speedup from below
        "speedup": None if w is None else (s if s is not None else scratch["epoch_seconds"][-1]) / w,
        "speedup_is_lower_bound": w is not None and s is None,
        "accuracy_change": warm["final_accuracy"] - scratch["final_accuracy"],
        # the same over the last three epochs: on a 360-sample test set one epoch's accuracy swings by points
        "last3_accuracy_change": warm["last3_accuracy"] - scratch["last3_accuracy"],
    }


def _over_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A child over several seeds: the medians of its speedup (a warm start that never reached the target counts
    0) and accuracy changes; one seed's final accuracy on a small test set swings by points between epochs."""
    first = runs[0]
    return {
        "family": first["family"],
        "model": first["model"],
        "parent": first["parent"],
        "coverage": statistics.median(r["coverage"] for r in runs),
        "speedup": statistics.median(r["speedup"] or 0.0 for r in runs),
        "speedup_is_lower_bound": any(r["speedup_is_lower_bound"] for r in runs),
        "accuracy_change": statistics.median(r["accuracy_change"] for r in runs),
        "last3_accuracy_change": statistics.median(r["last3_accuracy_change"] for r in runs),
        "per_seed": runs,
    }


def measure_matching(n: int = 1000, repeats: int = 3, k: int = 5) -> float:
    """Seconds :meth:`~conveyor.warmstart.ModelIndex.best` takes to match one child against ``n`` stored zoo-model
    variants (the median of ``repeats``).

    Graph building (fx tracing) is done beforehand and not timed: 24 variants (MLP, VGG, ResNet and GPT at several
    widths and depths) are traced once and stored under ``n`` ids with varying accuracies, in a fresh index for
    each repeat.
    """
    graphs = [op_graph(build(width=w, depth=d)) for build in (mlp, vgg, resnet) for w in (8, 16) for d in (1, 2, 3)]
    graphs += [op_graph(gpt(32, width=w, depth=d)) for w in (32, 64) for d in (2, 3, 4)]
    child = op_graph(resnet(width=12, depth=2))
    seconds = []
    for _ in range(repeats):  # a fresh index each time: a new job's first match, its signature matrix not yet built
        index = ModelIndex()
        for i in range(n):
            index.add(f"m{i}", graphs[i % len(graphs)], 0.5 + 0.5 * ((i * 37) % 100) / 100)
        start = time.perf_counter()
        index.best(child, k=k)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def plot(rows: list[dict[str, Any]], targets: dict[str, float], path: Path) -> None:
    """Test accuracy against time, one panel per family: scratch dashed, warm-started solid, one colour per
    variant; the family's target as a grey line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(r["family"] for r in rows))
    fig, axes = plt.subplots(1, len(families), figsize=(3.6 * len(families), 3.4), squeeze=False)
    for ax, family in zip(axes[0], families, strict=True):
        models = list(dict.fromkeys(r["model"] for r in rows if r["family"] == family))
        for i, model in enumerate(models):
            for r in (r for r in rows if r["model"] == model):
                ax.plot(
                    r["epoch_seconds"],
                    r["accuracy"],
                    color=f"C{i}",
                    marker=".",
                    linestyle="-" if r["warm_start"] else "--",
                    label=f"{model.split(' ', 1)[1]} {'warm' if r['warm_start'] else 'scratch'}",
                )
        ax.axhline(targets[family], color="grey", linewidth=1)
        ax.set_title(family)
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("test accuracy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
