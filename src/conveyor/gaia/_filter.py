"""Gaia's significance filter, fused and in place: what a site's leader has not sent yet, and what it sends now.

Per update the leader adds its share of the gradient to what is pending, ``a <- a + g``, and takes out the entries
whose step would be a large enough part of the weight they move, ``{ i : eta |a_i| > tau |w_i| }``
(:mod:`conveyor.gaia._asp`). Over a model's millions of weights each update, that is a pass over every entry:
done on packed copies (the gradients and the weights each gathered into a new flat tensor, then ``|a|`` and
``|w|`` into two more, then the test's mask), every pass allocates a model-sized tensor, which on the CPU is
fresh pages from the kernel each time. The filter instead adds each parameter's gradient into its slice of ``a``
and takes ``|a|`` and ``|w|`` into two buffers it keeps, parameter by parameter, and writes the test into a mask
it keeps: no model-sized tensor is allocated per update. The arithmetic is the same, entry by entry, as on packed
copies, so what is selected is too. An entry taken out goes as the wire's dtype carries it, ``u_i = round(a_i)``
(bfloat16 in :class:`~conveyor.gaia.Gaia` by default: :mod:`conveyor.gaia._sparse`), and what rounding left out
stays pending, ``a_i <- a_i - u_i``: summed over the exchanges, everything is sent.

Example (the second entry's step, 1.0 x 0.5, is more than 10% of its weight 1.0; the first's, 0.01, is not):
    >>> w = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
    >>> w.grad = torch.tensor([0.01, 0.5])
    >>> f = SignificanceFilter(2, threshold=0.1, device=torch.device("cpu"))
    >>> f.add([w])
    >>> indices, values, ages = f.select([w], lr=1.0, now=0)
    >>> indices.tolist(), values.tolist(), ages.tolist(), f.pending.tolist()
    ([1], [0.5], [1], [0.009999999776482582, 0.0])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SignificanceFilter", "add_grads"]


def add_grads(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Add the parameters' gradients (their ``.grad``; none: zero) into their slices of ``flat`` (all of them
    flattened in order), in place: no model-sized tensor allocated."""
    first = 0
    for p in params:
        last = first + p.numel()
        if p.grad is not None:
            flat[first:last].add_(p.grad.reshape(-1))
        first = last


class SignificanceFilter:
    """A site leader's pending updates ``a`` and the significance test on them (see the module docstring).

    Args:
        n: the entries (the stage's weights, all its parameters flattened in order).
        threshold: ``tau``.
        device: where ``a`` and the filter's buffers live (the leader's device).
        wire_dtype: what the values taken out are rounded to (float32: exactly ``a``'s).

    Attributes:
        pending: ``a``, float32.
        sent_at: the update each entry was last sent at (-1: never), to count how long it waited.
    """

    def __init__(
        self, n: int, *, threshold: float, device: torch.device, wire_dtype: torch.dtype = torch.float32
    ) -> None:
        self.threshold, self.wire_dtype = threshold, wire_dtype
        self.pending = torch.zeros(n, dtype=torch.float32, device=device)
        self.sent_at = torch.full((n,), -1, dtype=torch.int32, device=device)
        self._step = torch.empty(n, dtype=torch.float32, device=device)  # eta |a|
        self._bar = torch.empty(n, dtype=torch.float32, device=device)  # tau |w|
        self._chosen = torch.empty(n, dtype=torch.bool, device=device)

    def add(self, params: Sequence[torch.Tensor]) -> None:
        """``a <- a + g``."""
        add_grads(self.pending, params)

    def select(
        self, params: Sequence[torch.Tensor], lr: float, now: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Take out ``a``'s significant entries at update ``now`` (after :meth:`add`), and return their indices,
        values (in ``wire_dtype``, the rest left pending) and ages (updates since each was last sent; an entry never
        sent counts from update -1). An entry of ``a`` that is zero is never significant (``0 > tau |w|`` fails)."""
        first = 0
        for p in params:
            last = first + p.numel()
            torch.abs(self.pending[first:last], out=self._step[first:last])
            torch.abs(p.detach().reshape(-1), out=self._bar[first:last])
            first = last
        torch.gt(self._step.mul_(lr), self._bar.mul_(self.threshold), out=self._chosen)
        indices = self._chosen.nonzero().reshape(-1)
        values = self.pending[indices]
        sent = values.to(self.wire_dtype)
        self.pending[indices] = values - sent.to(torch.float32)  # 0 unless rounded
        ages = now - self.sent_at[indices]
        self.sent_at[indices] = now
        return indices, sent, ages
