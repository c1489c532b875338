"""The buffer of a step, or of a committed chunk's run: one flat tensor, the one its replicas reduce.

Its layout is ``[BatchNorm terms (S), gradient sums (G), loss sum, samples, extra (E)]``: ``S`` the length of a
chunk's BatchNorm term (0 without BatchNorm), ``G`` the stage's parameters' elements, and the extra each
replica's rate in its own slot (an all-reduce with weighted shares, ``E`` = replicas), a chunk's run seconds
(live reduction, ``E`` = 1), or nothing. One tensor, so one all-reduce (or one message per chunk) carries it all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conveyor.runtime.parts import pack_grads

__all__ = ["BufferLayout", "StepBuffer"]


@dataclass(frozen=True)
class StepBuffer:
    """A buffer's parts, each a view of it."""

    terms: torch.Tensor  # (S,)
    grads: torch.Tensor  # (G,): as pack_grads lays the parameters' gradients out
    loss: torch.Tensor  # 0-d
    samples: torch.Tensor  # 0-d
    extra: torch.Tensor  # (E,)


@dataclass(frozen=True)
class BufferLayout:
    """Where the parts of a stage's buffers sit: ``terms`` (S) and ``grads`` (G) elements, then the rest.

    Example:
        >>> w = torch.zeros(2, requires_grad=True)
        >>> w.grad = torch.tensor([2.0, 4.0])
        >>> layout = BufferLayout(terms=1, grads=2)
        >>> flat = layout.pack([w], terms=torch.tensor([7.0]), loss=3.0, samples=2, extra=[0.5])
        >>> flat
        tensor([7.0000, 2.0000, 4.0000, 3.0000, 2.0000, 0.5000])
        >>> parts = layout.read(flat)
        >>> parts.grads, parts.loss.item(), parts.samples.item(), parts.extra
        (tensor([2., 4.]), 3.0, 2.0, tensor([0.5000]))
    """

    terms: int
    grads: int

    def pack(
        self,
        params: Sequence[torch.Tensor],
        *,
        terms: torch.Tensor | None,
        loss: float | torch.Tensor,
        samples: float,
        extra: Sequence[float | torch.Tensor],
    ) -> torch.Tensor:
        """The buffer of ``params``' gradients, their BatchNorm ``terms`` (``None``: none) and these sums, on the
        loss's device and in its dtype (a float loss: the parameters')."""
        like = loss if isinstance(loss, torch.Tensor) else params[0]
        flat = pack_grads(params, like.dtype, like.device, [loss, float(samples), *extra])
        assert (terms.numel() if terms is not None else 0) == self.terms and flat.numel() - 2 - len(extra) == self.grads
        return flat if terms is None else torch.cat([terms, flat])

    def empty(self, extra: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer to receive into, with ``extra`` extra elements."""
        return torch.empty(self.terms + self.grads + 2 + extra, dtype=dtype, device=device)

    def read(self, flat: torch.Tensor) -> StepBuffer:
        """The parts of ``flat``."""
        s, g = self.terms, self.terms + self.grads
        return StepBuffer(terms=flat[:s], grads=flat[s:g], loss=flat[g], samples=flat[g + 1], extra=flat[g + 2 :])
