"""DiLoCo between sites: ``H`` local steps, then one outer step on the sites' averaged change.

Every site starts a round from the same weights ``theta`` (the anchor) and takes ``H`` steps of its own
optimizer on its own mean gradient (its replicas all-reduce inside the site; nothing crosses the WAN). Then the
leaders average the sites' changes, the outer gradient

    Delta = (1/D) sum_d (theta - theta_d)

(one dense all-reduce over the WAN every ``H`` updates), and every site applies the outer optimizer, SGD with
Nesterov momentum ``mu`` and rate ``eta_o`` (DiLoCo's: ``mu = 0.9``, ``eta_o = 0.7``):

    m <- mu m + Delta,    theta <- theta - eta_o (Delta + mu m),    theta_d <- theta

With ``H = 1``, ``mu = 0`` and ``eta_o = 1``, ``theta`` becomes the mean of the sites' stepped weights, which for
plain SGD inside the sites is synchronous data parallelism (``theta - eta mean_d g_d``, sites of equal
samples). A site reads the others' updates up to ``H - 1`` updates late.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from conveyor.gaia._exchange import broadcast_dense, mean_over_sites
from conveyor.runtime.parts import SiteLinks

__all__ = ["DiLoCo"]


class DiLoCo:
    """Local steps and an outer Nesterov step between sites (see the module docstring).

    Args:
        sites: how many sites the workers sit in (ranks handed out site by site).
        local_steps: ``H``, updates between outer steps (at least 1).
        outer_lr: ``eta_o``.
        outer_momentum: ``mu`` (Nesterov when above 0).
    """

    site_mean = True

    def __init__(
        self, sites: int, *, local_steps: int = 16, outer_lr: float = 0.7, outer_momentum: float = 0.9
    ) -> None:
        if local_steps < 1 or not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(
                f"local_steps must be at least 1, outer_lr above 0 and outer_momentum in [0, 1); got {local_steps}, "
                f"{outer_lr} and {outer_momentum}"
            )
        self.sites, self.local_steps = sites, local_steps
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.links: SiteLinks | None = None
        self.anchor: torch.Tensor | None = None
        self.outer: torch.optim.Optimizer | None = None
        self.updates = 0
        self._counts = {"updates": 0, "rounds": 0, "payload_bytes": 0}

    def attach(self, params: Sequence[torch.Tensor], links: SiteLinks) -> None:
        self.links = links
        self.anchor = parameters_to_vector(params).detach().float()
        momentum = self.outer_momentum
        self.outer = torch.optim.SGD([self.anchor], lr=self.outer_lr, momentum=momentum, nesterov=momentum > 0)

    def after_reduce(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> bool:
        """DiLoCo sends nothing per update: each site steps on its own mean gradient."""
        return False

    def after_step(self, params: Sequence[torch.Tensor]) -> None:
        assert self.links is not None and self.anchor is not None and self.outer is not None
        self.updates += 1
        self._counts["updates"] += 1
        if self.updates % self.local_steps:
            return
        with torch.no_grad():
            delta = self.anchor - parameters_to_vector(params).float()
            if self.links.is_leader:
                self._counts["payload_bytes"] += mean_over_sites(self.links, delta)
            broadcast_dense(self.links, delta)
            self.anchor.grad = delta
            self.outer.step()
            self.anchor.grad = None
            for p, part in zip(params, self.anchor.split([p.numel() for p in params]), strict=True):
                p.copy_(part.view_as(p))
        self._counts["rounds"] += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The round's anchor, the outer momentum and the updates counted (the same on every replica of a site)."""
        assert self.anchor is not None and self.outer is not None
        state = {"anchor": self.anchor.detach().cpu(), "updates": torch.tensor(self.updates)}
        momentum = self.outer.state.get(self.anchor, {}).get("momentum_buffer")
        return state if momentum is None else {**state, "momentum": momentum.cpu()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        assert self.anchor is not None and self.outer is not None
        with torch.no_grad():
            self.anchor.copy_(state["anchor"])
        self.updates = int(state["updates"])
        if "momentum" in state:
            self.outer.state[self.anchor]["momentum_buffer"] = state["momentum"].to(self.anchor.device)

    def records(self) -> dict[str, Any]:
        assert self.links is not None
        out: dict[str, Any] = {"site": self.links.site, **self._counts}
        out["staleness_mean"], out["staleness_max"] = (self.local_steps - 1) / 2, self.local_steps - 1
        self._counts = {"updates": 0, "rounds": 0, "payload_bytes": 0}
        return out
