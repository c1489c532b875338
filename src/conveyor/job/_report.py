"""Reading, summing up and plotting training runs: JSON-lines logs, energy, accuracy against time and energy, and
the notes a run ends with."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["continued", "energy_summary", "plot_accuracy", "read_jsonl"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A run folder's JSON-lines log, one dict a line (empty if the run wrote none, e.g. no faults)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def continued(before: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A resumed run's epochs whole: ``before`` (its checkpoint's), then ``records`` (this run's) counted on from
    the last of them: epoch numbers, seconds, training seconds, samples and energy so far.

    Example:
        >>> continued([{"epoch": 2, "seconds": 9.0}], [{"epoch": 1, "seconds": 4.0}])
        [{'epoch': 2, 'seconds': 9.0}, {'epoch': 3, 'seconds': 13.0}]
    """
    if not before:
        return [dict(r) for r in records]
    last, whole = before[-1], [dict(r) for r in before]
    for record in records:
        carried = dict(record)
        for key in ("epoch", "seconds", "train_seconds", "samples", "energy_total_j"):
            if carried.get(key) is not None and last.get(key) is not None:
                carried[key] += last[key]
        whole.append(carried)
    return whole


def energy_summary(
    history: Sequence[Mapping[str, Any]], meter: str | None, note: str | None, target: float | None = None
) -> dict[str, Any]:
    """A run's energy from its epochs (``energy_j``, ``energy_total_j`` and ``accuracy``, ``seconds``): in all
    (``energy_j``), per epoch (``epoch_energy_j``), what measured it (``energy_meter``) and why nothing or not every
    worker did (``energy_note``); once ``target`` is reached, ``time_to_accuracy_s`` and ``energy_to_accuracy_j``.
    None stands for what no meter read.

    Example:
        >>> epochs = [{"seconds": 2.0, "accuracy": 0.5, "energy_j": 10.0, "energy_total_j": 10.0},
        ...           {"seconds": 4.0, "accuracy": 0.9, "energy_j": 12.0, "energy_total_j": 22.0}]
        >>> energy_summary(epochs, "zeus 0.16: GPU 0 (NVML)", None, target=0.8)["energy_to_accuracy_j"]
        22.0
    """
    summary = {
        "energy_j": history[-1].get("energy_total_j") if history else None,
        "epoch_energy_j": [h.get("energy_j") for h in history],
        "energy_meter": meter,
        "energy_note": note,
    }
    reached = next((h for h in history if target is not None and h["accuracy"] >= target), None)
    if reached is not None:
        summary |= {"time_to_accuracy_s": reached["seconds"], "energy_to_accuracy_j": reached.get("energy_total_j")}
    return summary


def plot_accuracy(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike[str],
    title: str = "test accuracy",
    target: float | None = None,
) -> None:
    """Write a PNG of each named run's epochs: accuracy (``"accuracy"``) against seconds (``"seconds"``); beside it
    the training loss (``"loss"``) against seconds where the epochs have it, and accuracy against the cumulative
    energy (``"energy_total_j"``, joules, shown in kJ) where some epochs have that.

    Example:
        >>> plot_accuracy({"dp": [{"seconds": 1.0, "accuracy": 0.5, "loss": 1.2}]}, "/tmp/acc.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    energy = {label: [e for e in epochs if e.get("energy_total_j") is not None] for label, epochs in runs.items()}
    panels: list[tuple[str, str, str, str]] = [("seconds", "accuracy", "wall-clock seconds", title)]
    if any("loss" in e for epochs in runs.values() for e in epochs):
        panels.append(("seconds", "loss", "wall-clock seconds", "training loss"))
    if any(energy.values()):
        panels.append(("energy_total_j", "accuracy", "energy (kJ, all workers)", f"{title}, against energy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 1.2, 4.0), squeeze=False)
    for ax, (x, y, xlabel, panel_title) in zip(axes[0], panels, strict=True):
        for label, epochs in (energy if x == "energy_total_j" else runs).items():
            shown = [e for e in epochs if y in e]
            scale = 1e3 if x == "energy_total_j" else 1.0
            ax.plot([e[x] / scale for e in shown], [e[y] for e in shown], marker="o", ms=3, label=label)
        if target is not None and y == "accuracy":
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy" if y == "accuracy" else "training loss")
        ax.set_title(panel_title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
