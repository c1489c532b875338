"""A site's own gradient as its estimate of what the other sites still hold back (``--wan-estimate``).

Gaia's sites step at once on their own share ``g_d`` of the batch's gradient and on the others' shares only once
significant, so whatever the others hold back is missing from every site's steps until it is sent. With the
estimate, site ``d`` stands its own share in for each other site's, at once, and replaces that stand-in by what
the other site actually sent when it arrives. Site ``d`` keeps the sum of its own shares,

    S_d(t) = sum over t' <= t of g_d(t'),

and, per other site ``e`` and entry ``i``, its value when ``e`` last sent ``i``, ``B_d,e,i`` (0 before). It steps with

    G_d(t) = D g_d(t) + sum over e != d, over the entries i that e's taken exchanges carry, of u_e,i - (S_d,i - B_d,e,i)

and sets ``B_d,e,i <- S_d,i`` for those entries. Summed over the updates, every entry has received site ``d``'s own
shares, everything the others sent of it, and, for each other site, site ``d``'s own shares since that site
last sent the entry: the stand-in for what it holds. With every entry significant at every update the stand-ins
are replaced at once and ``G_d(t) = g(t)``. On what the others hold back a site steps at ``D`` times the rate on
a ``1/D`` share of the batch: in ``conveyor bench wan`` gpt gains from that and VGG-16 does not, and
``--wan-estimate auto`` tries which before training (:mod:`conveyor.gaia._pilot`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conveyor.gaia._filter import add_grads

__all__ = ["OwnShares"]


class OwnShares:
    """``S_d`` and ``B_d,e`` of one replica of site ``d`` (see the module docstring).

    Args:
        n: the entries (the stage's weights, all its parameters flattened in order).
        others: the other sites' indices.
        device: where the sums live (the replica's device).
    """

    def __init__(self, n: int, others: Sequence[int], *, device: torch.device) -> None:
        self.total = torch.zeros(n, dtype=torch.float32, device=device)
        self.at_last_receipt = {e: torch.zeros(n, dtype=torch.float32, device=device) for e in others}

    def add(self, params: Sequence[torch.Tensor]) -> None:
        """``S_d <- S_d + g_d``."""
        add_grads(self.total, params)

    def estimated(self, site: int, indices: torch.Tensor) -> torch.Tensor:
        """What this site has stood in for ``site``'s shares of ``indices`` since it last sent them,
        ``S_d - B_d,e`` there; they are replaced now (``B_d,e <- S_d`` there).

        Example:
            >>> own = OwnShares(3, [1], device=torch.device("cpu"))
            >>> own.total += torch.tensor([1.0, 2.0, 3.0])
            >>> own.estimated(1, torch.tensor([0, 2])).tolist(), own.estimated(1, torch.tensor([2])).tolist()
            ([1.0, 3.0], [0.0])
        """
        now = self.total[indices]
        stood_in = now - self.at_last_receipt[site][indices]
        self.at_last_receipt[site][indices] = now
        return stood_in

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"own_total": self.total.cpu(), **{f"own_at_{e}": b.cpu() for e, b in self.at_last_receipt.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.total.copy_(state["own_total"])
        for e, b in self.at_last_receipt.items():
            b.copy_(state[f"own_at_{e}"])
