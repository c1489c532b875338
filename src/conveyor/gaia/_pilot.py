"""Whether a site's own share should stand in for what the others hold back (``--wan-estimate auto``).

With the estimate (:mod:`conveyor.gaia._estimate`) a site of ``D`` moves every entry the others still hold back by
``lr D g_d``: ``D`` times the step plain Gaia takes there, on the same share of the batch (``B / D`` samples). So
the estimate asks of the model what a rate ``D`` times higher on ``B / D`` samples asks, and that is what the
pilot tries before training: two short runs from the job's first weights on batches of a share's size, one at the
job's rate ``lr`` and one at ``D lr``, the same batches in the same order, each scored by the mean loss on held-out
training samples at four points of its steps,

    score(r) = (1/4) sum over k in 1..4 of L_held(w_r(k K / 4)),

where ``w_r(s)`` are the weights after ``s`` steps at rate ``r``. The estimate is on when ``score(D lr) <
score(lr)``: the model learns faster on a share at the rate the estimate steps it with. (Measured on ``conveyor
bench wan``'s models, 40 steps from eight seeds each: vgg16's score was higher at three times the rate in every
seed, gpt's lower in every seed; docs/benchmarks/wan.md.)
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["EstimatePilot", "Pilot", "pilot_estimate"]

Batch = Callable[[torch.Tensor], tuple[Any, torch.Tensor]]  # training samples' indices -> inputs, targets
Optimizer = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]  # parameters, rate -> the optimizer


@dataclass(frozen=True, kw_only=True)
class EstimatePilot:
    """The pilot's outcome: each rate's score (mean held-out loss; ``inf`` where it stopped being finite) and the
    choice, ``estimate``: on where the share learned faster at the scaled rate."""

    rate: float
    scaled_rate: float  # D times rate: the estimate's step on what is held back
    score: float
    scaled_score: float
    steps: int
    share: int  # samples a step, a site's share of the batch
    seconds: float  # the longer run's (two workers run one each, side by side)
    estimate: bool

    def describe(self) -> str:
        """One line for the run's notes."""
        verdict = "on" if self.estimate else "off"
        return (
            f"--wan-estimate auto: {verdict} (a share of {self.share} samples, {self.steps} steps: held-out loss "
            f"{self.scaled_score:.3f} at {self.scaled_rate:g} against {self.score:.3f} at {self.rate:g}; "
            f"{self.seconds:.1f} s)"
        )


@dataclass(frozen=True, kw_only=True)
class Pilot:
    """The pilot of ``model`` (left untouched: each run trains a copy on ``device``): ``steps`` steps of ``share``
    samples of the ``samples`` training samples, of which a quarter, at most 256, chosen from ``seed``, is held out
    of the steps and scores them. ``batch`` gives the inputs and targets of samples by index, ``optimizer`` one at a
    rate; the runs are in full precision, whatever the job's autocast."""

    model: nn.Module
    batch: Batch
    samples: int
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: Optimizer
    sites: int
    share: int
    seed: int
    device: torch.device
    steps: int = 40

    def __post_init__(self) -> None:
        if self.held_out < 1 or self.samples - self.held_out < self.share:
            raise ValueError(
                f"the pilot needs a held-out sample and a share of {self.share} to train on, got {self.samples}"
            )

    @property
    def held_out(self) -> int:
        """Training samples held out of the steps to score them."""
        return min(256, self.samples // 4)

    def score(self, rate: float) -> float:
        """The mean held-out loss at each quarter of the steps at ``rate`` (``inf`` where it is not finite)."""
        order = torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed))
        held, pool = order[: self.held_out], order[self.held_out :]
        trained = copy.deepcopy(self.model).to(self.device)
        opt = self.optimizer(trained.parameters(), rate)
        losses: list[float] = []
        quarter = max(1, self.steps // 4)
        for step in range(1, self.steps + 1):
            x, y = self.batch(pool[((step - 1) * self.share + torch.arange(self.share)) % len(pool)])
            opt.zero_grad(set_to_none=True)
            self.loss_fn(trained(x), y).backward()
            opt.step()
            if step % quarter == 0 and len(losses) < 4:
                losses.append(_held_loss(trained, self.batch, held, self.loss_fn, self.share))
        mean = sum(losses) / len(losses)
        return mean if math.isfinite(mean) else math.inf

    def outcome(self, rate: float, score: float, scaled_score: float, seconds: float) -> EstimatePilot:
        """The choice from the scores at ``rate`` and at ``sites`` times it."""
        return EstimatePilot(
            rate=rate,
            scaled_rate=self.sites * rate,
            score=score,
            scaled_score=scaled_score,
            steps=self.steps,
            share=self.share,
            seconds=seconds,
            estimate=scaled_score < score,
        )


def pilot_estimate(pilot: Pilot, rate: float) -> EstimatePilot:
    """Both runs of ``pilot`` one after the other, at ``rate`` and at ``sites`` times it (see the module docstring;
    a job runs them on two workers at once)."""
    start = time.perf_counter()
    score, scaled = pilot.score(rate), pilot.score(pilot.sites * rate)
    return pilot.outcome(rate, score, scaled, time.perf_counter() - start)


def _held_loss(
    model: nn.Module, batch: Batch, held: torch.Tensor, loss_fn: Callable[[Any, Any], torch.Tensor], share: int
) -> float:
    """The mean loss over the held-out samples, a share's worth at a time, in evaluation mode."""
    model.eval()
    with torch.no_grad():
        parts = [loss_fn(model(x), y).double() * len(part) for part in held.split(share) for x, y in [batch(part)]]
    model.train()
    return float(torch.stack(parts).sum()) / len(held)  # one read off the device
