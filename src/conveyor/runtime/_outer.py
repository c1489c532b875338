"""Replicas of a stage in several sites (data centres) joined by a slow outer link (a WAN).

Inside a site, a stage's replicas all-reduce their gradients as usual (:mod:`conveyor.runtime._update`); across
sites an :class:`OuterSync` decides what travels and when (:mod:`conveyor.gaia`: Gaia's significance filter,
DiLoCo's outer steps). Ranks are handed out site by site, as the topology hands them out: with ``world`` workers
in ``sites`` sites, worker ``r`` sits in site ``r // (world // sites)``.

The hooks run where the updater is: :meth:`OuterSync.after_reduce` once the site's gradient is on ``.grad``
(before clipping and the optimizer's step), :meth:`OuterSync.after_step` after the step; every replica of the
stage calls both at every update, in the same order, so collectives over the sites line up.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["OuterSync", "SiteLinks", "gather_records", "site_links", "site_parts"]


@dataclass(frozen=True, kw_only=True)
class SiteLinks:
    """What one replica of a stage reaches: its site's replicas over the LAN and the sites' leaders over the WAN.

    ``site`` is the site's number among all (the topology's), ``index`` its place among the ``sites`` the stage
    spans; ``local`` is the process group of the site's replicas (``None`` when the site holds one);
    ``local_ranks`` their global ranks, the first the site's leader, which alone talks over the WAN; ``wan`` the
    gloo group of every site's leader (``None`` on the others); ``leaders`` their global ranks, site by site.
    """

    site: int
    index: int
    sites: int
    local: dist.ProcessGroup | None
    local_ranks: list[int]
    wan: dist.ProcessGroup | None
    leaders: list[int]
    device: torch.device

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.local_ranks[0]

    def state_path(self, path: str | os.PathLike[str], stage: int) -> str:
        """Where the site's leader keeps its outer sync's state beside checkpoint ``path``: ``PATH.stageS.siteD``
        (on its own machine)."""
        return f"{os.fspath(path)}.stage{stage}.site{self.site}"


class OuterSync(Protocol):
    """How the sites holding replicas of a stage keep them in step (see the module docstring)."""

    sites: int
    site_mean: bool  # after_reduce wants the site's mean gradient (else its share of the whole batch's mean)

    def attach(self, params: Sequence[torch.Tensor], links: SiteLinks) -> None:
        """Called once, with the stage's parameters and this replica's links, before the first update."""

    def after_reduce(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> bool:
        """The site's gradient is on ``.grad``: replace it with what this site steps with; whether it is an update."""

    def after_step(self, params: Sequence[torch.Tensor]) -> None:
        """The optimizer has stepped (or not, without samples): the weights may be replaced."""

    def records(self) -> dict[str, Any]:
        """This replica's counts since the last call (what travelled over the WAN, how stale), then reset."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this site's replica (what is still to send, an outer optimizer's state)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take back :meth:`state_dict`'s."""


def site_parts(workers: Sequence[int], world: int, sites: int) -> list[list[int]]:
    """``workers`` (global ranks, ascending) grouped by site, the empty sites left out.

    Example:
        >>> site_parts([0, 1, 2, 3, 4, 5], 6, 3)
        [[0, 1], [2, 3], [4, 5]]
        >>> site_parts([0, 1, 2], 4, 2)
        [[0, 1], [2]]
    """
    per_site = world // sites
    parts: dict[int, list[int]] = {}
    for w in workers:
        parts.setdefault(w // per_site, []).append(w)
    return [parts[s] for s in sorted(parts)]


def site_links(
    stage_workers: Sequence[Sequence[int]], stage: int, sites: int, device: torch.device
) -> tuple[dist.ProcessGroup | None, SiteLinks | None]:
    """Every stage's replicas grouped by site: each site's group, and the sites' leaders' (gloo), made by every
    worker in the same order. Returns this worker's site group (its replicas' all-reduce) and, where its stage
    spans sites, its links."""
    world, me = dist.get_world_size(), dist.get_rank()
    if sites < 2 or world % sites:
        raise ValueError(f"{sites} sites cannot share {world} workers equally")
    mine: tuple[dist.ProcessGroup | None, SiteLinks | None] = (None, None)
    for s, workers in enumerate(stage_workers):
        parts = site_parts(workers, world, sites)
        local = [dist.new_group(part) if len(part) > 1 else None for part in parts]
        leaders = [part[0] for part in parts]
        wan = dist.new_group(leaders, backend="gloo") if len(parts) > 1 else None
        for index, (part, group) in enumerate(zip(parts, local, strict=True)):
            if s == stage and me in part:
                links = SiteLinks(
                    site=me // (world // sites),
                    index=index,
                    sites=len(parts),
                    local=group,
                    local_ranks=part,
                    wan=wan if me == part[0] else None,
                    leaders=leaders,
                    device=device,
                )
                mine = (group, links if len(parts) > 1 else None)
    return mine


def gather_records(outer: OuterSync, site: SiteLinks | None) -> list[dict[str, Any]] | None:
    """Every site leader's ``outer.records()`` since the last call, gathered on worker 0 (``None`` elsewhere);
    ``site``: this worker's links (``None`` where its stage spans no sites). Every worker calls it."""
    mine = outer.records() if site is not None and site.is_leader else None
    worker0 = dist.get_rank() == 0
    gathered: list[Any] = [None] * dist.get_world_size() if worker0 else []
    dist.gather_object(mine, gathered if worker0 else None, dst=0)
    return [r for r in gathered if r is not None] if worker0 else None
