"""The preemption model: the chance that machines held in a market now are lost within the next interval.

A logistic regression, pooled over a trace set's markets and fitted only on what is known at the decision
time ``t``: a tick ``s`` is a training example once its whole horizon has passed (``s + H <= t``). At tick
``s`` of a market with counts ``c``, with the market available (``c_s > 0``):

    ``y_s = 1  if  min(c_{s+1} .. c_{s+H}) < c_s``      (some machine held at ``s`` is lost within ``H`` ticks)
    ``p_s = sigmoid(w . f_s + b)``

where ``f_s`` depends on ``c_0 .. c_s`` only: ``log(1 + hours since the last drop)`` (time held), the fraction
of the last 24 h the market was available, its drops per hour over the last 24 h and over all its past, and
``c_s`` over its largest count so far. ``w, b`` minimize the mean log loss plus ``lambda/2 |w|^2`` (L-BFGS).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize  # type: ignore[import-untyped]

from conveyor.markets._traces import MarketTrace

__all__ = ["HazardModel", "Losses", "calibration", "features", "fit", "fit_known", "labels", "losses_at"]

FEATURES = ("log_hours_held", "available_24h", "drops_per_h_24h", "drops_per_h_past", "level")
L2 = 1e-2


def features(trace: MarketTrace) -> np.ndarray:
    """``(ticks, 5)``: each tick's features from that tick and those before it (never after)."""
    c = trace.counts.astype(float)
    n, per_h = len(c), 3600.0 / trace.gap_s
    window = max(1, round(24 * per_h))
    drop = np.concatenate([[0.0], (np.diff(c) < 0).astype(float)])
    ticks = np.arange(n)
    last_drop = np.maximum.accumulate(np.where(drop > 0, ticks, 0))
    held_h = (ticks - last_drop) / per_h

    def trailing_mean(x: np.ndarray) -> np.ndarray:
        s = np.concatenate([[0.0], np.cumsum(x)])
        lo = np.maximum(ticks + 1 - window, 0)
        mean: np.ndarray = (s[ticks + 1] - s[lo]) / (ticks + 1 - lo)
        return mean

    drops_past = (np.cumsum(drop) + 1.0) / ((ticks + 1) / per_h + 24.0)  # a prior of one drop a day
    peak = np.maximum(np.maximum.accumulate(c), 1.0)
    return np.column_stack([np.log1p(held_h), trailing_mean(c > 0), trailing_mean(drop) * per_h, drops_past, c / peak])


def labels(trace: MarketTrace, horizon: int) -> np.ndarray:
    """``y_s`` per tick (NaN where the market is empty at ``s`` or the horizon runs past the trace)."""
    c = trace.counts
    n = len(c)
    y = np.full(n, np.nan)
    if n <= horizon:
        return y
    windows = np.lib.stride_tricks.sliding_window_view(c[1:], horizon)  # windows[s] = c[s+1 .. s+H]
    known = np.arange(n - horizon)
    y[known] = (windows.min(axis=1) < c[known]).astype(float)
    y[c == 0] = np.nan
    return y


@dataclass(frozen=True)
class HazardModel:
    """Fitted weights over standardized features; ``horizon`` in ticks; ``fitted_at`` the last tick it knew."""

    weights: np.ndarray
    bias: float
    mean: np.ndarray
    scale: np.ndarray
    horizon: int
    fitted_at: int

    def predict(self, x: np.ndarray) -> np.ndarray:
        """P(a loss within the horizon) for rows of features."""
        z = ((x - self.mean) / self.scale) @ self.weights + self.bias
        p: np.ndarray = 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))
        return p


def fit(traces: Sequence[MarketTrace], *, until: int, horizon: int) -> HazardModel:
    """Fit on the ticks ``s`` with ``s + horizon <= until`` of every market (nothing at or after ``until``
    beyond what those labels saw)."""
    feats, ys = [features(t) for t in traces], [labels(t, horizon) for t in traces]
    return fit_known(feats, ys, until=until, horizon=horizon, gap_s=traces[0].gap_s)


