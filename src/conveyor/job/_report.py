"""Reading and plotting training runs: a run folder's JSON-lines logs, and test accuracy against wall-clock time."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_accuracy", "read_jsonl"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A run folder's JSON-lines log, one dict a line (empty if the run wrote none, e.g. no faults)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plot_accuracy(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike[str],
    title: str = "test accuracy",
    target: float | None = None,
) -> None:
    """Write a PNG of accuracy (``"accuracy"``) against seconds (``"seconds"``) for each named run's epochs.

    Example:
        >>> plot_accuracy({"dp": [{"seconds": 1.0, "accuracy": 0.5}]}, "/tmp/acc.png")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, epochs in runs.items():
        ax.plot([e["seconds"] for e in epochs], [e["accuracy"] for e in epochs], marker="o", ms=3, label=label)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
