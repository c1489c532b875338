"""What the policies may know at a decision: the preemption model fitted on the past, refitted periodically."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from conveyor.markets._hazard import HazardModel, Losses, features, fit_known, labels, losses_at
from conveyor.markets._traces import MarketTrace

__all__ = ["Forecaster"]


class Forecaster:
    """Loss forecasts for a trace set, shared by every policy and start (fits and forecasts are cached by tick).

    A forecast at tick ``t`` uses the model fitted at the last refit tick ``r <= t`` (every ``refit_every``
    ticks), which saw only ticks before ``r``; the features at ``t`` see ticks ``<= t``.
    """

    def __init__(self, traces: Sequence[MarketTrace], *, horizon: int, refit_every: int) -> None:
        self.traces, self.horizon, self.refit_every = list(traces), horizon, max(refit_every, 1)
        self._features = [features(t) for t in self.traces]
        self._labels = [labels(t, horizon) for t in self.traces]  # each fit and forecast reads its past only
        self._models: dict[int, HazardModel] = {}
        self._losses: dict[int, Losses] = {}

    def model(self, t: int) -> HazardModel:
        r = t - t % self.refit_every
        if r not in self._models:
            gap = self.traces[0].gap_s
            self._models[r] = fit_known(self._features, self._labels, until=r, horizon=self.horizon, gap_s=gap)
        return self._models[r]

    def losses(self, t: int) -> Losses:
        if t not in self._losses:
            self._losses[t] = losses_at(self.traces, self.model(t), self._features, self._labels, t)
        return self._losses[t]

    def availability(self, t: int, days: float = 7.0) -> np.ndarray:
        """Each market's share of the past ``days`` (ticks before ``t``) with a machine available."""
        gap = self.traces[0].gap_s
        lo = max(0, t - int(days * 86400 / gap))
        if t <= lo:
            return np.zeros(len(self.traces))
        return np.array([float(np.mean(tr.counts[lo:t] > 0)) for tr in self.traces])
