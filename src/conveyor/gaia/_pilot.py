"""Whether a site's own share should stand in for what the others hold back (``--wan-estimate auto``).

With the estimate (:mod:`conveyor.gaia._estimate`) a site of ``D`` steps its optimizer with ``D g_d`` on every entry
the others still hold back, where plain Gaia steps with ``g_d``: its share of the batch (``B / D`` samples) times
``D``. For SGD that is a rate ``D`` times higher on ``B / D`` samples; for Adam, whose steps do not follow a
gradient's scale, much less. So the pilot tries what the estimate asks of the model before training: two short runs
from the job's first weights with the job's optimizer, on batches of a share's size, the same batches in the same
order, one stepping on each batch's gradient ``g`` and one on ``D g``; each is scored by the mean loss on held-out
training samples after every ``q = floor(K / 4)`` of its ``K`` steps,

    score(c) = (1/4) sum over k in 1..4 of L_held(w_c(k q)),

where ``w_c(s)`` are the weights after ``s`` steps on ``c g``. ``L_held`` is taken with dropout off and batch
normalisation on each held-out chunk's own statistics (its running averages lag weights that move fast, which
would count against the faster run). The estimate is on when ``score(D) < score(1)``: the model learns faster on a
share stepped the way the estimate steps it. (Measured on ``conveyor bench wan``'s models, 40 steps from eight
seeds each: vgg16's score was higher at ``D = 3`` in every seed, gpt's lower in every seed; docs/benchmarks/wan.md.)
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
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@dataclass(frozen=True, kw_only=True)
class EstimatePilot:
    """The pilot's outcome: each run's score (mean held-out loss; ``inf`` where it stopped being finite) and the
    choice, ``estimate``: on where the share learned faster stepped on ``sites`` times its gradient."""

    sites: int  # D: the estimate steps on D times a site's share
    score: float  # stepping on the share's gradient, as plain Gaia does on what is held back
    scaled_score: float  # stepping on D times it, as the estimate does
    steps: int
    share: int  # samples a step, a site's share of the batch
    seconds: float  # the longer run's (two workers run one each, side by side)
    estimate: bool

    def describe(self) -> str:
        """One line for the run's notes."""
        verdict = "on" if self.estimate else "off"
        return (
            f"--wan-estimate auto: {verdict} (a share of {self.share} samples, {self.steps} steps: held-out loss "
            f"{self.scaled_score:.3f} stepping on {self.sites} times its gradient against {self.score:.3f} on it; "
            f"{self.seconds:.1f} s)"
        )


@dataclass(frozen=True, kw_only=True)
class Pilot:
    """The pilot of ``model`` (left untouched: each run trains a copy on ``device`` with ``optimizer``, the job's):
    ``steps`` steps of ``share`` samples of the ``samples`` training samples, of which a quarter, at most 256,
    chosen from ``seed``, is held out of the steps and scores them. ``batch`` gives the inputs and targets of
    samples by index. The runs are in full precision, whatever the job's autocast, and draw their dropout masks
    from ``seed`` (the same in both runs), leaving the caller's random state as it was."""

    model: nn.Module
    batch: Batch
    samples: int
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
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

    def score(self, scale: float) -> float:
        """The mean held-out loss after each quarter of the steps, each on ``scale`` times the share's gradient
        (``inf`` where it is not finite)."""
        order = torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed))
        held, pool = order[: self.held_out], order[self.held_out :]
        trained = copy.deepcopy(self.model).to(self.device)
        opt = self.optimizer(trained.parameters())
        losses: list[float] = []
        quarter = max(1, self.steps // 4)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.seed)
            for step in range(1, self.steps + 1):
                x, y = self.batch(pool[((step - 1) * self.share + torch.arange(self.share)) % len(pool)])
                opt.zero_grad(set_to_none=True)
                self.loss_fn(trained(x), y).backward()
                if grads := [p.grad for p in trained.parameters() if p.grad is not None]:
                    torch._foreach_mul_(grads, float(scale))  # as Gaia's estimate scales a site's share
                opt.step()
                if step % quarter == 0 and len(losses) < 4:
                    losses.append(_held_loss(trained, self.batch, held, self.loss_fn, self.share))
        mean = sum(losses) / len(losses)
        return mean if math.isfinite(mean) else math.inf

    def outcome(self, score: float, scaled_score: float, seconds: float) -> EstimatePilot:
        """The choice from the scores on the share's gradient and on ``sites`` times it."""
        return EstimatePilot(
            sites=self.sites,
            score=score,
            scaled_score=scaled_score,
            steps=self.steps,
            share=self.share,
            seconds=seconds,
            estimate=scaled_score < score,
        )


def pilot_estimate(pilot: Pilot) -> EstimatePilot:
    """Both runs of ``pilot`` one after the other, on the share's gradient and on ``sites`` times it (see the module
    docstring; a job runs them on two workers at once)."""
    start = time.perf_counter()
    score, scaled = pilot.score(1.0), pilot.score(pilot.sites)
    return pilot.outcome(score, scaled, time.perf_counter() - start)


def _held_loss(
    model: nn.Module, batch: Batch, held: torch.Tensor, loss_fn: Callable[[Any, Any], torch.Tensor], share: int
) -> float:
    """The mean loss over the held-out samples, a share's worth or more at a time: dropout off, batch normalisation on
    each chunk's statistics (in training mode: the copy's running averages, which it no longer reads, move)."""
    model.eval()
    for norm in (m for m in model.modules() if isinstance(m, BATCH_NORMS)):
        norm.train()
    with torch.no_grad():
        chunks = held.tensor_split(max(1, len(held) // share))  # a share or more each: no batch of one sample
        parts = [loss_fn(model(x), y).double() * len(part) for part in chunks for x, y in [batch(part)]]
    model.train()
    return float(torch.stack(parts).sum()) / len(held)  # one read off the device
