"""The batch size of a recurring job (Zeus, NSDI'23, §4): pruned exploration, then Gaussian Thompson sampling.

Every recurrence of a job trains to a target metric with one batch size ``b`` and pays

    cost(b) = eta * energy + (1 - eta) * max_power * time                                     (Zeus Eq. 2)

(joules; ``max_power`` is the devices' largest power limit, so time is priced at full power). The search
sees only the history of recurrences: ``(batch size, cost, reached)`` in the order they finished, and
chooses the next batch size as a pure function of it (so a store can replay it; nothing else is kept).

**Pruning** (two rounds, Zeus §4.3): a round starts at the default ``b0`` and tries ``b0`` and the smaller
sizes in decreasing order, then the larger ones in increasing order; in each direction the first size that
does not reach the target (or is stopped early) ends that direction. The sizes that reached survive; the
cheapest becomes the next round's ``b0``.

**Thompson sampling** over the survivors, rewards ``r = -cost``. Each size's reward is modelled as Gaussian
with unknown mean and a precision estimated from its own observations; with a flat prior (precision 0) the
posterior of the mean after ``n`` rewards ``r_1..r_n`` is

    tau = 1 / var(r)            (population variance; infinite when all rewards are equal)
    mu | r ~ Normal(mean(r), 1 / (n * tau))

A sample is drawn for each size and the largest sample wins (the cheapest in expectation, exploring in
proportion to the uncertainty). Sizes with fewer than two rewards are tried first, in increasing order.

**Early stopping**: a recurrence whose cost would pass ``beta * (least cost of a recurrence that reached)``
stops (it did not reach: in pruning that ends a direction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from conveyor.errors import InputError

__all__ = ["BatchSizeSearch", "Choice", "Recurrence", "zeus_cost"]


def zeus_cost(energy_j: float, time_s: float, eta: float, max_power_w: float) -> float:
    """``eta * energy + (1 - eta) * max_power * time``: energy and time in one figure (joules).

    Example:
        >>> zeus_cost(1000.0, 10.0, eta=0.5, max_power_w=300.0)  # 500 J of energy + 1500 J of time
        2000.0
    """
    if not 0.0 <= eta <= 1.0:
        raise InputError(f"eta weighs energy against time and must be in [0, 1], got {eta}")
    return eta * energy_j + (1.0 - eta) * max_power_w * time_s


@dataclass(frozen=True)
class Recurrence:
    """One finished recurrence: the batch size it ran, its cost, and whether it reached the target;
    ``explored``: it ran the size the exploration asked for (a recurrence that ran the best size known while
    another explored does not count for pruning, only for the posterior). A run that failed has cost ``nan``."""

    batch_size: int
    cost: float
    reached: bool
    explored: bool = True


@dataclass(frozen=True)
class Choice:
    """The next recurrence's batch size and why: ``explore`` (pruning), ``thompson``, or ``best`` (the least
    cost known, for a recurrence that starts while an exploring one is still running)."""

    batch_size: int
    phase: str


@dataclass(frozen=True)
class BatchSizeSearch:
    """Zeus' batch-size optimizer for one job (see the module docstring for the equations).

    Example:
        >>> search = BatchSizeSearch((16, 32, 64, 128), default=32)
        >>> search.choose([]).batch_size  # b0 first
        32
        >>> history = [Recurrence(32, 100.0, True), Recurrence(16, 150.0, True)]
        >>> search.choose(history).batch_size  # below 32 down to the smallest, then up from 64
        64
    """

    sizes: tuple[int, ...]
    default: int
    rounds: int = 2
    beta: float = 2.0
    window: int = 0  # rewards per size the posterior uses (the latest); 0: all of them

    def __post_init__(self) -> None:
        if self.default not in self.sizes:
            raise InputError(f"the default batch size {self.default} is not among the candidates {list(self.sizes)}")
        if any(b < 1 for b in self.sizes) or len(set(self.sizes)) != len(self.sizes):
            raise InputError(f"candidate batch sizes must be distinct and at least 1, got {list(self.sizes)}")
        if self.rounds < 1 or self.beta <= 1.0 or self.window < 0 or self.window == 1:
            raise InputError("rounds must be at least 1, beta greater than 1 and window 0 (all) or at least 2")
        object.__setattr__(self, "sizes", tuple(sorted(self.sizes)))

    def survivors(self, history: Sequence[Recurrence]) -> tuple[int, ...] | int:
        """After pruning, the sizes that survived; while pruning, the size to try next (an ``int``).

        History entries are matched to the exploration in order; one for a size other than the one the
        exploration waits for (a recurrence that ran concurrently) is passed over.
        """
        left = [r for r in history if r.explored]
        candidates, start = list(self.sizes), self.default
        for _ in range(self.rounds):
            good: list[int] = []
            best = math.inf
            at = candidates.index(start)
            for direction in (candidates[at::-1], candidates[at + 1 :]):
                for size in direction:
                    seen = next((i for i, r in enumerate(left) if r.batch_size == size), None)
                    if seen is None:
                        return size
                    outcome = left.pop(seen)
                    if not outcome.reached:
                        break
                    good.append(size)
                    if outcome.cost < best:
                        best, start = outcome.cost, size
            if not good:
                raise InputError(
                    f"no batch size reached the target, not even the default {self.default}: raise "
                    "--epochs or lower --target-accuracy"
                )
            candidates = sorted(good)
        return tuple(candidates)

    def posterior(self, history: Sequence[Recurrence], size: int) -> tuple[float, float]:
        """``(mean, precision)`` of the posterior of ``size``'s mean reward (``-cost``); precision 0 with fewer
        than two rewards, ``inf`` when they are all equal."""
        rewards = np.array([-r.cost for r in history if r.batch_size == size and math.isfinite(r.cost)])
        if self.window:
            rewards = rewards[-self.window :]
        if len(rewards) < 2:
            return (float(rewards.mean()) if len(rewards) else 0.0), 0.0
        variance = float(rewards.var())
        return float(rewards.mean()), (math.inf if variance == 0.0 else len(rewards) / variance)

    def choose(self, history: Sequence[Recurrence], rng: np.random.Generator | None = None) -> Choice:
        """The next recurrence's batch size, given every finished recurrence in order."""
        state = self.survivors(history)
        if isinstance(state, int):
            return Choice(state, "explore")
        for size in state:  # at least two rewards each before sampling
            if self.posterior(history, size)[1] == 0.0:
                return Choice(size, "thompson")
        rng = rng if rng is not None else np.random.default_rng(len(history))
        samples = {}
        for size in state:
            mean, precision = self.posterior(history, size)
            samples[size] = mean if math.isinf(precision) else rng.normal(mean, 1.0 / math.sqrt(precision))
        return Choice(max(samples, key=samples.__getitem__), "thompson")

    def best(self, history: Sequence[Recurrence]) -> int:
        """The size of the cheapest recurrence that reached the target (the default before any did)."""
        reached = [r for r in history if r.reached]
        return min(reached, key=lambda r: r.cost).batch_size if reached else self.default

    def stop_above(self, history: Sequence[Recurrence]) -> float:
        """The cost at which a recurrence is stopped early: ``beta`` times the least cost that reached."""
        reached = [r.cost for r in history if r.reached]
        return self.beta * min(reached) if reached else math.inf
