"""Spot markets for BidBrain: list prices per trace, availability from ``../shared/spot-traces``, and billing rules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from conveyor.emulate import replay_trace
from conveyor.errors import InputError

__all__ = ["BILLINGS", "PRICES", "Billing", "Market", "MarketPrice", "read_markets"]


@dataclass(frozen=True)
class MarketPrice:
    """What a trace's machine costs and how fast it trains.

    Attributes:
        instance: the machine type and where it was offered.
        on_demand: on-demand list price, US dollars per machine-hour.
        spot: spot (AWS) or preemptible (Google Cloud) price, US dollars per machine-hour.
        speed: training throughput relative to one V100 (the unit the throughput model counts workers in).
        source: where the prices come from, and which ones are approximate.
    """

    instance: str
    on_demand: float
    spot: float
    speed: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        if not (self.on_demand >= 0 and self.spot >= 0):
            raise InputError(f"{self.instance}: prices must be >= 0, got {self.on_demand} and {self.spot} $/h")
        if not self.speed > 0:
            raise InputError(f"{self.instance}: speed must be > 0, got {self.speed}")


# Prices per trace file (its name without the suffix). Sources, and how sure each figure is:
# - p3.2xlarge on-demand $3.06/h in us-east-1 (Linux): the AWS EC2 on-demand price list,
#   https://aws.amazon.com/ec2/pricing/on-demand/ , unchanged since p3's launch in 2017 (confirmed in a second
#   public price table, onDemandPrice 3.06).
# - p3.2xlarge spot $0.918/h: the AWS spot price page's us-east-1 figure, https://aws.amazon.com/ec2/spot/pricing/ ,
#   as transcribed in a public snapshot of that page (undated). APPROXIMATE: spot prices move; the trace's own
#   period (Bamboo, 2022) is not pinned to this figure.
# - g4dn.xlarge on-demand $0.526/h in us-east-1: https://aws.amazon.com/ec2/pricing/on-demand/ (from memory of
#   the list, not re-confirmed in this session: treat as APPROXIMATE until checked).
# - g4dn.xlarge spot $0.1578/h: same undated snapshot of https://aws.amazon.com/ec2/spot/pricing/ . APPROXIMATE.
# - a2-highgpu-1g (1x A100 40GB, 12 vCPU) on Google Cloud: on-demand $3.673/h (us-central1 list,
#   https://cloud.google.com/compute/all-pricing#a2_machine_types ; us-east1 assumed equal; from memory, NOT
#   confirmed), preemptible $1.10/h (a public note quoting that page: "a2-highgpu-1g A100 / 40G as spot VM :
#   1.10$USD/h", undated; APPROXIMATE for Dec 2021, when preemptible prices were still fixed).
# - n1-standard-8 + 1x V100 on Google Cloud: V100 GPU $2.48/h on-demand and $0.74/h preemptible
#   (https://cloud.google.com/compute/gpus-pricing , from memory of the 2019-2021 list, NOT confirmed) plus
#   n1-standard-8 $0.38/h on-demand and $0.08/h preemptible (us-central1 list, matched by a public table:
#   price 0.3800, preemptiblePrice 0.0800). APPROXIMATE as a whole.
# - Speeds (training throughput relative to a V100, ResNet-50 class models): T4 0.3 and A100 2.0, rounded from
#   NVIDIA's published training-throughput tables; APPROXIMATE, one significant figure on purpose.
PRICES: dict[str, MarketPrice] = {
    "p3-trace": MarketPrice(
        "p3.2xlarge (1x V100), AWS us-east-1",
        3.06,
        0.918,
        1.0,
        "AWS on-demand list (confirmed); spot from an undated snapshot (approximate)",
    ),
    "g4dn-trace": MarketPrice(
        "g4dn.xlarge (1x T4), AWS us-east-1",
        0.526,
        0.1578,
        0.3,
        "AWS on-demand list and undated spot snapshot (approximate); speed approximate",
    ),
    "a100x1-east1b": MarketPrice(
        "a2-highgpu-1g (1x A100), GCP us-east1-b",
        3.673,
        1.10,
        2.0,
        "GCP list, Dec 2021 (approximate, not confirmed); speed approximate",
    ),
    "v100x1-east1c": MarketPrice(
        "n1-standard-8 + 1x V100, GCP us-east1-c",
        2.86,
        0.82,
        1.0,
        "GCP GPU + n1 list, Dec 2021 (approximate, not confirmed)",
    ),
}


@dataclass(frozen=True)
class Billing:
    """How a provider charges one machine held from ``start`` to ``end`` seconds at ``price`` dollars an hour.

    ``per-second`` (AWS and Google Cloud today), with ``d = end - start``:
        ``cost = price / 3600 * max(d, 60)``  (a minimum of 60 s per machine start).

    ``hourly-2016`` (AWS spot until late 2017): every started hour is charged in full, except the partial hour
    that a provider revocation ends, which is free:
        ``cost = price * ceil(d / 3600)`` (at least one hour) when the user releases the machine,
        ``cost = price * floor(d / 3600)`` when the provider revokes it.

    Example:
        >>> Billing("per-second").charge(3.6, 0.0, 30.0)  # the 60 s minimum
        0.06
        >>> hourly = Billing("hourly-2016")
        >>> hourly.charge(1.0, 0.0, 5400.0), hourly.charge(1.0, 0.0, 5400.0, revoked=True)
        (2.0, 1.0)
    """

    name: str = "per-second"

    def __post_init__(self) -> None:
        if self.name not in BILLINGS:
            raise InputError(f"unknown billing {self.name!r}: choose from {', '.join(BILLINGS)}")

    @property
    def hourly(self) -> bool:
        return self.name == "hourly-2016"

    def charge(self, price: float, start: float, end: float, revoked: bool = False) -> float:
        """Dollars for one machine held over ``[start, end]`` seconds (see the class docstring)."""
        if price < 0 or end < start:
            raise InputError(f"a charge needs a price >= 0 and end >= start, got {price} $/h over [{start}, {end}]")
        d = end - start
        if not self.hourly:
            return price / 3600.0 * max(d, 60.0)
        hours = d / 3600.0
        return price * (math.floor(hours + 1e-9) if revoked else max(1, math.ceil(hours - 1e-9)))

    def paid_until(self, start: float, now: float) -> float:
        """The time the machine started at ``start`` is paid up to if released at ``now``: ``now`` per second,
        the end of the current billed hour hourly.

        Example:
            >>> Billing("hourly-2016").paid_until(100.0, 200.0)
            3700.0
        """
        if not self.hourly:
            return max(now, start + 60.0)
        return start + 3600.0 * max(1, math.ceil((now - start) / 3600.0 - 1e-9))


BILLINGS = ("per-second", "hourly-2016")


@dataclass(frozen=True)
class Market:
    """One spot market: a machine type's prices and its availability trace.

    Attributes:
        name: the trace's name (its file name without the suffix).
        price: the market's :class:`MarketPrice`.
        events: ``(seconds, "add"|"remove", slot)`` from :func:`conveyor.emulate.replay_trace`.

    Example:
        >>> m = Market("toy", MarketPrice("toy", 2.0, 0.5), ((0.0, "add", 0), (0.0, "add", 1), (60.0, "remove", 1)))
        >>> m.peak, m.counts()
        (2, [(0.0, 2), (60.0, 1)])
    """

    name: str
    price: MarketPrice
    events: tuple[tuple[float, str, int], ...]

    @classmethod
    def from_trace(cls, path: str | Path, price: MarketPrice | None = None) -> Market:
        """Read a trace file; its prices come from :data:`PRICES` (by file name) unless given.

        Raises:
            ValueError: the file does not exist, does not parse, or has no prices.
        """
        path = Path(path)
        if not path.is_file():
            raise InputError(f"trace {path} does not exist (see ../shared/spot-traces/README.md)")
        name = path.name.split(".")[0]
        if price is None and name not in PRICES:
            raise InputError(f"no prices for trace {path.name}: known traces are {', '.join(PRICES)}")
        events = tuple(replay_trace(path))
        if not any(op == "add" for _, op, _ in events):
            raise InputError(f"trace {path.name} never adds a machine")
        return cls(name, price or PRICES[name], events)

    @property
    def peak(self) -> int:
        """The most machines live at once in the trace."""
        return max(n for _, n in self.counts())

    @property
    def duration(self) -> float:
        """Seconds from the trace's first event to its last."""
        return self.events[-1][0] if self.events else 0.0

    def counts(self) -> list[tuple[float, int]]:
        """The live machine count after each distinct event time, in time order."""
        out: list[tuple[float, int]] = []
        live = 0
        for t, op, _ in self.events:
            live += 1 if op == "add" else -1
            if out and out[-1][0] == t:
                out[-1] = (t, live)
            else:
                out.append((t, live))
        return out


def read_markets(paths: list[str | Path]) -> list[Market]:
    """One :class:`Market` per trace file; each name once.

    Example:
        >>> read_markets(["no-such-trace.csv"])
        Traceback (most recent call last):
        ...
        conveyor.errors.InputError: trace no-such-trace.csv does not exist (see ../shared/spot-traces/README.md)
    """
    markets = [Market.from_trace(p) for p in paths]
    names = [m.name for m in markets]
    if len(set(names)) != len(names):
        raise InputError(f"a trace is given twice: {names}")
    if not markets:
        raise InputError("give at least one trace")
    return markets
