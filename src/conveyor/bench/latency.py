"""Stages that take a fixed wall time, for benchmarks that measure schedules and the runtime, not compute.

A stage's forward and backward sleep, so their cost is the same whatever the core count, and what a
benchmark measures is bubbles, transfers and Python overhead.
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Any

import torch
from torch import nn

__all__ = ["FixedLatencyStage", "mse", "set_timer_slack_1us"]


class _FixedLatency(torch.autograd.Function):
    """y = x * w, whose forward takes ``forward_s`` and backward ``backward_s`` of wall time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.save_for_backward(x, w)
        ctx.backward_s = backward_s
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        time.sleep(ctx.backward_s)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum().reshape(w.shape), None, None


class FixedLatencyStage(nn.Module):
    """A stage with one weight whose forward and backward take a fixed wall time (a sleep)."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _FixedLatency.apply(x, self.weight, self.forward_s, self.backward_s)  # type: ignore[no-untyped-call]
        return out


def set_timer_slack_1us() -> None:
    """Shrink the timer slack Linux adds to every sleep of this process from 50 us to 1 us."""
    if sys.platform.startswith("linux"):
        pr_set_timerslack = 29
        ctypes.CDLL(None).prctl(pr_set_timerslack, 1000)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()
