"""``conveyor bench stragglers``' report: each (case, pattern, mode)'s runs gathered into a row (medians and
spreads), its ratio to the ideal, the goals, and the plot.

A row keeps every run's seconds (``runs``), their median (``seconds``) and spread (``(max - min) / median``);
each run has its own ideal, ``T_none x C / mean C(t)`` from its own fault log (``T_none``: the case's fastest
mode's median no-jitter seconds), and the row's ``ratio_to_ideal`` is the median of its runs' ratios
(``ratios``, whose spread the plot draws). Its accuracy is the median run's, and its drop below the case's
synchronous no-jitter accuracy (``off``'s median, else the mode's own) is its worst run's: the goal asks it of
every run.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

__all__ = ["GOALS", "aggregate", "goals", "plot"]

# The time goal of a mode per pattern, its accuracy goal (points below the synchronous no-jitter run, every
# run), how much the patterns must slow the synchronous mode for the goals to mean anything, and how far apart
# a mode's no-jitter runs may be for its ratios to carry a 10% goal.
GOALS: dict[str, Any] = {
    "ratio_to_ideal": {"slow-worker": 1.10, "disrupted-machine": 1.10, "power-law": 1.25},
    "accuracy_points": 1.0,
    "off_ratio_to_ideal_at_least": 1.4,
    "no_jitter_spread_at_most": 0.05,
}
_PER_RUN = ("samples_moved", "samples_backed_up", "samples_dropped", "wait_s")  # medians of the runs'


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def aggregate(runs: list[dict[str, Any]], cores: float) -> list[dict[str, Any]]:
    """One row per (case, pattern, mode) from its runs, with the ideal and the ratio to it. A case whose
    no-jitter runs all failed has no ideal, and its rows are left out."""
    rows: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for run in runs:
        rows.setdefault((run["model"], run["layout"], run["pattern"], run["mode"]), []).append(run)
    out = []
    for (model, layout, pattern, mode), mine in rows.items():
        seconds = [r["seconds"] for r in mine]
        accuracies = [r["final_accuracy"] for r in mine]
        row = {
            "model": model,
            "layout": layout,
            "batch_size": mine[0]["batch_size"],
            "pattern": pattern,
            "mode": mode,
            "workers": mine[0]["workers"],
            "runs": seconds,
            "seconds": statistics.median(seconds),
            "spread": _spread(seconds),
            "final_accuracy": statistics.median(accuracies),
            "final_accuracies": accuracies,
            "chunks": mine[0]["chunks"],
            "mean_capacity_cores": [r["mean_capacity_cores"] for r in mine],
        }
        for key in _PER_RUN:
            values = [r[key] for r in mine if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        out.append(row)
    return _ideal(out, cores)


def _ideal(rows: list[dict[str, Any]], cores: float) -> list[dict[str, Any]]:
    """Each row's ideal and ratio to it (module docstring), and its worst run's accuracy drop."""
    kept = []
    for case in dict.fromkeys((r["model"], r["layout"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["layout"]) == case]
        calm = {r["mode"]: r for r in mine if r["pattern"] == "none"}
        if not calm:
            continue
        fastest = min(r["seconds"] for r in calm.values())
        for r in mine:
            ideals = [fastest * r["workers"] * cores / c for c in r["mean_capacity_cores"]]
            r["ideal_seconds"] = statistics.median(ideals)
            r["ratios"] = [s / i for s, i in zip(r["runs"], ideals, strict=True)]
            r["ratio_to_ideal"] = statistics.median(r["ratios"])
            reference = calm.get("off", calm.get(r["mode"]))
            worst = min(r["final_accuracies"])
            r["accuracy_points_below_no_jitter"] = (
                None if reference is None else 100 * (reference["final_accuracy"] - worst)
            )
        kept += mine
    return kept


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode, its median ratio to the ideal per case and pattern and whether it met every goal; per case and
    pattern, the best mode; whether the patterns slowed the synchronous mode enough to mean anything; and the
    spread of each mode's no-jitter runs against the 5% the ratios need."""

    def key(r: dict[str, Any]) -> str:
        return f"{r['model']}:{r['layout']}/{r['pattern']}"

    jittered = [r for r in rows if r["pattern"] in GOALS["ratio_to_ideal"]]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    ratios = {m: {key(r): r["ratio_to_ideal"] for r in jittered if r["mode"] == m} for m in modes}
    met = {
        m: bool(ratios[m])
        and all(r["ratio_to_ideal"] <= GOALS["ratio_to_ideal"][r["pattern"]] for r in jittered if r["mode"] == m)
        and all(_accurate(r) for r in rows if r["mode"] == m)
        for m in modes
    }
    best = {}
    for k in dict.fromkeys(key(r) for r in jittered):
        winner = min((r for r in jittered if key(r) == k), key=lambda r: r["ratio_to_ideal"])
        best[k] = {"mode": winner["mode"], "ratio_to_ideal": winner["ratio_to_ideal"]}
    off = {k: v for k, v in ratios.get("off", {}).items() if k.endswith(("/slow-worker", "/disrupted-machine"))}
    calm = {f"{r['model']}:{r['layout']}/{r['mode']}": r["spread"] for r in rows if r["pattern"] == "none"}
    drops = [r["accuracy_points_below_no_jitter"] for r in rows if r["accuracy_points_below_no_jitter"] is not None]
    return {
        "targets": GOALS,
        "ratio_to_ideal": ratios,
        "met": met,
        "best_mode": best,
        "off_met": bool(off) and min(off.values()) >= GOALS["off_ratio_to_ideal_at_least"],
        "worst_accuracy_points_below_no_jitter": max(drops, default=None),
        "no_jitter_spread": calm,
        "no_jitter_spread_met": bool(calm) and max(calm.values()) <= GOALS["no_jitter_spread_at_most"],
    }


