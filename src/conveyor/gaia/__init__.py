"""Gaia: training across sites (data centres) joined by a slow WAN, synchronous inside each site.

:class:`Gaia` sends only significant updates between sites (Approximate Synchronous Parallel: the significance
filter, the selective barrier, the mirror clock's staleness bound; the filter alone is :class:`SignificanceFilter`);
:class:`DiLoCo` takes local steps and an
outer Nesterov step on the sites' averaged change. Either is the ``outer`` of a
:class:`~conveyor.runtime.Pipeline`; :func:`outer_sync` makes one from ``--wan``'s mode;
:func:`pilot_estimate` decides ``--wan-estimate auto``.
"""

from conveyor.gaia._asp import Gaia
from conveyor.gaia._diloco import DiLoCo
from conveyor.gaia._filter import SignificanceFilter
from conveyor.gaia._modes import outer_sync
from conveyor.gaia._pilot import EstimatePilot, Pilot, pilot_estimate
from conveyor.gaia._sparse import decode, encode

__all__ = [
    "DiLoCo",
    "EstimatePilot",
    "Gaia",
    "Pilot",
    "SignificanceFilter",
    "decode",
    "encode",
    "outer_sync",
    "pilot_estimate",
]
