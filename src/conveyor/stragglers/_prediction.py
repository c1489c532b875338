"""Weight prediction for slack: a step's gradient is taken at ``W~(t) = W(t) + s (W(t) - W(t - 1))``, as it
is applied ``s`` updates late (the equations and when they apply: :mod:`conveyor.stragglers._trainer`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["WeightPrediction"]


class WeightPrediction:
    """The prediction of ``params`` ``slack`` updates ahead, from the last update's change."""

    def __init__(self, params: Sequence[torch.Tensor], slack: int) -> None:
        self.params, self.slack = list(params), slack
        self._previous: list[torch.Tensor] | None = None  # W(t - 1)

    def restart(self) -> None:
        """A run begins: nothing to extrapolate until its first update (its first gradients are fresh)."""
        self._previous = None

    def before_update(self) -> None:
        """The optimizer is about to step: the weights now are ``W(t - 1)`` of the next prediction."""
        self._previous = [p.detach().clone() for p in self.params]

    @contextlib.contextmanager
    def predicted(self) -> Iterator[None]:
        """Within: the parameters are ``W~(t)``; afterwards ``W(t)`` again (their gradients kept)."""
        master = [p.detach().clone() for p in self.params]
        if self._previous is not None:
            with torch.no_grad():
                for p, prev in zip(self.params, self._previous, strict=True):
                    p.add_(p - prev, alpha=self.slack)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, master, strict=True):
                    p.copy_(w)