def fit_known(
    feats: Sequence[np.ndarray], ys: Sequence[np.ndarray], *, until: int, horizon: int, gap_s: float
) -> HazardModel:
    """:func:`fit` on each market's features and labels computed already (over the whole trace: only the
    ticks whose horizon has passed by ``until`` are read)."""
    known = max(until - horizon + 1, 0)
    keep = [~np.isnan(y[:known]) for y in ys]
    x = np.concatenate([f[:known][k] for f, k in zip(feats, keep, strict=True)])
    y = np.concatenate([y[:known][k] for y, k in zip(ys, keep, strict=True)])
    width = len(FEATURES)
    if len(y) == 0:  # nothing known yet: one drop a day, whatever the features
        rate = 1.0 - np.exp(-horizon * gap_s / 86400.0)
        return HazardModel(
            np.zeros(width), float(np.log(rate / (1 - rate))), np.zeros(width), np.ones(width), horizon, until
        )
    mean, scale = x.mean(axis=0), np.maximum(x.std(axis=0), 1e-6)
    z = (x - mean) / scale
    prior = (y.sum() + 1.0) / (len(y) + 2.0)

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:-1], theta[-1]
        logits = z @ w + b
        p = 1.0 / (1.0 + np.exp(-np.clip(logits, -30.0, 30.0)))
        value = np.mean(np.logaddexp(0.0, logits) - y * logits) + L2 / 2 * w @ w
        grad = np.concatenate([z.T @ (p - y) / len(y) + L2 * w, [np.mean(p - y)]])
        return float(value), grad

    start = np.concatenate([np.zeros(width), [np.log(prior / (1 - prior))]])
    theta = minimize(loss, start, jac=True, method="L-BFGS-B").x
    return HazardModel(theta[:-1], float(theta[-1]), mean, scale, horizon, until)


@dataclass(frozen=True)
class Losses:
    """What a decision at tick ``t`` expects of each market over the next horizon.

    Attributes:
        p: P(a loss) per market.
        fraction: the share of the held machines a loss takes (1 for single-machine markets), from the past.
        correlation: the losses' correlation matrix, from the past ticks where both markets were available.
    """

    p: np.ndarray
    fraction: np.ndarray
    correlation: np.ndarray


def losses_at(
    traces: Sequence[MarketTrace],
    model: HazardModel,
    feats: Sequence[np.ndarray],
    labelled: Sequence[np.ndarray],
    t: int,
) -> Losses:
    """Each market's loss probability at tick ``t``, the past loss fractions and the losses' correlation, from
    its features and labels over the whole trace (only the labels whose horizon has passed by ``t`` are read)."""
    p = np.array([model.predict(f[t : t + 1])[0] for f in feats])
    known = max(t - model.horizon + 1, 0)
    ys = np.array([y[:known] for y in labelled])
    fraction = np.ones(len(traces))
    for i, tr in enumerate(traces):
        c = tr.counts[: known + model.horizon].astype(float)
        hit = np.flatnonzero(ys[i] == 1)
        if len(hit) and c.max() > 1:
            windows = np.lib.stride_tricks.sliding_window_view(c[1:], model.horizon)[hit]
            fraction[i] = float(np.mean((c[hit] - windows.min(axis=1)) / c[hit]))
    return Losses(p, fraction, _correlation(ys))


def _correlation(ys: np.ndarray) -> np.ndarray:
    """Pairwise correlation of loss labels where both are known; 0 where too few joint ticks; PSD."""
    k = len(ys)
    corr = np.eye(k)
    for i in range(k):
        for j in range(i + 1, k):
            both = ~np.isnan(ys[i]) & ~np.isnan(ys[j])
            a, b = ys[i][both], ys[j][both]
            if len(a) >= 30 and a.std() > 0 and b.std() > 0:
                corr[i, j] = corr[j, i] = float(np.corrcoef(a, b)[0, 1])
    values, vectors = np.linalg.eigh(corr)
    fixed = vectors @ np.diag(np.maximum(values, 1e-6)) @ vectors.T
    d = np.sqrt(np.diag(fixed))
    psd: np.ndarray = fixed / np.outer(d, d)
    return psd


def calibration(
    traces: Sequence[MarketTrace], *, horizon: int, train_share: float = 0.6
) -> list[dict[str, float | str]]:
    """Fit on the first ``train_share`` of the set, score the held-back rest: per market its Brier score
    ``mean((p - y)^2)``, mean predicted and observed loss rates; a last row ``deciles`` pools the markets."""
    split = int(len(traces[0].counts) * train_share)
    model = fit(traces, until=split, horizon=horizon)
    rows: list[dict[str, float | str]] = []
    ps, ys = [], []
    for t in traces:
        p, y = model.predict(features(t))[split:], labels(t, horizon)[split:]
        keep = ~np.isnan(y)
        p, y = p[keep], y[keep]
        ps.append(p)
        ys.append(y)
        if len(y):
            brier = float(np.mean((p - y) ** 2))
            rows.append(
                {"market": t.name, "brier": brier, "predicted_rate": float(p.mean()), "observed_rate": float(y.mean())}
            )
    return rows + _deciles(np.concatenate(ps), np.concatenate(ys))


def _deciles(p: np.ndarray, y: np.ndarray) -> list[dict[str, float | str]]:
    """Predicted against observed loss rates by decile of the prediction, all markets pooled."""
    if len(p) < 10:
        return []
    order = np.argsort(p)
    return [
        {
            "market": f"decile {d + 1}",
            "brier": float(np.mean((p[part] - y[part]) ** 2)),
            "predicted_rate": float(p[part].mean()),
            "observed_rate": float(y[part].mean()),
        }
        for d, part in enumerate(np.array_split(order, 10))
    ]
