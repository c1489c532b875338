"""What a scheduling policy sees (a ``Problem``) and what it answers (an ``Allocation``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conveyor.errors import InputError

__all__ = ["Allocation", "Problem"]

# Array-like when given (lists are fine); always an np.ndarray once the Problem is built.
Array = Any


@dataclass(frozen=True)
class Problem:
    """The jobs in the cluster at one instant, and the cluster.

    Rows are jobs (``job_ids[i]``), columns device types (``device_types[k]``). A job uses
    ``scale_factors[i]`` devices of one type at a time; ``throughputs[i, k]`` is its speed (steps/s) then,
    0 where it cannot run on that type.

    Args:
        job_ids: the jobs, in a fixed order (every array below follows it).
        device_types: the device types, e.g. ``("k80", "p100", "v100")``.
        throughputs: ``(jobs, types)`` steps/s of each job alone on ``scale_factors[i]`` devices of each type.
        scale_factors: ``(jobs,)`` devices each job uses (1, 2, 4 or 8).
        capacity: ``(types,)`` devices of each type.
        weights: ``(jobs,)`` priority weights (higher: a larger share); default 1.
        remaining_steps: ``(jobs,)`` steps each job has left; default 1.
        elapsed_s: ``(jobs,)`` seconds since each job arrived; default 0.
        deadline_s: ``(jobs,)`` seconds from now by which each job must finish (its SLO); ``inf``: none.
        prices: ``(types,)`` dollars per device-hour of each type; default 1.
        arrival_s: ``(jobs,)`` arrival times (FIFO's order); default the row order.
        entities: ``(jobs,)`` the entity (user, team) each job belongs to, for hierarchical policies; default one.
        entity_weights: weight of each entity id appearing in ``entities``; default 1 each.
        pair_throughputs: space sharing: for a pair of row indices ``(i, j)`` with ``i < j`` that may share
            devices, a ``(types, 2)`` array of the two jobs' steps/s when they do. Only pairs of equal scale
            factor. Empty: no space sharing.
    """

    job_ids: tuple[int, ...]
    device_types: tuple[str, ...]
    throughputs: Array
    scale_factors: Array
    capacity: Array
    weights: Array = None
    remaining_steps: Array = None
    elapsed_s: Array = None
    deadline_s: Array = None
    prices: Array = None
    arrival_s: Array = None
    entities: Array = None
    entity_weights: dict[int, float] = field(default_factory=dict)
    pair_throughputs: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n, m = len(self.job_ids), len(self.device_types)
        defaults = {
            "weights": np.ones(n),
            "remaining_steps": np.ones(n),
            "elapsed_s": np.zeros(n),
            "deadline_s": np.full(n, np.inf),
            "prices": np.ones(m),
            "arrival_s": np.arange(n, dtype=float),
            "entities": np.zeros(n, dtype=int),
        }
        for name, default in defaults.items():
            value = getattr(self, name)
            object.__setattr__(self, name, default if value is None else np.asarray(value, dtype=default.dtype))
        object.__setattr__(self, "throughputs", np.asarray(self.throughputs, dtype=float).reshape(n, m))
        object.__setattr__(self, "scale_factors", np.asarray(self.scale_factors, dtype=int).reshape(n))
        object.__setattr__(self, "capacity", np.asarray(self.capacity, dtype=float).reshape(m))
        for name in ("weights", "remaining_steps", "elapsed_s", "deadline_s", "arrival_s", "entities"):
            if getattr(self, name).shape != (n,):
                raise InputError(f"Problem.{name} has shape {getattr(self, name).shape}; give one value per job ({n})")
        if self.prices.shape != (m,):
            raise InputError(f"Problem.prices has shape {self.prices.shape}; give one price per device type ({m})")
        if (self.throughputs < 0).any() or not np.isfinite(self.throughputs).all():
            raise InputError("Problem.throughputs must be finite and non-negative (0: the job cannot run there)")
        if n and (self.scale_factors < 1).any():
            raise InputError("Problem.scale_factors must be at least 1")

    @property
    def jobs(self) -> int:
        return len(self.job_ids)


@dataclass(frozen=True)
class Allocation:
    """A policy's answer: the fraction of time each combination of jobs runs on each device type.

    ``combos[c]`` is a tuple of row indices of the problem: ``(i,)`` for job i alone, ``(i, j)`` for two jobs
    sharing devices (space sharing). ``fractions[c, k]`` is the share of wall-clock time combination c holds
    its jobs' scale factor of devices of type k. Every job's fractions over all its combinations and types
    sum to at most 1, and each type's devices in use, ``sum_c scale(c) * fractions[c, k]``, stay within
    its capacity. ``notes`` are one-line messages for the user (an SLO that cannot be met, and what was done).
    """

    combos: tuple[tuple[int, ...], ...]
    fractions: np.ndarray
    notes: tuple[str, ...] = ()

    @staticmethod
    def singles(fractions: np.ndarray, notes: tuple[str, ...] = ()) -> Allocation:
        """An allocation without space sharing: row i of ``fractions`` is job i alone."""
        return Allocation(tuple((i,) for i in range(fractions.shape[0])), np.asarray(fractions, dtype=float), notes)

    def job_time(self, jobs: int) -> np.ndarray:
        """``(jobs, types)``: each job's share of time on each type, over every combination it is in."""
        out = np.zeros((jobs, self.fractions.shape[1]))
        for c, combo in enumerate(self.combos):
            for i in combo:
                out[i] += self.fractions[c]
        return out

    def effective_throughputs(self, problem: Problem) -> np.ndarray:
        """``(jobs,)``: each job's steps/s under this allocation, its combinations' throughputs weighted by
        their time shares."""
        out = np.zeros(problem.jobs)
        for c, combo in enumerate(self.combos):
            if len(combo) == 1:
                out[combo[0]] += self.fractions[c] @ problem.throughputs[combo[0]]
            else:
                pair = problem.pair_throughputs[(combo[0], combo[1])]
                out[combo[0]] += self.fractions[c] @ pair[:, 0]
                out[combo[1]] += self.fractions[c] @ pair[:, 1]
        return out

    def devices_used(self, problem: Problem) -> np.ndarray:
        """``(types,)``: devices of each type in use on average."""
        scale = np.array([problem.scale_factors[combo[0]] for combo in self.combos], dtype=float)
        return scale @ self.fractions if len(self.combos) else np.zeros(len(problem.device_types))
