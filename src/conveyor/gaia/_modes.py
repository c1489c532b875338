"""``--wan``'s modes: what crosses the WAN between sites."""

from __future__ import annotations

from conveyor.config import WAN_MODES
from conveyor.gaia._asp import Gaia
from conveyor.gaia._diloco import DiLoCo
from conveyor.runtime import OuterSync

__all__ = ["outer_sync"]


def outer_sync(
    mode: str,
    *,
    sites: int,
    threshold: float,
    staleness: int,
    period: int,
    local_steps: int,
    outer_lr: float,
    estimate: bool = False,
) -> OuterSync | None:
    """The outer sync of ``mode`` between ``sites`` sites (``None`` for ``off``: one all-reduce over every replica,
    across the WAN, as synchronous data parallelism does).

    Example:
        >>> kw = {"threshold": 0.05, "staleness": 1, "period": 1, "local_steps": 16, "outer_lr": 0.7}
        >>> type(outer_sync("gaia", sites=3, **kw)).__name__
        'Gaia'
    """
    if mode == "gaia":
        return Gaia(sites, threshold=threshold, staleness=staleness, period=period, estimate=estimate)
    if mode == "diloco":
        return DiLoCo(sites, local_steps=local_steps, outer_lr=outer_lr)
    if mode == "off":
        return None
    raise ValueError(f"--wan {mode!r}: use one of {', '.join(WAN_MODES)}")
