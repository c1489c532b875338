"""Which worker runs which stage: workers are numbered stage by stage, a stage's replicas side by side.

Example:
    >>> worker_stages([2, 1]), stage_workers([2, 1]), parse_replicas("15-1")
    ((0, 0, 1), [[0, 1], [2]], [15, 1])
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.errors import InputError

__all__ = ["check_replicas", "parse_replicas", "stage_workers", "worker_stages"]


def worker_stages(replicas: Sequence[int]) -> tuple[int, ...]:
    """The stage of every worker: ``(2, 1)`` -> ``(0, 0, 1)``."""
    return tuple(s for s, r in enumerate(replicas) for _ in range(r))


def stage_workers(replicas: Sequence[int]) -> list[list[int]]:
    """The workers (ranks) of every stage: ``(2, 1)`` -> ``[[0, 1], [2]]``."""
    out, first = [], 0
    for r in replicas:
        out.append(list(range(first, first + r)))
        first += r
    return out


def check_replicas(stages: int, replicas: Sequence[int] | None) -> tuple[int, ...]:
    """The replica count of every stage (one each by default).

    Raises:
        ValueError: not one count >= 1 per stage.
    """
    counts = tuple(replicas) if replicas is not None else (1,) * stages
    if len(counts) != stages or min(counts, default=0) < 1:
        raise InputError(f"replicas must give each of the {stages} stages a count >= 1, got {list(counts)}")
    return counts


def parse_replicas(text: str, stages: int | None = None) -> list[int]:
    """Read a layout written PipeDream's way, workers per stage joined by dashes: ``"2-1"``.

    Raises:
        ValueError: the text is not dash-separated counts >= 1, or not one per stage when ``stages`` is given.
    """
    parts = text.split("-")
    if not all(p.strip().isdigit() for p in parts):
        raise InputError(f"--replicas {text!r} is not a list of counts like 2-1")
    counts = [int(p) for p in parts]
    if (stages is not None and len(counts) != stages) or min(counts) < 1:
        n = stages or len(counts)
        example = "-".join(["2"] + ["1"] * (n - 1))
        raise InputError(f"--replicas {text} must give each of the {n} stages a worker count >= 1, e.g. {example}")
    return counts
