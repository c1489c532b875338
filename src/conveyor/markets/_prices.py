"""What a market's machines cost and how fast they train: list prices with their sources, Gavel's throughputs."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

from conveyor.elastic import BILLINGS, Billing
from conveyor.errors import InputError

__all__ = ["INSTANCES", "Instance", "Pricing", "gavel_speeds"]


@dataclass(frozen=True)
class Instance:
    """A machine kind of the traces: its AWS name, its GPUs and its on-demand price (US dollars an hour)."""

    kind: str
    name: str
    gpu: str
    gpus: int
    on_demand: float


# On-demand list prices, Linux, us-east-1 and us-west-2 (equal there), from the AWS EC2 on-demand price list
# (https://aws.amazon.com/ec2/pricing/on-demand/): p3.2xlarge $3.06/h and p3.16xlarge $24.48/h (unchanged since
# p3's launch in 2017; confirmed in a second public price table, onDemandPrice 3.06), p2.xlarge $0.90/h and
# p2.8xlarge $7.20/h (the 2016 launch prices, kept until p2 was retired; from memory of the list, APPROXIMATE).
# us-east-2's p3.2xlarge is taken at the same $3.06 (APPROXIMATE). Spot prices are not in the traces: they are
# `discount` x on-demand (Pricing), 0.3 by default: p3.2xlarge's us-east-1 spot price $0.918/h in an undated
# snapshot of https://aws.amazon.com/ec2/spot/pricing/ is 0.30x (APPROXIMATE; results are given from 0.2 to 0.5).
INSTANCES: dict[str, Instance] = {
    "v100_1": Instance("v100_1", "p3.2xlarge", "v100", 1, 3.06),
    "v100_8": Instance("v100_8", "p3.16xlarge", "v100", 8, 24.48),
    "k80_1": Instance("k80_1", "p2.xlarge", "k80", 1, 0.90),
    "k80_8": Instance("k80_8", "p2.8xlarge", "k80", 8, 7.20),
}

# AWS spot before November 2017 was billed by the started hour, a preempted partial hour free (Billing's
# "hourly-2016"), and sold far below on-demand: Tributary (ATC'18) reports 81-86% below on-demand with its
# overheads. 0.15x is taken as a 2016-like discount: APPROXIMATE (no 2016 price history is in ../shared).
DISCOUNT_2016 = 0.15


@dataclass(frozen=True)
class Pricing:
    """Prices and billing of every market: spot = ``discount`` x on-demand.

    Example:
        >>> p = Pricing(discount=0.3)
        >>> round(p.spot("v100_1"), 3), p.on_demand("k80_1")
        (0.918, 0.9)
    """

    discount: float = 0.3
    billing: str = "per-second"

    def __post_init__(self) -> None:
        if not 0 < self.discount <= 1:
            raise InputError(f"the spot discount must be in (0, 1] (spot price / on-demand), got {self.discount}")
        if self.billing not in BILLINGS:
            raise InputError(f"unknown billing {self.billing!r}: choose from {', '.join(BILLINGS)}")

    @property
    def rule(self) -> Billing:
        return Billing(self.billing)

    def on_demand(self, kind: str) -> float:
        return instance(kind).on_demand

    def spot(self, kind: str) -> float:
        return instance(kind).on_demand * self.discount


def instance(kind: str) -> Instance:
    if kind not in INSTANCES:
        raise InputError(f"no list price for instance kind {kind!r}: known kinds are {', '.join(INSTANCES)}")
    return INSTANCES[kind]


def gavel_speeds(path: str | Path, model: str = "ResNet-50 (batch size 64)") -> dict[str, float]:
    """Each instance kind's training speed in V100s (a p3.2xlarge is 1): Gavel's single-device steps/s of
    ``model`` on its GPU, over the V100's, times its GPU count (8-GPU machines counted as 8 devices' worth).

    Example:
        >>> gavel_speeds("no-such.json")
        Traceback (most recent call last):
        ...
        conveyor.errors.InputError: no Gavel throughput table at no-such.json (see ../shared/gavel/README.md)
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no Gavel throughput table at {path} (see ../shared/gavel/README.md)")
    table = json.loads(path.read_text())
    alone: dict[str, float] = {}
    for gpu in {i.gpu for i in INSTANCES.values()}:
        for key, row in table.get(gpu, {}).items():
            name, scale = ast.literal_eval(key)
            if name == model and scale == 1:
                alone[gpu] = float(row["null"])
    if "v100" not in alone:
        models = sorted({ast.literal_eval(k)[0] for k in table.get("v100", {})})
        raise InputError(f"Gavel's table has no {model!r} on a V100: choose from {', '.join(models)}")
    return {k: i.gpus * alone[i.gpu] / alone["v100"] for k, i in INSTANCES.items() if i.gpu in alone}