def _accurate(row: dict[str, Any]) -> bool:
    """Whether every run's final accuracy is within the goal's points of the synchronous no-jitter run's."""
    drop = row["accuracy_points_below_no_jitter"]
    return drop is not None and drop <= GOALS["accuracy_points"]


def plot(rows: list[dict[str, Any]], path: str | Path, cores: float) -> None:
    """One panel per case: bars of each mode's median ratio to the ideal, its runs' range as an error bar,
    grouped by pattern, each pattern's goal dashed."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["model"], r["layout"]) for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(7 * len(cases), 4), squeeze=False)
    for ax, (model, layout) in zip(axes[0], cases, strict=True):
        mine = [r for r in rows if (r["model"], r["layout"]) == (model, layout)]
        patterns = list(dict.fromkeys(r["pattern"] for r in mine))
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            found = {r["pattern"]: r for r in mine if r["mode"] == mode}
            xs = [j + i * width for j, p in enumerate(patterns) if p in found]
            ratios = [found[p]["ratio_to_ideal"] for p in patterns if p in found]
            low = [found[p]["ratio_to_ideal"] - min(found[p]["ratios"]) for p in patterns if p in found]
            high = [max(found[p]["ratios"]) - found[p]["ratio_to_ideal"] for p in patterns if p in found]
            ax.bar(xs, ratios, width, yerr=[low, high], capsize=2, label=mode)
        for j, pattern in enumerate(patterns):  # each pattern's goal, across its group of bars
            goal = GOALS["ratio_to_ideal"].get(pattern, 1.0)
            ax.hlines(goal, j - width / 2, j + 0.8 - width / 2, color="black", linestyle="--", linewidth=1)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(patterns))], patterns)
        ax.set_ylabel("wall time / ideal (median, runs' range)")
        what = "data-parallel workers" if "-" not in layout else "pipeline"
        ax.set_title(f"{model}, {layout} {what} of {cores:g} cores")
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
