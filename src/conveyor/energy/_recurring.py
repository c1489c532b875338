"""A recurrence of a named job: its batch size and learning rate from the store, its cost, its early stop."""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.energy._bandit import zeus_cost
from conveyor.energy._store import JobSettings, RecurrenceStore, Started
from conveyor.errors import InputError

__all__ = ["CostMeter", "Recurring", "candidate_sizes", "scaled_lr"]


def candidate_sizes(default: int, samples: int, spread: int = 3) -> tuple[int, ...]:
    """``default * 2**k`` for ``k`` in ``-spread..spread``, between 1 and the training set's size.

    Example:
        >>> candidate_sizes(64, 1437)
        (8, 16, 32, 64, 128, 256, 512)
    """
    sizes = {default * 2**k if k >= 0 else default // 2**-k for k in range(-spread, spread + 1)}
    return tuple(sorted(b for b in sizes if 1 <= b <= max(samples, default)))


def scaled_lr(lr: float, batch_size: int, default: int, optimizer: str) -> float:
    """The learning rate for ``batch_size``, given ``lr`` tuned for ``default``:

        SGD:  lr_b = lr * b / b0              (linear scaling: Goyal et al., 2017)
        Adam: lr_b = lr * sqrt(b / b0)        (square-root scaling: Krizhevsky, 2014; as Zeus does for Adam)

    Example:
        >>> scaled_lr(0.05, 128, 64, "sgd"), scaled_lr(0.01, 256, 64, "adam")
        (0.1, 0.02)
    """
    ratio = batch_size / default
    return lr * ratio if optimizer == "sgd" else lr * math.sqrt(ratio)


@dataclass
class CostMeter:
    """A recurrence's running cost, epoch by epoch, and whether another epoch would pass the threshold:
    stop when ``cost_so_far + last_epoch_cost > stop_above`` (the next epoch assumed as costly as the last)."""

    eta: float
    max_power_w: float
    stop_above: float
    cost: float = 0.0
    last: float = 0.0

    def add_epoch(self, energy_j: float | None, seconds: float) -> None:
        if energy_j is None and self.eta > 0:
            raise InputError("the cost needs energy (eta > 0) but no meter read any: use --eta 0 (time alone)")
        self.last = zeus_cost(energy_j or 0.0, seconds, self.eta, self.max_power_w)
        self.cost += self.last

    @property
    def over(self) -> bool:
        return self.cost + self.last > self.stop_above


@dataclass
class Recurring:
    """One recurrence of job ``name`` in ``store``: :meth:`start` chooses its batch size, :meth:`end` records it."""

    store: RecurrenceStore
    name: str
    settings: JobSettings
    started: Started | None = None

    def start(self) -> Started:
        self.started = self.store.begin(self.name, self.settings)
        return self.started

    def end(self, cost: float, energy_j: float | None, time_s: float, reached: bool, epochs: int) -> None:
        assert self.started is not None, "start() first"
        self.store.finish(self.started.id, cost=cost, energy_j=energy_j, time_s=time_s, reached=reached, epochs=epochs)

    def fail(self, interrupted: bool = False) -> None:
        """The run ended without an outcome: an error counts as not reaching the target (a size that runs out
        of memory is pruned); an interruption (Ctrl-C) teaches the search nothing."""
        if self.started is not None:
            self.store.abandon(self.started.id, failed=not interrupted)
