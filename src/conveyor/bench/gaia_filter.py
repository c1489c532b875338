"""``conveyor bench gaia-filter``: what Gaia's significance filter costs a site's leader per update.

The filter (:class:`~conveyor.gaia._filter.SignificanceFilter`) adds the update's gradients to what is pending and
takes out the significant entries, fused and in place. Beside it, the same arithmetic on packed copies, as the
filter ran before (gradients and weights each gathered into a new flat tensor, ``|a|`` and ``|w|`` into two more):
both on the same parameters (``weights`` entries in VGG-16's proportions, a few large tensors), from the same
gradients, for ``updates`` updates after ``warmup``; the medians count, and the report says whether both selected
the same entries at every update.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from conveyor.errors import InputError
from conveyor.gaia import SignificanceFilter
from conveyor.runtime.parts import synchronize

__all__ = ["FilterBenchConfig", "packed_select", "run"]


@dataclass(frozen=True)
class FilterBenchConfig:
    """What ``conveyor bench gaia-filter`` runs."""

    weights: int = 2_300_000  # vgg16's (conveyor's zoo)
    updates: int = 20
    warmup: int = 3
    threshold: float = 0.05
    lr: float = 0.05
    device: str = "cpu"

    def __post_init__(self) -> None:
        if min(self.weights, self.updates) < 1 or self.warmup < 0:
            raise InputError("weights and updates must be at least 1, warmup at least 0")


def packed_select(
    pending: torch.Tensor, sent_at: torch.Tensor, params: list[torch.Tensor], lr: float, threshold: float, now: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filter's arithmetic on packed copies of the gradients and the weights (the reference it is set against)."""
    grads = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params])
    pending += grads
    chosen = pending.abs().mul_(lr) > parameters_to_vector(params).detach().abs().mul_(threshold)
    indices = chosen.nonzero().reshape(-1)
    values = pending[indices]
    pending[indices] = 0
    ages = now - sent_at[indices]
    sent_at[indices] = now
    return indices, values, ages


def _params(weights: int, device: torch.device) -> list[torch.Tensor]:
    """Parameters of ``weights`` entries in all: 90% in three fully connected layers, the rest in thirteen."""
    sizes = [weights * 3 // 100] * 3 + [weights // 130] * 13
    sizes[0] += weights - sum(sizes)
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=generator).to(device)) for n in sizes]


def run(cfg: FilterBenchConfig) -> dict[str, Any]:
    """Time both ways over the same updates; return the JSON-ready report."""
    device = torch.device(cfg.device)
    params = _params(cfg.weights, device)
    fused = SignificanceFilter(cfg.weights, threshold=cfg.threshold, device=device)
    pending, sent_at = fused.pending.clone(), fused.sent_at.clone()
    generator = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"fused": [], "packed": []}
    same, sent = True, 0
    for update in range(cfg.warmup + cfg.updates):
        for p in params:
            p.grad = (0.01 * torch.randn(p.shape, generator=generator)).to(device)
        start = time.perf_counter()
        fused.add(params)
        chosen = fused.select(params, cfg.lr, update)
        synchronize(device)
        middle = time.perf_counter()
        reference = packed_select(pending, sent_at, params, cfg.lr, cfg.threshold, update)
        synchronize(device)
        if update >= cfg.warmup:
            times["fused"].append(middle - start)
            times["packed"].append(time.perf_counter() - middle)
        same = same and all(torch.equal(a, b) for a, b in zip(chosen, reference, strict=True))
        sent = int(chosen[0].numel())
    fused_s, packed_s = statistics.median(times["fused"]), statistics.median(times["packed"])
    return {
        "config": asdict(cfg),
        "fused_s_per_update": fused_s,
        "packed_s_per_update": packed_s,
        "speedup": packed_s / fused_s,
        "same_selection": same,
        "sent_fraction_last_update": sent / cfg.weights,
    }
